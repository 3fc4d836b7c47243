"""In-memory arrays kept on the devices across `fit`, `evaluate` and `predict` calls
(`steps_per_execution` > 1): placed once, each step gathers its batch there, from the same
index batches as the host path."""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from mirrored._core import coordination as _coordination
from mirrored._core import settings as config
from mirrored._core.devices import owning_processes
from mirrored._data import batching as _batching
from mirrored._train.batches import _is_arrays, _sample_weights

# Arrays remembered (placed or seen once) per trainer, least recently used forgotten first.
REMEMBERED = 8


class _Entry(NamedTuple):
    objects: tuple[weakref.ref[Any], ...]  # the arrays given (an id can be reused once freed)
    placed: tuple[Any, ...] | None  # None: seen once, placed if given again


class DeviceData:
    """A trainer's arrays on the devices, by `identity`: those placed (within the
    per-device budget `mirrored.config.device_data_bytes()`, all of them together) and those
    seen once, to be placed if they come again."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()

    def forget(self) -> None:
        self._entries.clear()

    def placed(self) -> list[tuple[Any, ...]]:
        return [e.placed for e in self._entries.values() if e.placed is not None]

    def arrays(
        self,
        strategy: Any,
        steps_per_execution: int,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        uses: int,
        in_use: tuple[Any, ...] | None = None,
    ) -> tuple[Any, ...] | None:
        """(x,), (x, y) or (x, y, one weight per example) placed on every device of
        `strategy`, or None to read batches from the host. From the host: one step per
        execution (measured: as fast as from the devices), a dataset, a strategy over some
        but not all processes of a job, or arrays over the budget (on CPU devices, unless
        set: none; there, K batches gathered at once on the host and placed without a copy
        are as fast) or over what is left of it beside `in_use` (arrays the caller still
        reads: fit's training arrays while it validates). On several processes the chief's
        choice holds for every process (each places its own copy on its own devices).

        Placed once, the arrays stay for the trainer's later calls on the same arrays (the
        same objects, shapes and dtypes, and the same values at a sample of rows): the copy is
        paid once, not per call. A first call that reads them at most the replica count of
        times (`uses`: fit's epochs; 1 for `evaluate` and `predict`) reads from the host
        (placing N copies up front moves more than N reads; measured slower), and the arrays
        are placed by the next call over them."""
        devices = list(strategy._replicated.device_set)
        processes = len(owning_processes(devices))
        if steps_per_execution == 1 or processes not in (1, jax.process_count()):
            return None
        parts = (x,) if y is None else (x, y)
        if not all(_is_arrays(a) for a in parts):
            return None
        if sample_weight is not None:
            parts = (*parts, _sample_weights(sample_weight, x))
        arrays = jax.tree.map(_batching.as_host_array, parts)
        given = jax.tree.leaves((x, y, sample_weight))
        room = config.device_data_bytes(devices[0].platform) - _nbytes(in_use)
        size = _nbytes(arrays)
        if size > room and processes == 1:
            return None
        _batching.leading_size(jax.tree.leaves(arrays))  # one length, or its error
        key = identity((x, y, sample_weight), arrays)
        entry = self._entries.get(key)
        if entry is not None and not _same(entry.objects, given):
            entry = None  # other arrays, at the ids of freed ones
        if entry is None:
            # Entries for the same objects with other values (changed in place) are stale.
            for old in [k for k in self._entries if k[0] == key[0]]:
                del self._entries[old]
        else:
            self._entries.move_to_end(key)
        place = size <= room and (entry is not None or uses > strategy.num_replicas_in_sync)
        if processes > 1:
            # Every process must take the same path (the programs differ): the chief's.
            agreed = _coordination.chiefs("place" if place else "host", tag="arrays on devices")
            place = agreed == "place"
        try:
            objects = tuple(weakref.ref(a) for a in given)
        except TypeError:  # an array type without weak references: not remembered
            objects = None
        if not place or (objects is None and processes == 1):
            if size <= room and objects is not None:
                self._remember(key, _Entry(objects, None))  # placed if given again
            return None
        if entry is not None and entry.placed is not None:
            return entry.placed
        # Room within the budget: the least recently used placed arrays (not `in_use`) are
        # dropped to "seen once".
        for k, old in list(self._entries.items()):
            if _nbytes([p for p in self.placed() if p is not in_use]) + size <= room:
                break
            if old.placed is not None and old.placed is not in_use:
                self._entries[k] = _Entry(old.objects, None)
        placed = tuple(jax.tree.map(functools.partial(_replicated, strategy), arrays))
        if objects is not None:
            self._remember(key, _Entry(objects, placed))
        return placed

    def _remember(self, key: Any, entry: _Entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > REMEMBERED:
            self._entries.popitem(last=False)


def indices(x: Any) -> np.ndarray:
    """The row numbers of `x`: batched like `x`, they are the index batches into its copy
    on the devices (the same rows, padding and masks)."""
    return np.arange(len(jax.tree.leaves(x)[0]))


def _replicated(strategy: Any, array: np.ndarray) -> jax.Array:
    """`array` on every device of `strategy`, each process placing its own copy on its own
    devices (no check that the processes' copies agree: each device reads the rows its
    process would have sent from the host, so the numbers are the host path's either way)."""
    sharding = strategy._replicated
    if jax.process_count() == 1:
        return jax.device_put(array, sharding)
    local = sorted(sharding.addressable_devices, key=lambda d: d.id)
    shards = jax.device_put([array] * len(local), local)
    return jax.make_array_from_single_device_arrays(array.shape, sharding, shards)


def _same(objects: tuple[weakref.ref[Any], ...], given: list[Any]) -> bool:
    return all(r() is a for r, a in zip(objects, given, strict=True))


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def identity(given: Any, arrays: Any) -> tuple[Any, ...]:
    """What says that a call was given the same arrays again: the objects passed, and each
    array's shape, dtype and values at up to 64 rows spread over it. An array changed in
    place elsewhere must be passed as a new array (or `Trainer.forget_data()`)."""
    objects = (jax.tree.structure(given), tuple(id(a) for a in jax.tree.leaves(given)))
    facts = []
    for a in jax.tree.leaves(arrays):
        rows = np.unique(np.linspace(0, len(a) - 1, num=min(64, len(a)), dtype=np.int64))
        facts.append((a.shape, a.dtype.str, hash(np.ascontiguousarray(a[rows]).tobytes())))
    return (objects, tuple(facts))
