"""`strategy.run_steps`: K steps of one step function in one program, the batches stacked on a
leading step axis."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.values import StackedBatches, is_per_replica
from mirrored._run.arguments import _Sorted, sort_leaves, state_as_arguments

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike
    from mirrored._run.placement import Placement


class Steps(NamedTuple):
    """K steps' inputs: the first call's leaves, sorted, and the stacked split inputs."""

    fn: Callable[..., Any]
    first: Sequence[Any]  # the first step's positional arguments
    leaves: list[Any]
    treedef: Any
    sorted_: _Sorted
    masked: bool
    inputs: tuple[list[Any], list[Any]]  # the stacked split and replicated inputs


def stacked_steps(
    placement: Placement,
    strategy: StrategyLike,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    batches: list[Any] | StackedBatches,
) -> Steps:
    """The inputs of `len(batches)` steps of `fn(*args, *batch, **kwargs)` in one program."""
    fn, args = state_as_arguments(fn, args)
    bad = [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_leaf) if is_per_replica(x)]
    if bad:
        raise ValueError(
            "strategy.run_steps expected the batches from the iterator and mirrored state "
            f"in args; found a PerReplica value in args ({bad[0].shape} per replica). A "
            "value that differs per replica cannot stay fixed over several steps.\n"
            "Fix: let the iterator yield it with each batch, or call strategy.run per step."
        )
    # K batches already stacked: the first one gives the structure.
    singles = [batches.first] if isinstance(batches, StackedBatches) else batches
    calls = [(*args, *(b if isinstance(b, tuple) else (b,))) for b in singles]
    leaves, first = jax.tree.flatten((calls[0], kwargs), is_leaf=_is_leaf)
    treedef: Any = first
    sorted_ = sort_leaves(placement, leaves, calls[0], kwargs)
    if isinstance(batches, StackedBatches):
        return _stacked_inputs(fn, calls[0], leaves, treedef, sorted_, batches)
    columns: list[list[Any]] = [[column] for column in sorted_.split]
    masks, counts = [sorted_.mask], [sorted_.count]
    # The later steps differ from the first in their batch alone (args and kwargs hold no
    # distributed value): flatten and sort its few leaves, not the model's and optimizer's.
    batch_def: Any = jax.tree.structure(calls[0][len(args) :], is_leaf=_is_leaf)
    for call in calls[1:]:
        batch_leaves, step_def = jax.tree.flatten(call[len(args) :], is_leaf=_is_leaf)
        if step_def != batch_def:
            raise ValueError(
                "strategy.run_steps expected every batch of the iterator to have the "
                f"structure of the first; found {step_def} after {batch_def}. Fix: "
                "yield batches of one structure."
            )
        step = sort_leaves(placement, batch_leaves, call, kwargs)
        for column, value in zip(columns, step.split, strict=True):
            column.append(value)
        masks.append(step.mask)
        counts.append(step.count)
    for column in columns:
        shapes = [(tuple(x.shape), str(x.dtype)) for x in column]
        other = next((k for k, shape in enumerate(shapes) if shape != shapes[0]), None)
        if other is not None:
            raise ValueError(
                f"strategy.run_steps expected the {len(calls)} batches of one program to "
                f"have one shape; found step 0's {shapes[0][0]} {shapes[0][1]} and step "
                f"{other}'s {shapes[other][0]} {shapes[other][1]} (batches padded each to its "
                "own length, say); these steps did not run. Fix: pad every batch to one shape "
                "(tf.data: padded_batch(..., padded_shapes=...) with fixed lengths), or call "
                "strategy.run per batch (Trainer.fit does so for such batches)."
            )
    masked = any(m is not None for m in masks)
    stacked = _stack_steps(columns, masks if masked else [], counts if masked else [], strategy)
    split, rep = (
        ([*stacked[0], stacked[1]], [*sorted_.rep, stacked[2]])
        if masked
        else (stacked[0], sorted_.rep)
    )
    return Steps(fn, calls[0], leaves, treedef, sorted_, masked, (split, rep))


def _stacked_inputs(
    fn: Callable[..., Any],
    first: Sequence[Any],
    leaves: list[Any],
    treedef: Any,
    sorted_: _Sorted,
    batches: StackedBatches,
) -> Steps:
    """`Steps` of K batches placed already stacked (`StackedBatches`): their leaves, masks and
    counts are the program's inputs as they are."""
    if len(sorted_.split) != len(batches.leaves):
        raise ValueError(
            "strategy.run_steps expected the batches and mirrored state as its only "
            f"inputs; found {len(sorted_.split) - len(batches.leaves)} other distributed "
            "value(s). Fix: pass the state in args and the batches from the iterator."
        )
    split = [*batches.leaves, batches.mask]
    rep = [*sorted_.rep, batches.count]
    return Steps(fn, first, leaves, treedef, sorted_, True, (split, rep))


def _stack_steps(
    columns: list[list[jax.Array]], masks: list[Any], counts: list[Any], strategy: StrategyLike
) -> tuple[list[jax.Array], Any, Any]:
    """Each split input's K values stacked on a new leading step axis (the batch axis stays
    split over the replicas); with `masks`, the K masks and real-example counts likewise
    (a batch without padding gets an all-real mask)."""
    by_step = NamedSharding(strategy._mesh, PartitionSpec(None, REPLICA_AXIS))
    if masks:
        rows = next(m.shape[0] for m in masks if m is not None)
        masks = [jnp.ones((rows,), jnp.bool_) if m is None else m for m in masks]
        counts = [jnp.int32(rows) if c is None else c for c in counts]
    stacked, mask, count = _stack_jit(
        tuple(map(tuple, columns)), tuple(masks), tuple(counts), by_step, strategy._replicated
    )
    return list(stacked), mask, count


@functools.partial(jax.jit, static_argnames=("sharding", "replicated"))
def _stack_jit(columns: Any, masks: Any, counts: Any, sharding: Any, replicated: Any) -> Any:
    """One program for all the stacking (jnp.stack outside jit dispatches once per value)."""
    stack = [jax.lax.with_sharding_constraint(jnp.stack(c), sharding) for c in columns]
    mask = jax.lax.with_sharding_constraint(jnp.stack(masks), sharding) if masks else None
    count = jax.lax.with_sharding_constraint(jnp.stack(counts), replicated) if counts else None
    return stack, mask, count
