"""Gradient accumulation weighted by examples: k micro-batches make one step on the k-times
larger batch, a ragged last micro-batch included.

`optax.MultiSteps` (and Keras 3's `gradient_accumulation_steps`) apply the mean of the k
micro-batches' mean gradients: a micro-batch of 4 examples weighs as much as one of 64. Here
each micro-batch's mean gradient is weighted by its real example count, so the applied
gradient is the mean over every example of the k micro-batches, which is the gradient of one
step on their concatenation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class AccumulationState(NamedTuple):
    mini_step: jax.Array  # micro-batches accumulated since the last update (int32)
    gradients: Any  # Σ examples_b · gradient_b
    examples: jax.Array  # Σ examples_b (float32)
    inner_state: Any


def accumulate_by_examples(
    inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
    """`inner` applied once per `every_k` calls, to the example-weighted mean of the gradients.

    Each `update(gradients, state, params, examples=n)` gives one micro-batch's mean
    gradient and its example count `n`; the first `every_k - 1` calls return zero updates,
    the last the inner transformation's update of `Σ n_b g_b / Σ n_b`.
    """
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> AccumulationState:
        return AccumulationState(
            jnp.zeros((), jnp.int32),
            jax.tree.map(jnp.zeros_like, params),
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
        gradients = jax.tree.map(
            lambda total, g: total + (examples * g).astype(total.dtype), state.gradients, updates
        )
        total = state.examples + examples

        def apply(_: Any) -> tuple[Any, AccumulationState]:
            mean = jax.tree.map(lambda g: (g / jnp.maximum(total, 1.0)).astype(g.dtype), gradients)
            new_updates, inner_state = inner.update(mean, state.inner_state, params, **extra)
            zeros = jax.tree.map(jnp.zeros_like, gradients)
            return new_updates, AccumulationState(
                jnp.zeros((), jnp.int32), zeros, jnp.zeros((), jnp.float32), inner_state
            )

        def accumulate(_: Any) -> tuple[Any, AccumulationState]:
            skipped = jax.tree.map(jnp.zeros_like, updates)
            return skipped, AccumulationState(
                state.mini_step + 1, gradients, total, state.inner_state
            )

        return jax.lax.cond(state.mini_step == every_k - 1, apply, accumulate, None)  # type: ignore[no-any-return]

    return optax.GradientTransformationExtraArgs(init, update)  # type: ignore[arg-type]
