"""Gradient accumulation weighted by examples: k micro-batches make one step on the k-times
larger batch, a ragged last micro-batch included, with one gradient all-reduce per step.

`optax.MultiSteps` (and Keras 3's `gradient_accumulation_steps`) apply the mean of the k
micro-batches' mean gradients: a micro-batch of 4 examples weighs as much as one of 64. Here
each micro-batch's mean gradient is weighted by its real example count, so the applied
gradient is the mean over every example of the k micro-batches, which is the gradient of one
step on their concatenation.

Each replica sums its own (local, not yet all-reduced) gradients into its row of the
accumulator, which is per-replica state (one row per replica, split over them); the k-th
micro-batch all-reduces the sums once and applies the update. The Trainer hands it local
gradients (`local_gradients`); gradients already all-reduced are added by replica 0 only.

Under a `ShardedOptimizer` (`per_replica=False`) the update runs in the global view on the
summed gradients (each micro-batch all-reduces, or reduce-scatters, them as DeepSpeed's ZeRO
does), and the accumulator is one sum split over the replicas like the rest of the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mirrored._core import context as _context
from mirrored._core import mesh as _mesh


class AccumulationState(NamedTuple):
    mini_step: jax.Array  # micro-batches accumulated since the last update (int32)
    gradients: Any  # Σ examples_b · gradient_b, one row per replica (its local sums)
    examples: jax.Array  # Σ examples_b (float32)
    inner_state: Any


def accumulate_by_examples(
    inner: optax.GradientTransformation, every_k: int, *, per_replica: bool = True
) -> optax.GradientTransformationExtraArgs:
    """`inner` applied once per `every_k` calls, to the example-weighted mean of the gradients.

    Each `update(gradients, state, params, examples=n)` gives one micro-batch's mean
    gradient and its example count `n`; the first `every_k - 1` calls return zero updates,
    the last the inner transformation's update of `Σ n_b g_b / Σ n_b`. `per_replica`: one
    row of sums per replica of the entered strategy (else one row: a ShardedOptimizer's).
    """
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> AccumulationState:
        rows, sharding = _replica_rows() if per_replica else (1, None)
        return AccumulationState(
            jnp.zeros((), jnp.int32),
            jax.tree.map(lambda p: _zero_rows(p, rows, sharding), params),
            jnp.zeros((), jnp.float32),
            inner.init(params),
        )

    def update(
        updates: Any, state: AccumulationState, params: Any = None, **extra: Any
    ) -> tuple[Any, AccumulationState]:
        examples = extra.pop("examples", None)
        if examples is None:
            raise TypeError(
                "accumulate_by_examples expected examples= (the micro-batch's real example "
                "count) with the gradients; found none. Fix: optimizer.update(model, grads, "
                "examples=count)."
            )
        examples = jnp.asarray(examples, jnp.float32)
        # This replica's row (inside a step the accumulator holds only that row).
        gradients = jax.tree.map(
            lambda total, g: total.at[0].add(_own_share(examples * g).astype(total.dtype)),
            state.gradients,
            updates,
        )
        total = state.examples + examples

        def apply(_: Any) -> tuple[Any, AccumulationState]:
            mean = jax.tree.map(
                lambda s, g: (_summed_rows(s) / jnp.maximum(total, 1.0)).astype(g.dtype),
                gradients,
                updates,
            )
            new_updates, inner_state = inner.update(mean, state.inner_state, params, **extra)
            zeros = jax.tree.map(_zeros_of, gradients)
            return new_updates, AccumulationState(
                jnp.zeros((), jnp.int32), zeros, jnp.zeros((), jnp.float32), inner_state
            )

        def accumulate(_: Any) -> tuple[Any, AccumulationState]:
            skipped = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), updates)
            return skipped, AccumulationState(
                state.mini_step + 1, gradients, total, state.inner_state
            )

        return jax.lax.cond(state.mini_step == every_k - 1, apply, accumulate, None)  # type: ignore[no-any-return]

    return optax.GradientTransformationExtraArgs(init, update)  # type: ignore[arg-type]


def _replica_rows() -> tuple[int, Any]:
    """The accumulator's rows (the replicas of the strategy whose scope is entered, else one)
    and their sharding (split over the replicas), or None outside a scope."""
    strategy = _context.entered_strategy()
    if strategy is None:
        return 1, None
    return strategy.num_replicas_in_sync, _mesh.split(strategy._mesh)


def _zero_rows(param: Any, rows: int, sharding: Any) -> jax.Array:
    shape, dtype = (rows, *jnp.shape(param)), jnp.result_type(param)
    if sharding is None:
        return jnp.zeros(shape, dtype)
    # Made by a program, so every process of a multi-process strategy holds its rows.
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def _own_share(g: jax.Array) -> jax.Array:
    """What this replica adds: its local gradient, or — a gradient already all-reduced, the
    same on every replica — the whole of it on replica 0 and nothing elsewhere."""
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd or _context.is_varying(g):
        return g
    first = jax.lax.axis_index(_mesh.REPLICA_AXIS) == 0
    return jnp.where(first, g, jnp.zeros_like(g))


def _summed_rows(rows: jax.Array) -> jax.Array:
    """The replicas' sums added up: the one all-reduce of an optimizer step."""
    if _context.is_varying(rows):
        return jax.lax.psum(rows[0], _mesh.REPLICA_AXIS)
    return rows.sum(axis=0)


def _zeros_of(rows: jax.Array) -> jax.Array:
    zeros = jnp.zeros(rows.shape, rows.dtype)
    return _context.as_varying(zeros) if _context.is_varying(rows) else zeros
