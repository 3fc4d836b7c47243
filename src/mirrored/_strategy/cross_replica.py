"""Cross-replica operations on the host: `reduce`, `gather` and `experimental_local_results`,
counting a padded batch's real rows only (TensorFlow's unevenly split last batch)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrored._core.devices import owning_processes
from mirrored._core.values import PerReplica, ReduceOp, is_per_replica, to_host
from mirrored._run.errors import peer_failures

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike

_REDUCERS = {
    ReduceOp.SUM: jnp.sum,
    ReduceOp.MEAN: jnp.mean,
    ReduceOp.MAX: jnp.max,
    ReduceOp.MIN: jnp.min,
}


@functools.partial(jax.jit, static_argnames=("op", "axes"))
def _reduce_stacked(x: jax.Array, op: ReduceOp, axes: tuple[int, ...]) -> jax.Array:
    # x has a leading replica axis; TensorFlow reduces over replicas and, with axis=k, also over
    # axis k of each replica's value (so MEAN divides by the global element count).
    reducer: Any = _REDUCERS[op]
    return reducer(x, axis=(0, *(a + 1 for a in axes)))


@functools.partial(jax.jit, static_argnames=("op", "axes"))
def _reduce_masked_rows(
    x: jax.Array, mask: jax.Array, op: ReduceOp, axes: tuple[int, ...]
) -> jax.Array:
    # x: (replicas, rows, ...) of a padded batch; mask: the batch's (replicas * rows,) mask;
    # `axes` includes 0, the rows. Reduce over replicas and those axes, counting real rows
    # only, as TensorFlow does on the unpadded, unevenly split batch.
    where = jnp.broadcast_to(mask.reshape(x.shape[:2] + (1,) * (x.ndim - 2)), x.shape)
    axes = (0, *(a + 1 for a in axes))
    if op is ReduceOp.SUM:
        return jnp.sum(x, axis=axes, where=where)
    if op is ReduceOp.MEAN:
        return jnp.mean(x, axis=axes, where=where)
    if jnp.issubdtype(x.dtype, jnp.floating):
        initial: Any = -jnp.inf if op is ReduceOp.MAX else jnp.inf
    elif x.dtype == jnp.bool_:
        initial = op is ReduceOp.MIN
    else:
        info = jnp.iinfo(x.dtype)
        initial = info.min if op is ReduceOp.MAX else info.max
    reducer = jnp.max if op is ReduceOp.MAX else jnp.min
    return reducer(x, axis=axes, where=where, initial=initial)


@functools.partial(jax.jit, static_argnames=("axis",))
def _concat_stacked(x: jax.Array, axis: int) -> jax.Array:
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape
    return x.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2 :])


def _axes(axis: Any, rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`reduce`'s axis (None, an int or a tuple of ints) as sorted non-negative axes."""
    if axis is None:
        return ()
    axes = axis if isinstance(axis, tuple | list) else (axis,)
    if not all(
        isinstance(a, int | np.integer) and not isinstance(a, bool) and -rank <= a < rank
        for a in axes
    ) or len({int(a) % max(rank, 1) for a in axes}) != len(axes):
        fix = (
            "axis=None: each replica's value is a scalar, so only the replicas combine"
            if rank == 0
            else "axis=0 reduces the batch axis too; axis=None combines the replicas only"
        )
        raise ValueError(
            f"Expected axis to be None, an int or a tuple of distinct ints in [{-rank}, {rank}) "
            f"for per-replica values of shape {shape}; found {axis!r}. Fix: {fix}."
        )
    return tuple(sorted(int(a) % rank for a in axes))


def _mask_of(value: Any) -> jax.Array | None:
    return value._mask if isinstance(value, PerReplica) else None


def _refuse_padded(value: Any, what: str, how: str) -> None:
    """Raise when `value` is a padded batch whose padding `what(..., how)` would count."""
    if not isinstance(value, PerReplica) or value._mask is None or value._count is None:
        return
    real, rows = int(to_host(value._count)), value._mask.shape[0]
    if real == rows:
        return
    raise ValueError(
        f"strategy.{what}(..., {how}) expected a value without padding; found a padded batch "
        f"({real} real examples in {rows} rows, per replica shape {value.shape}): the padded "
        "rows would enter the result. In TensorFlow the replicas' values would have different "
        f"shapes here and the {what} would fail.\nFix: {what} along the batch axis, axis=0, "
        "which counts real examples only, or combine per-example values inside strategy.run "
        "(mirrored.compute_average_loss, or a sum weighted by "
        "mirrored.get_replica_context().example_mask)."
    )


def _local_values(value: Any, n: int) -> list[Any]:
    if not isinstance(value, PerReplica):
        return [value] * n
    array = value.global_value
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    out = [s.data[0] for s in shards] if value.stacked else [s.data for s in shards]
    if value._mask is None:
        return out
    # Padding sits at the end of each replica's rows: keep the real ones, as TensorFlow does.
    masks = sorted(value._mask.addressable_shards, key=lambda s: s.index[0].start or 0)
    return [x[: int(np.asarray(m.data).sum())] for x, m in zip(out, masks, strict=True)]


def stacked(strategy: StrategyLike, value: Any) -> jax.Array:
    if isinstance(value, PerReplica):
        if value.num_replicas != strategy.num_replicas_in_sync:
            raise ValueError(
                f"Expected a PerReplica over {strategy.num_replicas_in_sync} replicas; found one "
                f"over {value.num_replicas}. Fix: reduce with the strategy that produced it."
            )
        return value.stacked_value()
    # A plain value counts as mirrored: every replica holds the same copy.
    x = jnp.asarray(value)
    return jnp.broadcast_to(x, (strategy.num_replicas_in_sync, *x.shape))


def reduce(strategy: StrategyLike, reduce_op: ReduceOp | str, value: Any, axis: int | None) -> Any:
    """`Strategy.reduce` (its docstring says what axis and padding mean)."""
    op = ReduceOp.parse(reduce_op)

    def one(v: Any) -> jax.Array:
        with peer_failures():
            return reduce_one(v)

    def reduce_one(v: Any) -> jax.Array:
        if op is ReduceOp.MEAN and axis is None and getattr(v, "_share", False):
            _warn_mean_of_shares()
        if axis is None and not _on_every_replica(strategy, v):
            one_value = _reduce_one_value(strategy, op, v)
            if one_value is not None:
                return one_value
        values = stacked(strategy, v)
        axes = _axes(axis, values.ndim - 1, values.shape[1:])
        mask = _mask_of(v)
        if 0 in axes and mask is not None:
            return _reduce_masked_rows(values, mask, op, axes)
        _refuse_padded(v, "reduce", f"axis={axis}")
        return _reduce_stacked(values, op, axes)

    return jax.tree.map(one, value, is_leaf=is_per_replica)


def _on_every_replica(strategy: StrategyLike, value: Any) -> bool:
    """Whether `value` is per replica or held by every replica's device (an output of
    `strategy.run` the same on every replica, a mirrored variable's value): not one value
    from the host."""
    if isinstance(value, PerReplica) or strategy.num_replicas_in_sync == 1:
        return True
    if isinstance(value, jax.Array):
        return value.sharding.device_set >= set(strategy._replicated.device_set)
    return False


def _reduce_one_value(strategy: StrategyLike, op: ReduceOp, value: Any) -> jax.Array | None:
    """TensorFlow's reduction of a value that is not per replica (a Python number, a NumPy
    array, an array on one device). Over several processes (`MultiWorkerMirroredStrategy`,
    TensorFlow's `testReduceHostTensor`): each process's value once, reduced over the
    processes (every process must pass such a value, of one shape and dtype). On one
    process (`MirroredStrategy`'s `reduce_non_distributed_value`): SUM of zeros is zeros,
    of anything else an error, as it would count the value N times; None for the other ops
    (the value itself, as every replica held it)."""
    host = np.asarray(value)
    dtype = jax.dtypes.canonicalize_dtype(host.dtype)
    owners = owning_processes(strategy.extended.worker_devices)
    if len(owners) > 1 and len(owners) == jax.process_count():
        from jax.experimental import multihost_utils

        with peer_failures():
            every = np.asarray(multihost_utils.process_allgather(host))
        return jnp.asarray(_reduce_stacked(jnp.asarray(every, dtype), op, ()), dtype)
    if op is not ReduceOp.SUM:
        return None
    if np.all(host == 0):
        return jnp.zeros(host.shape, dtype)
    n = strategy.num_replicas_in_sync
    shown = repr(value) if host.size <= 8 else f"an array of shape {host.shape}"
    where = "" if len(owners) == 1 else f" (a strategy over {len(owners)} of the processes)"
    raise ValueError(
        "Expected strategy.reduce('SUM', value, axis=None) to be given per-replica values "
        f"(what strategy.run returns); found {shown} ({type(value).__name__}), one value "
        f"that is not per replica, which TensorFlow refuses to sum over {n} replicas{where} "
        f"(it would count it {n} times). Fix: reduce the PerReplica that strategy.run "
        "returned, or use the value as it is ('MEAN' returns it unchanged)."
    )


_warned_shares: list[bool] = []


def _warn_mean_of_shares() -> None:
    """Once: MEAN over replicas of values from a step that called compute_average_loss."""
    if _warned_shares:
        return
    _warned_shares.append(True)
    logging.getLogger("mirrored.loss").warning(
        "strategy.reduce('MEAN', ...) of a scalar per replica from a step that called "
        "mirrored.compute_average_loss: if it is the loss, each replica's value is its share "
        "of the batch loss (divided by the GLOBAL batch), and their MEAN is the loss / N. "
        "Fix: strategy.reduce('SUM', per_replica_loss, axis=None), as TensorFlow's tutorial "
        "does. (A per-replica value that is not a share averages correctly: then ignore "
        "this, or silence logging.getLogger('mirrored.loss').)"
    )


def gather(strategy: StrategyLike, value: Any, axis: int) -> Any:
    """`Strategy.gather`: the replicas' values in replica order, real rows only on axis 0."""

    def one(v: Any) -> jax.Array:
        values = stacked(strategy, v)
        rank = values.ndim - 1
        if rank == 0:
            raise ValueError(_scalar_gather("strategy.gather"))
        if not isinstance(axis, int) or not -rank <= axis < rank:
            raise ValueError(
                f"Expected axis to be an int in [{-rank}, {rank}) for per-replica values of "
                f"shape {values.shape[1:]}; found {axis!r}. Fix: axis=0 concatenates the "
                "replicas' batches."
            )
        mask = _mask_of(v)
        if axis % rank == 0:
            split_batch = isinstance(v, PerReplica) and not v.stacked
            rows = v.global_value if split_batch else _concat_stacked(values, 0)
            if mask is None:
                return rows
            return jnp.asarray(to_host(rows)[to_host(mask)])  # only the real rows
        _refuse_padded(v, "gather", f"axis={axis}")
        return _concat_stacked(values, axis % rank)

    return jax.tree.map(one, value, is_leaf=is_per_replica)


def local_results(strategy: StrategyLike, value: Any) -> tuple[Any, ...]:
    """`Strategy.experimental_local_results`: real rows only, each on its own device."""
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
    n = sum(1 for d in strategy.extended.worker_devices if d.process_index == jax.process_index())
    with jax.set_mesh(None):  # slicing one device's shard must not see the scope's mesh
        columns = [_local_values(leaf, n) for leaf in leaves]
    return tuple(jax.tree.unflatten(treedef, [c[i] for c in columns]) for i in range(n))


def _scalar_gather(where: str) -> str:
    return (
        f"{where} expected per-replica values of rank 1 or more (TensorFlow's rule: gather "
        "concatenates along an existing axis); found a scalar per replica. Fix: "
        "strategy.experimental_local_results(value) for each replica's scalar, "
        "strategy.reduce('SUM' or 'MEAN', value, axis=None) for one number, or gather "
        "value[None] (shape (1,)) for a vector of one value per replica."
    )
