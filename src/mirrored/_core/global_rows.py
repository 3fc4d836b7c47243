"""A function of the whole global batch, inside a step on a split batch: Dice, a loss that
returns one number, `rmse`. Such a function is not a mean of per-example terms, so no
combination of the replicas' values gives one device's number; here every replica gathers the
batch's shards and evaluates the function once on the global batch's real rows.

A padded batch's real-row count is a traced value, and a function of rows needs a static
shape: the program is compiled for the counts its batches have (a full batch and a ragged
last one: two programs, as `jax.jit` compiles one per shape). The first trace raises
`RealRowsNeeded`; `run` compiles again knowing the counts (`ReplicaContext.real_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS


class RealRowsNeeded(Exception):
    """Raised while a step is traced: a function of the global batch met a padded batch whose
    real-row count the program does not know; `run` compiles the step again with it."""


def split_context() -> _context.ReplicaContext | None:
    """The replica context while `strategy.run` traces a step on a split batch, else None."""
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd or not ctx.batch_is_split:
        return None
    return ctx


def local_rows(ctx: _context.ReplicaContext, *trees: Any) -> int | None:
    """This replica's rows of the split batch (the mask's length, or the first array's)."""
    if ctx.example_mask is not None:
        return int(ctx.example_mask.shape[0])
    first = next((x for x in jax.tree.leaves(trees) if getattr(x, "ndim", 0)), None)
    return None if first is None else int(first.shape[0])


def is_per_example(values: Any, rows: int | None) -> bool:
    """Whether `values` has one entry per row of the replica's batch (a decomposable term)."""
    return rows is not None and getattr(values, "ndim", 0) >= 1 and values.shape[0] == rows


def on_global_rows(fn: Callable[..., Any], *trees: Any) -> Any:
    """`fn(*trees)` on the global batch's real rows, the same value on every replica.

    Every array leaf with one row per example of this replica's batch is gathered from all
    replicas (in the global batch's order) and cut to the real rows; other leaves pass as they
    are. Outside a step on a split batch, `fn(*trees)` itself. Gradients flow back to each
    replica's rows: a loss `on_global_rows(...) / N` on every replica sums to the global one.
    """
    ctx = split_context()
    if ctx is None:
        return fn(*trees)
    rows = local_rows(ctx, *trees)

    def per_example(x: Any) -> bool:  # a replica's rows differ between replicas
        return (
            isinstance(x, jax.Array)
            and x.ndim >= 1
            and x.shape[0] == rows
            and _context.is_varying(x)
        )

    def gather(x: Any) -> Any:
        if not per_example(x):
            return x
        return jax.lax.all_gather(x, REPLICA_AXIS, tiled=True)

    gathered = jax.tree.map(gather, trees)
    if ctx.example_mask is None:  # not padded: every row is real
        return fn(*gathered)
    options = ctx.real_rows
    if options is None:
        raise RealRowsNeeded
    total = rows * ctx.num_replicas_in_sync  # type: ignore[operator]

    def branch(real: int) -> Callable[[], Any]:
        def cut(x: Any) -> Any:
            whole = isinstance(x, jax.Array) and x.ndim >= 1 and x.shape[0] == total
            return x[:real] if whole else x

        return lambda: fn(*jax.tree.map(cut, gathered))

    if len(options) == 1:
        return branch(options[0])()
    # Several counts in one program (`run_steps`' K batches): the step's count picks its branch.
    index = jnp.sum(jnp.asarray(ctx.example_count) > jnp.asarray(options))
    return jax.lax.switch(index, [branch(c) for c in options])


def first_replica() -> Any:
    """True on replica 0 only (inside a step on a split batch), else True: what a value the
    same on every replica adds to a sum over replicas once."""
    ctx = split_context()
    if ctx is None:
        return True
    return jax.lax.axis_index(REPLICA_AXIS) == 0
