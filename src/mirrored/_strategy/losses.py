"""The loss convention that makes N-replica training equal single-device training.

Both functions follow `tf.nn.compute_average_loss` and `tf.nn.scale_regularization_loss`
(tensorflow/python/ops/nn_impl.py): the same numbers, the same errors.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS


def _replicas(fn_name: str) -> int:
    """Replicas of the running strategy; TensorFlow's RuntimeError in cross-replica context."""
    ctx = _context.current_replica_context()
    if ctx is not None:
        return ctx.num_replicas_in_sync
    strategy = _context.entered_strategy()
    if strategy is None:
        return 1  # TensorFlow's default strategy: one replica
    raise RuntimeError(
        f"You are calling `{fn_name}` in cross replica context, while it was expected to be "
        f"called in replica context: inside the scope of {strategy!r} but outside "
        "strategy.run, where no replica's share of the batch is known.\n"
        "Fix: call it inside the function you give to strategy.run, e.g.\n"
        "  def step(model, x, y):\n"
        f"      loss = mirrored.{fn_name}(...)\n"
        "  strategy.run(step, args=(model, x, y))"
    )


def _per_replica(loss: jax.Array) -> jax.Array:
    """Mark a loss computed from replicated values as each replica's own share of the total.

    A loss computed only from mirrored state and a replicated (host) batch is identical on
    every replica, so its gradient would be counted once instead of once per replica. In
    TensorFlow every replica's loss contributes to the summed gradient; marking the loss as
    varying over the replica axis makes `jax.grad` sum it the same way.
    """
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd:
        return loss
    ctx.mark_replica_aware()
    if _context.is_varying(loss):
        return loss
    return jax.lax.pcast(loss, REPLICA_AXIS, to="varying")


def _global_batch_size(value: Any) -> Any:
    """TensorFlow's checks: an integer (TypeError otherwise), a scalar, positive."""
    array = value if isinstance(value, jax.Array) else np.asarray(value)
    if isinstance(value, bool) or not (
        isinstance(value, numbers.Integral) or jnp.issubdtype(array.dtype, jnp.integer)
    ):
        raise TypeError(
            f"global_batch_size must be an integer; found {value!r} "
            f"({type(value).__name__}, dtype {array.dtype}). Fix: pass the GLOBAL number of "
            "examples as an int, e.g. global_batch_size=per_replica_batch * "
            "strategy.num_replicas_in_sync."
        )
    if array.ndim != 0:
        raise ValueError(
            f"global_batch_size must be scalar; found an array of shape {array.shape}. Fix: "
            "pass one int, the GLOBAL number of examples in the batch."
        )
    if not isinstance(array, jax.core.Tracer) and int(array) <= 0:
        raise ValueError(
            f"global_batch_size must be positive; found {value!r}. Fix: pass the GLOBAL number "
            "of examples in the batch (per-replica size × num_replicas_in_sync)."
        )
    return value


def weighted_losses(losses: jax.Array, sample_weight: Any) -> jax.Array:
    """`losses * sample_weight` after TensorFlow's `squeeze_or_expand_dimensions`."""
    weights = jnp.asarray(sample_weight)
    if weights.ndim and weights.ndim == losses.ndim + 1 and weights.shape[-1] == 1:
        weights = weights[..., 0]  # (B, 1) weights for (B,) losses
    elif weights.ndim and weights.ndim == losses.ndim - 1:
        weights = weights[..., None]  # (B,) weights for (B, T) losses
    try:
        shape = jnp.broadcast_shapes(weights.shape, losses.shape)
    except ValueError:
        shape = None
    if shape != losses.shape:
        raise ValueError(
            f"compute_average_loss expected sample_weight broadcastable to the per-example "
            f"losses of shape {losses.shape}; found shape {np.shape(sample_weight)}. Fix: one "
            "weight per example, shape (batch,) or (batch, 1), or a scalar."
        )
    return (losses * weights).astype(losses.dtype)


def compute_average_loss(
    per_example_loss: Any,
    global_batch_size: int | None = None,
    sample_weight: Any = None,
) -> Any:
    """Sum this replica's per-example losses and divide by the GLOBAL batch size.

    Gradients of mirrored parameters are summed over replicas, so this per-replica loss makes
    the summed gradient exactly the gradient of the mean loss over the global batch. Matches
    `tf.nn.compute_average_loss`: weights of shape (B,), (B, 1) or a scalar; outside every
    scope it is the plain mean over the batch (TensorFlow's default strategy); inside a scope
    but outside `strategy.run`, without `global_batch_size`, it raises `RuntimeError`.

    Args:
        per_example_loss: losses of this replica's examples, leading axis = batch.
        global_batch_size: examples in the global batch, a positive int; default: the real
            examples of a padded batch, else this replica's batch size × `num_replicas_in_sync`.
        sample_weight: optional weights, broadcast against `per_example_loss`.

    Example:
        >>> per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        >>> loss = mirrored.compute_average_loss(per_example)

    Differs from tf.distribute: on a batch padded to a static shape the default divisor is
    the real example count (TensorFlow has no padding: its shards are uneven).
    """
    losses = jnp.asarray(per_example_loss)
    if losses.ndim == 0:
        raise ValueError(
            "compute_average_loss expected per-example losses with a leading batch axis; found a "
            "scalar. A loss already averaged over this replica's shard, divided again by the "
            "replica count, would be wrong whenever shards differ in size.\n"
            "Fix: pass the unreduced losses, e.g. "
            "optax.softmax_cross_entropy_with_integer_labels(logits, y) without .mean()."
        )
    if sample_weight is not None:
        losses = weighted_losses(losses, sample_weight)
    ctx = _context.current_replica_context()
    if ctx is not None:
        ctx.loss_shared = True
    if global_batch_size is not None:
        global_batch_size = _global_batch_size(global_batch_size)
        _check_not_per_replica_size(global_batch_size, losses, ctx)
    else:
        replicas = _replicas("compute_average_loss")
    mask = ctx.example_mask if ctx is not None else None
    if mask is not None:
        if losses.shape[0] != mask.shape[0]:
            raise ValueError(
                f"compute_average_loss expected per-example losses for this replica's "
                f"{mask.shape[0]} rows (the batch is padded, and the padding mask must line up "
                f"with the losses); found shape {losses.shape}. Fix: keep the batch axis first "
                "and unflattened, e.g. a loss of shape (batch,) or (batch, tokens)."
            )
        # Padded rows contribute nothing; the real rows of the global batch are counted once.
        losses = losses * mask.reshape(mask.shape + (1,) * (losses.ndim - 1)).astype(losses.dtype)
        if global_batch_size is None:
            count = ctx.example_count  # type: ignore[union-attr]
            return _per_replica(_div_no_nan(jnp.sum(losses), count.astype(losses.dtype)))
    if global_batch_size is None:
        global_batch_size = losses.shape[0] * replicas
    return _per_replica(
        _div_no_nan(jnp.sum(losses), jnp.asarray(global_batch_size, dtype=losses.dtype))
    )


def _div_no_nan(total: jax.Array, count: jax.Array) -> jax.Array:
    """TensorFlow's `div_no_nan`: an empty batch has loss 0 (and finite gradients), not NaN."""
    empty = count == 0
    return jnp.where(empty, jnp.zeros_like(total), total / jnp.where(empty, 1, count))


def _check_not_per_replica_size(
    global_batch_size: Any, losses: jax.Array, ctx: _context.ReplicaContext | None
) -> None:
    """The classic trap: the per-replica size where the global one belongs (N× gradients)."""
    if ctx is None or not ctx.in_spmd or ctx.num_replicas_in_sync == 1:
        return
    if isinstance(global_batch_size, jax.core.Tracer):
        return
    if ctx.example_mask is None and not ctx.batch_is_split:
        return  # a replicated batch: each replica holds it whole, its size IS the global one
    size, n = int(global_batch_size), ctx.num_replicas_in_sync
    if size != losses.shape[0]:
        return
    raise ValueError(
        f"compute_average_loss expected the GLOBAL batch size; found "
        f"global_batch_size={size}, which is this replica's batch size "
        f"({n} replicas: the global batch is {size * n}). Dividing by the "
        f"per-replica size makes the summed gradients {n}× too large.\n"
        "Fix: compute_average_loss(per_example_loss) (it uses the global batch), or pass "
        f"global_batch_size={size * n}."
    )


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divide a regularization loss by the replica count, so its summed gradient counts once.

    Matches `tf.nn.scale_regularization_loss`, including its `RuntimeError` in cross-replica
    context (inside a scope, outside `strategy.run`).

    Example:
        >>> loss = data_loss + mirrored.scale_regularization_loss(1e-4 * l2)
    """
    n = _replicas("scale_regularization_loss")
    return _per_replica(jnp.sum(jnp.asarray(regularization_loss)) / n)
