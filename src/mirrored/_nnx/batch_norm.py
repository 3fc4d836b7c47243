"""BatchNorm across replicas: statistics over the real rows of a padded batch, moving statistics
averaged over the replicas (TensorFlow's rule), and the synchronized mode (`SyncBatchNorm`,
`tf.keras.layers.BatchNormalization(synchronized=True)`) whose batch statistics cover the global
batch."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import patching
from mirrored._core.mesh import REPLICA_AXIS


def _axes(rank: int, axes: Any) -> tuple[int, ...]:
    axes = axes if isinstance(axes, tuple | list) else (axes,)
    return tuple(sorted({a + rank if a < 0 else a for a in axes}))


def _example_mask(x: Any, reduction_axes: tuple[int, ...]) -> Any:
    """This replica's real-row mask, shaped to broadcast against `x`, or None when unpadded."""
    mask = _context.row_mask(x) if 0 in reduction_axes else None
    return None if mask is None else mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def _statistics(
    x: Any,
    reduction_axes: tuple[int, ...],
    mask: Any,
    dtype: Any,
    synchronized: bool,
    *,
    fast: bool,
) -> tuple[Any, Any]:
    """Mean and variance over the real rows (of every replica when `synchronized`).

    Sums and counts are all-reduced, so replicas holding different numbers of real rows weigh
    each row once (averaging per-replica means would not). The variance follows the layer's
    own `use_fast_variance`, as Flax computes it: `fast`, one pass, E[x²] − E[x]² (one
    all-reduce); otherwise two passes, E[(x − mean)²], which keeps its digits when
    |mean| ≫ std. A replica with no real row at all uses its padded rows locally (copies of
    real rows, so finite) rather than divide by zero.
    """
    dtype = jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    stat_shape = tuple(n for a, n in enumerate(x.shape) if a not in reduction_axes)
    full = x.size // max(1, math.prod(stat_shape))  # elements behind each statistic
    weight = None if mask is None else jnp.asarray(mask, dtype)
    if weight is None:
        count = jnp.full(stat_shape, full, dtype)
    else:
        weight = weight.reshape((1,) * (x.ndim - weight.ndim) + weight.shape)
        count = _count(weight, x.shape, reduction_axes, stat_shape)
        if not synchronized:  # an all-padding replica falls back on its (finite) padded rows
            empty = jnp.all(count == 0)
            weight = jnp.where(empty, jnp.ones_like(weight), weight)
            count = jnp.where(empty, jnp.full(stat_shape, full, dtype), count)
    if synchronized and not _context.is_varying(count):  # no mask: each replica's own rows
        count = jax.lax.pcast(count, REPLICA_AXIS, to="varying")
    weighted = x if weight is None else x * weight
    total = weighted.sum(reduction_axes)
    if fast:
        squares = (weighted * x).sum(reduction_axes)
        if synchronized:
            total, squares, count = jax.lax.psum((total, squares, count), REPLICA_AXIS)
        safe = jnp.maximum(count, 1)
        mean = total / safe
        return mean, jnp.maximum(0.0, squares / safe - mean * mean)
    if synchronized:
        total, count = jax.lax.psum((total, count), REPLICA_AXIS)
    safe = jnp.maximum(count, 1)
    mean = total / safe
    centered = x - _expand(mean, x.ndim, reduction_axes)
    if weight is not None:
        centered = centered * weight
    squares = (centered * centered).sum(reduction_axes)
    if synchronized:
        squares = jax.lax.psum(squares, REPLICA_AXIS)
    return mean, squares / safe


def _count(
    weight: Any, shape: tuple[int, ...], reduction_axes: tuple[int, ...], stat_shape: Any
) -> Any:
    """Σ weight over `reduction_axes` as if broadcast to `shape`, without materialising it."""
    summed = tuple(a for a in reduction_axes if weight.shape[a] != 1)
    scale = math.prod(shape[a] for a in reduction_axes if weight.shape[a] == 1)
    count = weight.sum(summed, keepdims=True) * scale
    return jnp.broadcast_to(count.squeeze(reduction_axes), stat_shape)


def _expand(stat: Any, rank: int, reduction_axes: tuple[int, ...]) -> Any:
    """A statistic over `reduction_axes`, reshaped to broadcast against the input."""
    return stat.reshape(_kept(rank, reduction_axes, stat))


def _kept(rank: int, reduction_axes: tuple[int, ...], stat: Any) -> tuple[int, ...]:
    shape = iter(stat.shape)
    return tuple(1 if a in reduction_axes else next(shape) for a in range(rank))


# Per-replica batch statistics of fewer rows than this are noisy (the usual rule of thumb).
SMALL_BATCH = 32


def note_per_replica_statistics(kind: str, rows: int) -> None:
    """Record, in the step being traced on a split batch, a BatchNorm that normalises with
    the replica's `rows` alone when they are few (`run` warns once; `verify` reports it)."""
    ctx = _context.current_replica_context()
    if (
        ctx is not None
        and ctx.in_spmd
        and ctx.batch_is_split
        and ctx.num_replicas_in_sync > 1
        and rows < SMALL_BATCH
    ):
        ctx.per_replica_norm = (kind, rows)


def small_batch_warning(fn_name: str, kind: str, rows: int, n: int) -> str:
    return (
        f"{fn_name!r}: {kind} computes its batch statistics from each replica's {rows} rows "
        f"(the global batch split over {n} replicas, as TensorFlow's MirroredStrategy does); "
        f"statistics of fewer than ~{SMALL_BATCH} rows are noisy, and training can be visibly "
        "worse than on one device. Fix: compute them over the global batch, "
        "`mirrored.layers.SyncBatchNorm` (Flax) or `keras.layers.BatchNormalization("
        "synchronized=True)` (one all-reduce per layer), or raise the global batch size."
    )


def batch_norm(
    layer: nnx.BatchNorm,
    x: Any,
    use_running_average: bool | None,
    mask: Any,
    *,
    synchronized: bool,
) -> Any:
    """`nnx.BatchNorm.__call__` with padded rows masked out (and global statistics if asked)."""
    if use_running_average is None:
        use_running_average = layer.use_running_average
    if use_running_average is None:
        raise ValueError(
            f"Expected use_running_average for {type(layer).__name__}; found None in the call "
            "and the constructor. Fix: pass use_running_average=True/False to either, or call "
            "model.train() / model.eval()."
        )
    feature_axes = _axes(x.ndim, layer.axis)
    reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
    scale = layer.scale[...] if layer.scale is not None else None
    bias = layer.bias[...] if layer.bias is not None else None
    x, mean, var, scale, bias = layer.promote_dtype(
        (x, layer.mean[...], layer.var[...], scale, bias), dtype=layer.dtype
    )
    if not use_running_average:
        if not synchronized:
            note_per_replica_statistics(type(layer).__name__, x.shape[0])
        rows = _example_mask(x, reduction_axes)
        if rows is not None:
            mask = rows if mask is None else jnp.logical_and(mask, rows)
        mean, var = _statistics(
            x, reduction_axes, mask, layer.dtype, synchronized, fast=layer.use_fast_variance
        )
        momentum = layer.momentum
        layer.mean[...] = jax.lax.stop_gradient(momentum * layer.mean[...] + (1 - momentum) * mean)
        layer.var[...] = jax.lax.stop_gradient(momentum * layer.var[...] + (1 - momentum) * var)
    feature_shape = [x.shape[a] if a in feature_axes else 1 for a in range(x.ndim)]
    y = x - mean.reshape(feature_shape)
    mul = jax.lax.rsqrt(var.reshape(feature_shape) + layer.epsilon)
    parts = [x]
    if scale is not None:
        mul = mul * scale.reshape(feature_shape)
        parts.append(scale)
    y = y * mul
    if bias is not None:
        y = y + bias.reshape(feature_shape)
        parts.append(bias)
    return jnp.asarray(y, layer.dtype if layer.dtype is not None else jnp.result_type(*parts))


class SyncBatchNorm(nnx.BatchNorm):
    """BatchNorm whose training statistics cover the global batch (TensorFlow's
    `BatchNormalization(synchronized=True)`, formerly `SyncBatchNormalization`).

    Takes `nnx.BatchNorm`'s arguments. Inside `strategy.run` and `Trainer.fit`, the mean and
    variance are computed over every replica's real rows with one all-reduce, so N-replica
    training equals single-device training on the same global batches; elsewhere (a plain
    call, one device) it is `nnx.BatchNorm`. Moving statistics are then identical on every
    replica without averaging.

    Example:
        >>> self.norm = mirrored.layers.SyncBatchNorm(64, momentum=0.9, rngs=rngs)
    """

    def __init__(self, num_features: int, **kwargs: Any) -> None:
        axis_name = kwargs.pop("axis_name", None)
        if axis_name not in (None, REPLICA_AXIS) or kwargs.get("axis_index_groups") is not None:
            raise ValueError(
                f"Expected SyncBatchNorm to synchronise over all replicas; found axis_name="
                f"{axis_name!r}, axis_index_groups={kwargs.get('axis_index_groups')!r}. Fix: "
                "leave both unset (SyncBatchNorm always uses every replica in sync)."
            )
        super().__init__(num_features, **kwargs)

    def __call__(self, x: Any, use_running_average: bool | None = None, *, mask: Any = None) -> Any:
        ctx = _context.current_replica_context()
        synchronized = ctx is not None and ctx.in_spmd
        return batch_norm(self, x, use_running_average, mask, synchronized=synchronized)


_flax_call = nnx.BatchNorm.__call__


def _masked_call(
    self: nnx.BatchNorm, x: Any, use_running_average: bool | None = None, *, mask: Any = None
) -> Any:
    if self.axis_index_groups is not None or self.axis_name not in (None, REPLICA_AXIS):
        return _flax_call(self, x, use_running_average, mask=mask)
    ctx = _context.current_replica_context()
    synchronized = (self.axis_name == REPLICA_AXIS or _synchronize_all.get()) and (
        ctx is not None and ctx.in_spmd
    )
    return batch_norm(self, x, use_running_average, mask, synchronized=synchronized)


_BATCH_NORM_CALL = patching.target(
    "flax.nnx.BatchNorm",
    "__call__",
    reason="batch statistics over real rows only, global ones when synchronized",
    checked="flax 0.12.8",
)
_synchronize_all: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mirrored_synchronize_batch_norm", default=False
)


def synchronizing() -> bool:
    """Whether `synchronized_batch_norm` is on (programs traced under it differ)."""
    return _synchronize_all.get()


@contextlib.contextmanager
def synchronized_batch_norm() -> Iterator[None]:
    """While a step is traced, every `nnx.BatchNorm` computes global-batch statistics.

    `verify` compares an N-replica step with a single-device one this way: TensorFlow's
    per-replica statistics differ from one device's by design, not by a bug.
    """
    token = _synchronize_all.set(True)
    try:
        with masked_batch_norm():
            yield
    finally:
        _synchronize_all.reset(token)


@contextlib.contextmanager
def masked_batch_norm() -> Iterator[None]:
    """While a padded batch's step is traced, `nnx.BatchNorm` leaves padded rows out.

    Flax's own `mask=` averages per-replica means when synchronised and divides by zero on
    a replica with no real rows, so the statistics are computed here instead.
    """
    with patching.temporarily(_BATCH_NORM_CALL, _masked_call):
        yield
