"""K batches of in-memory arrays gathered at once, for K steps in one program (`fit` with
`steps_per_execution` = K reading from the host).

Each chunk is one (K, rows, …) block per leaf and device, 64-byte aligned and filled by one
`np.take` of that device's rows of the K batches (padding rows included, as `array_batches` pads
them), all placed in one call: no per-batch `device_put` and no stacking copy on the devices.
On CPU an aligned block is placed without a copy (the device array then uses it), so a block's
memory is refilled for a later chunk only once no array uses it (`_Buffers`): never while a
queued program may still read it.
"""

from __future__ import annotations

import functools
import math
import mmap
import threading
import weakref
from collections.abc import Iterator, Sequence
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
    """K global batches of this process's rows, stacked on a leading step axis: which rows of
    the arrays each holds (gathered by `gather`, per device, when placed)."""

    treedef: Any
    sources: list[Any]  # the arrays' leaves
    rows: np.ndarray  # (K, rows of this process): the rows of `sources`, padding included
    mask: np.ndarray  # (K, rows of this process): the real examples
    reals: tuple[int, ...]  # each batch's real examples, over every process
    size: int  # each batch's padded global size
    offset: int  # this process's first row of each global batch


def gather(chunk: HostChunk, begin: int, end: int) -> list[np.ndarray]:
    """Each leaf's (K, end - begin, ...) block of this process's rows [begin, end) of the K
    batches: one `np.take` into an aligned buffer (`aligned_empty`)."""
    flat = chunk.rows[:, begin:end].reshape(-1)
    out = []
    for x in chunk.sources:
        buffer = aligned_empty((len(chunk.rows), end - begin, *np.shape(x)[1:]), x.dtype)
        # take(mode="clip") skips fancy indexing's bounds check; the rows are in range.
        np.take(x, flat, axis=0, mode="clip", out=buffer.reshape(len(flat), *buffer.shape[2:]))
        out.append(buffer)
    return out


class _Buffers:
    """Memory mappings to hold chunks, reused once no array uses them any more.

    A fresh mapping costs its page faults (measured: a 25 MB chunk took longer to gather into
    than 32 single batches); malloc'd buffers stay in glibc's arenas once freed (a 100 MB fit at
    eight devices held 1.1 GB more at its peak). A mapping comes back here when the last array
    viewing it goes, device arrays placed from it without a copy included, so no queued
    program can read a buffer while it is refilled."""

    def __init__(self, keep_bytes: int) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._keep_bytes = keep_bytes  # at most this much kept unused
        self._kept = 0
        self._lock = threading.Lock()

    def array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            mapping = free.pop() if free else None
            self._kept -= nbytes if mapping is not None else 0
        mapping = mapping if mapping is not None else mmap.mmap(-1, nbytes)
        whole = np.frombuffer(mapping, dtype)
        # Every view of it (the caller's, a zero-copy device array's) keeps `whole` alive.
        weakref.finalize(whole, self._give, mapping)
        return whole.reshape(shape)

    def _give(self, mapping: mmap.mmap) -> None:
        with self._lock:
            if self._kept + len(mapping) <= self._keep_bytes:
                self._free.setdefault(len(mapping), []).append(mapping)
                self._kept += len(mapping)


# A chunk holds at most CHUNK_BYTES (else `fit` reads one batch at a time): K batches in flight
# and prefetched stay a bounded amount of host memory, and the mappings kept for reuse too.
CHUNK_BYTES = 256 * 2**20
_BUFFERS = _Buffers(keep_bytes=4 * CHUNK_BYTES)


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array on its own page-aligned memory (so `ALIGNMENT`-aligned), reused
    for a later chunk once nothing uses it."""
    dtype = np.dtype(dtype)
    if 0 in shape:
        return np.empty(shape, dtype)
    return _BUFFERS.array(shape, dtype)


def bounded_chunks(arrays: Any, *, batch_size: int, steps: int, **options: Any) -> Any:
    """`array_chunks`, or None when K batches of `arrays` would be over `CHUNK_BYTES`."""
    per_row = sum(
        np.dtype(x.dtype).itemsize * math.prod(np.shape(x)[1:]) for x in jax.tree.leaves(arrays)
    )
    if per_row * batch_size * steps > CHUNK_BYTES:
        return None
    return array_chunks(arrays, batch_size=batch_size, steps=steps, **options)


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
    whole: bool = False,
) -> Iterator[HostChunk]:
    """Epoch `epoch`'s batches of `arrays` from batch `skip` on, `steps` at a time (the last
    chunk holds what is left; `whole`: chunks of `steps` only, what is left one batch a
    chunk): the rows, padding and masks of `array_batches`' batches with
    `drop_remainder=False`, in the same order."""
    leaves, treedef = jax.tree.flatten(arrays)
    leaves = [np.asarray(x) for x in leaves]
    size = _batching.leading_size(leaves)
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else None
    total = _batching.padded_size(batch_size, batch_size, num_replicas)  # every batch's size
    local = _batching.process_rows(total, *processes)
    width = local.stop - local.start
    starts = list(range(0, size, batch_size))[skip:]
    groups = [starts[first : first + steps] for first in range(0, len(starts), steps)]
    if whole and groups and len(groups[-1]) < steps:
        groups += [[start] for start in groups.pop()]
    for group in groups:
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
        yield HostChunk(treedef, leaves, index, mask, tuple(reals), total, local.start)


def place(
    strategy: Strategy, processes: int, masks: dict[Any, Any], chunk: HostChunk
) -> StackedBatches:
    """`chunk` on the devices: each leaf (K, global batch, ...) split over the replicas on its
    second axis, each device's block gathered on its own and placed in one call (on CPU,
    without a copy); the masks and counts, few and small, cached in `masks`."""
    spans = _spans(strategy, len(chunk.reals), chunk.size)
    blocks = [gather(chunk, a - chunk.offset, b - chunk.offset) for a, b in spans.values()]
    facts = (chunk.treedef, chunk.mask, chunk.reals, chunk.size)
    return _stacked(strategy, processes, masks, blocks, *facts)


def place_batches(
    strategy: Strategy, masks: dict[Any, Any], batches: Sequence[Any]
) -> StackedBatches:
    """K padded global batches (`input.HostBatch`es) of one process, each leaf of one shape
    and dtype in every batch (Keras' batches, `compile(steps_per_execution=K)`), on the
    devices as `place` puts a chunk: each device's rows of the K batches copied once into one
    aligned block per leaf (no per-batch transfer, no stacking copy on the devices)."""
    first = batches[0]
    spans = _spans(strategy, len(batches), first.size)
    blocks = []
    for a, b in spans.values():
        mine = []
        for i, x in enumerate(first.leaves):
            block = aligned_empty((len(batches), b - a, *np.shape(x)[1:]), x.dtype)
            for k, batch in enumerate(batches):
                block[k] = batch.leaves[i][a:b]
            mine.append(block)
        blocks.append(mine)
    mask = np.asarray([b.mask for b in batches])  # one process: each global batch's mask
    reals = tuple(int(real) for real in mask.sum(axis=1))
    return _stacked(strategy, 1, masks, blocks, first.treedef, mask, reals, first.size)


def _spans(strategy: Strategy, steps: int, size: int) -> dict[Any, tuple[int, int]]:
    """Each of this process's devices' rows [begin, end) of a global batch of `size` rows
    (one device: all of them)."""
    by_step = NamedSharding(strategy._mesh, PartitionSpec(None, REPLICA_AXIS))
    blocks = by_step.addressable_devices_indices_map((steps, size))
    return {d: blocks[d][1].indices(size)[:2] for d in blocks}  # type: ignore[index]


def _stacked(
    strategy: Strategy,
    processes: int,
    masks: dict[Any, Any],
    blocks: list[list[np.ndarray]],
    treedef: Any,
    mask: np.ndarray,
    reals: tuple[int, ...],
    size: int,
) -> StackedBatches:
    """`StackedBatches` of each device's `blocks` (one (K, its rows, ...) block per leaf, in
    `_spans`' device order): K global batches of `size` rows, `mask` this process's rows of
    them, `reals` each one's real examples over every process (the device masks and counts,
    few and small, cached in `masks`)."""
    by_step = NamedSharding(strategy._mesh, PartitionSpec(None, REPLICA_AXIS))
    steps = len(reals)
    devices = list(_spans(strategy, steps, size))
    placed = jax.device_put(blocks, [[d] * len(blocks[0]) for d in devices])
    leaves: list[jax.Array] = [
        jax.make_array_from_single_device_arrays(
            (steps, size, *x.shape[2:]), by_step, [shard[i] for shard in placed]
        )
        for i, x in enumerate(blocks[0])
    ]
    key = ("chunk", size, reals, mask.tobytes())
    if key not in masks:
        if len(masks) > 16:
            masks.clear()
        count = jax.device_put(np.asarray(reals, np.int32), strategy._replicated)
        if processes == 1:
            on_devices = jax.device_put(mask, by_step)
        else:
            on_devices = jax.make_array_from_process_local_data(by_step, mask, (steps, size))
        masks[key] = (on_devices, count)
    step_mask, count = masks[key]
    first, first_mask, first_count = _first_step(
        leaves, step_mask, count, split=strategy._split, replicated=strategy._replicated
    )
    n = strategy.num_replicas_in_sync
    batch = jax.tree.unflatten(
        treedef,
        [
            PerReplica(x, num_replicas=n, stacked=False, mask=first_mask, count=first_count)
            for x in first
        ],
    )
    return StackedBatches(treedef, leaves, step_mask, count, batch)


@functools.partial(jax.jit, static_argnames=("split", "replicated"))
def _first_step(leaves: Any, mask: Any, count: Any, *, split: Any, replicated: Any) -> Any:
    """The first of K stacked batches, laid out as a distributed batch."""
    first = [jax.lax.with_sharding_constraint(x[0], split) for x in leaves]
    return (
        first,
        jax.lax.with_sharding_constraint(mask[0], split),
        jax.lax.with_sharding_constraint(count[0], replicated),
    )
