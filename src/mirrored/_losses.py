"""The loss convention that makes N-replica training equal single-device training."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from mirrored import _context


def _num_replicas() -> int:
    ctx = _context.current_replica_context()
    if ctx is not None:
        return ctx.num_replicas_in_sync
    strategy = _context.entered_strategy()
    return strategy.num_replicas_in_sync if strategy is not None else 1


def compute_average_loss(
    per_example_loss: Any,
    global_batch_size: int | None = None,
    sample_weight: Any = None,
) -> Any:
    """Sum this replica's per-example losses and divide by the GLOBAL batch size.

    Gradients of mirrored parameters are summed over replicas, so this per-replica loss makes
    the summed gradient exactly the gradient of the mean loss over the global batch.

    Args:
        per_example_loss: losses of this replica's examples, leading axis = batch.
        global_batch_size: examples in the global batch; default: this replica's batch size
            times `num_replicas_in_sync`.
        sample_weight: optional weights, broadcast against `per_example_loss`.

    Example:
        >>> per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        >>> loss = mirrored.compute_average_loss(per_example)
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
        losses = losses * jnp.asarray(sample_weight, dtype=losses.dtype)
    ctx = _context.current_replica_context()
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
            return jnp.sum(losses) / ctx.example_count.astype(losses.dtype)  # type: ignore[union-attr]
    if global_batch_size is None:
        global_batch_size = losses.shape[0] * _num_replicas()
    elif isinstance(global_batch_size, bool) or (
        isinstance(global_batch_size, int) and global_batch_size <= 0
    ):
        raise ValueError(
            f"Expected global_batch_size to be a positive int; found {global_batch_size!r}. "
            "Fix: pass the GLOBAL batch size (per-replica size × num_replicas_in_sync)."
        )
    elif (
        isinstance(global_batch_size, int)
        and global_batch_size == losses.shape[0]
        and _num_replicas() > 1
        and ctx is not None
    ):
        # The classic trap: the per-replica size where the global one belongs (N× gradients).
        n = _num_replicas()
        raise ValueError(
            f"compute_average_loss expected the GLOBAL batch size; found "
            f"global_batch_size={global_batch_size}, which is this replica's batch size "
            f"({n} replicas: the global batch is {global_batch_size * n}). Dividing by the "
            f"per-replica size makes the summed gradients {n}× too large.\n"
            "Fix: compute_average_loss(per_example_loss) (it uses the global batch), or pass "
            f"global_batch_size={global_batch_size * n}."
        )
    return jnp.sum(losses) / jnp.asarray(global_batch_size, dtype=losses.dtype)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divide a regularization loss by the replica count, so its summed gradient counts once.

    Example:
        >>> loss = data_loss + mirrored.scale_regularization_loss(1e-4 * l2)
    """
    return jnp.sum(jnp.asarray(regularization_loss)) / _num_replicas()
