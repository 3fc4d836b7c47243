"""K batches of in-memory arrays gathered at once, for K steps in one program (`fit` with
`steps_per_execution` = K reading from the host).

Each chunk is one (K, B, …) buffer per leaf, 64-byte aligned and filled by one `np.take` of
the K batches' rows (padding rows included, as `array_batches` pads them), then placed with
one transfer per leaf: no per-batch `device_put` and no stacking copy on the devices. On CPU an
aligned buffer is placed without a copy (the device array then uses it), so every chunk gets a
fresh buffer rather than a reused one that a queued program may still be reading.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.values import PerReplica, StackedBatches
from mirrored._data import batching as _batching

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike as Strategy

ALIGNMENT = 64  # bytes: XLA:CPU places a host array this aligned without copying it


class HostChunk(NamedTuple):
    """K global batches of this process's rows, stacked on a leading step axis."""

    treedef: Any
    leaves: list[np.ndarray]  # (K, rows of this process, ...)
    mask: np.ndarray  # (K, rows of this process): the real examples
    reals: tuple[int, ...]  # each batch's real examples, over every process
    size: int  # each batch's padded global size


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array whose data starts on an `ALIGNMENT`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % ALIGNMENT
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)


def array_chunks(
    arrays: Any,
    *,
    batch_size: int,
    steps: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    skip: int,
    num_replicas: int,
    processes: tuple[int, int],
) -> Iterator[HostChunk]:
    """Epoch `epoch`'s batches of `arrays` from batch `skip` on, `steps` at a time (the last
    chunk holds what is left): the rows, padding and masks of `array_batches`' batches with
    `drop_remainder=False`, in the same order."""
    leaves, treedef = jax.tree.flatten(arrays)
    size = _batching.leading_size(leaves)
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else None
    total = _batching.padded_size(batch_size, batch_size, num_replicas)  # every batch's size
    local = _batching.process_rows(total, *processes)
    width = local.stop - local.start
    starts = list(range(0, size, batch_size))[skip:]
    for first in range(0, len(starts), steps):
        group = starts[first : first + steps]
        index = np.empty((len(group), width), np.int64)
        mask = np.zeros((len(group), width), bool)
        reals = []
        for k, start in enumerate(group):
            rows = min(batch_size, size - start)
            reals.append(rows)
            begin, end = start + local.start, start + min(local.stop, rows)
            real = max(0, end - begin)
            mine = np.arange(begin, end) if order is None else order[begin:end]
            if real < width:  # the ragged last batch: copies of the real rows (`pad_to`)
                head = start if order is None else order[start]
                source = mine if real else np.array([head])
                mine = np.concatenate([mine, source[np.arange(width - real) % len(source)]])
            index[k] = mine
            mask[k, :real] = True
        flat = index.reshape(-1)
        out = []
        for x in leaves:
            buffer = aligned_empty((len(group), width, *np.shape(x)[1:]), np.asarray(x).dtype)
            # take(mode="clip") skips fancy indexing's bounds check; the rows are in range.
            np.take(x, flat, axis=0, mode="clip", out=buffer.reshape(len(flat), *buffer.shape[2:]))
            out.append(buffer)
        yield HostChunk(treedef, out, mask, tuple(reals), total)


def place(
    strategy: Strategy, processes: int, masks: dict[Any, Any], chunk: HostChunk
) -> StackedBatches:
    """`chunk` on the devices: each leaf (K, global batch, ...) split over the replicas on its
    second axis, in one transfer; the masks and counts, few and small, cached in `masks`."""
    by_step = NamedSharding(strategy._mesh, PartitionSpec(None, REPLICA_AXIS))
    steps = len(chunk.reals)

    def to_devices(x: np.ndarray) -> jax.Array:
        if processes == 1:
            return jax.device_put(x, by_step)
        shape = (steps, chunk.size, *np.shape(x)[2:])
        return jax.make_array_from_process_local_data(by_step, x, shape)

    leaves = [to_devices(x) for x in chunk.leaves]
    key = ("chunk", chunk.size, chunk.reals, chunk.mask.tobytes())
    if key not in masks:
        if len(masks) > 16:
            masks.clear()
        count = jax.device_put(np.asarray(chunk.reals, np.int32), strategy._replicated)
        masks[key] = (to_devices(chunk.mask), count)
    mask, count = masks[key]
    first, first_mask, first_count = _first_step(
        leaves, mask, count, split=strategy._split, replicated=strategy._replicated
    )
    n = strategy.num_replicas_in_sync
    batch = jax.tree.unflatten(
        chunk.treedef,
        [
            PerReplica(x, num_replicas=n, stacked=False, mask=first_mask, count=first_count)
            for x in first
        ],
    )
    return StackedBatches(chunk.treedef, leaves, mask, count, batch)


@functools.partial(jax.jit, static_argnames=("split", "replicated"))
def _first_step(leaves: Any, mask: Any, count: Any, *, split: Any, replicated: Any) -> Any:
    """The first of K stacked batches, laid out as a distributed batch."""
    first = [jax.lax.with_sharding_constraint(x[0], split) for x in leaves]
    return (
        first,
        jax.lax.with_sharding_constraint(mask[0], split),
        jax.lax.with_sharding_constraint(count[0], replicated),
    )
