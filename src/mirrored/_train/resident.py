"""In-memory arrays kept on the devices across `fit`, `evaluate` and `predict` calls
(`steps_per_execution` > 1): placed once, each step gathers its batch there, from the same
index batches as the host path."""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import numpy as np

from mirrored._core import coordination as _coordination
from mirrored._core import settings as config
from mirrored._core.devices import owning_processes
from mirrored._data import batching as _batching
from mirrored._train.batches import _is_arrays, _sample_weights

# Arrays remembered (placed or seen once) per trainer, least recently used forgotten first.
REMEMBERED = 8


class DeviceData:
    """A trainer's arrays on the devices, by `identity`: those placed (within the
    per-device budget `mirrored.config.device_data_bytes()`, all of them together) and those
    seen once, to be placed if they come again."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[Any, tuple[Any, ...] | None] = (
            collections.OrderedDict()
        )

    def forget(self) -> None:
        self._entries.clear()

    def placed(self) -> list[tuple[Any, ...]]:
        return [v for v in self._entries.values() if v is not None]

    def arrays(
        self,
        strategy: Any,
        steps_per_execution: int,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        uses: int,
    ) -> tuple[Any, ...] | None:
        """(x,), (x, y) or (x, y, one weight per example) placed on every device of
        `strategy`, or None to read batches from the host. From the host: one step per
        execution (measured: as fast as from the devices), a dataset, a strategy over some
        but not all processes of a job, or arrays over the budget (on CPU devices, unless
        set: none; there, K batches gathered at once on the host and placed without a copy
        are as fast). On several processes the chief's choice holds for every process (each
        places its own copy on its own devices).

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
        budget = config.device_data_bytes(devices[0].platform)
        size = _nbytes(arrays)
        if size > budget and processes == 1:
            return None
        _batching.leading_size(jax.tree.leaves(arrays))  # one length, or its error
        key = identity((x, y, sample_weight), arrays)
        kept = self._entries.get(key)
        if key in self._entries:
            self._entries.move_to_end(key)
        else:
            # The same objects with other values (changed in place): the old copy is stale.
            for old in [k for k in self._entries if k[0] == key[0]]:
                del self._entries[old]
        place = size <= budget and (key in self._entries or uses > strategy.num_replicas_in_sync)
        if processes > 1:
            # Every process must take the same path (the programs differ): the chief's.
            place = _coordination.chiefs("place" if place else "host") == "place"
        if not place:
            if size <= budget:
                self._remember(key, None)  # placed if the next call reads them again
            return None
        if kept is not None:
            return kept
        # Room within the budget: the least recently used placed arrays go first.
        while self.placed() and _nbytes(self.placed()) + size > budget:
            oldest = next(k for k, v in self._entries.items() if v is not None)
            del self._entries[oldest]
        placed = tuple(jax.tree.map(functools.partial(_replicated, strategy), arrays))
        self._remember(key, placed)
        return placed

    def _remember(self, key: Any, placed: tuple[Any, ...] | None) -> None:
        self._entries[key] = placed
        self._entries.move_to_end(key)
        while len(self._entries) > REMEMBERED:
            self._entries.popitem(last=False)


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


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def identity(given: Any, arrays: Any) -> tuple[Any, ...]:
    """What says that a call was given the same arrays again: the objects passed, and each
    array's shape, dtype and values at up to 64 rows spread over it. An array changed in
    place elsewhere must be passed as a new array (or `Trainer.forget_data()`)."""
    objects = tuple(id(a) for a in jax.tree.leaves(given))
    facts = []
    for a in jax.tree.leaves(arrays):
        rows = np.unique(np.linspace(0, len(a) - 1, num=min(64, len(a)), dtype=np.int64))
        facts.append((a.shape, a.dtype.str, hash(np.ascontiguousarray(a[rows]).tobytes())))
    return (objects, tuple(facts))
