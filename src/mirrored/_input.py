"""Distributed datasets: global batches in, one shard per replica out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrored._values import PerReplica

if TYPE_CHECKING:
    from mirrored._strategy import Strategy


def _leading_size(leaves: list[Any]) -> int:
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if -1 in sizes:
        raise ValueError(
            "Expected every leaf of a batch to have a leading batch axis; found a scalar. "
            "Fix: yield arrays of shape (batch, ...)."
        )
    if len(sizes) != 1:
        raise ValueError(
            f"Expected every leaf of a batch to have the same leading (batch) size; found sizes "
            f"{sorted(sizes)}. Fix: make features and labels the same length."
        )
    return sizes.pop()


def _as_host_array(x: Any) -> Any:
    if isinstance(x, jax.Array | np.ndarray):
        return x
    if hasattr(x, "__array__") or isinstance(x, list | tuple | int | float):
        array = np.asarray(x)
        if array.dtype != object:
            return array
    raise TypeError(
        f"Expected batch leaves to be arrays (NumPy, JAX, or array-likes); found "
        f"{type(x).__name__}: {x!r:.80}. Fix: convert it to a NumPy array, or drop it from the "
        "batch."
    )


class DistributedDataset:
    """An iterable of distributed batches: each leaf a `PerReplica` split over the replicas.

    Made by `strategy.experimental_distribute_dataset`. Iterating again starts a new epoch
    (reshuffled when `shuffle=True`).
    """

    def __init__(
        self,
        strategy: Strategy,
        source: Any,
        *,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        drop_remainder: bool,
    ) -> None:
        self._strategy = strategy
        self._n = strategy.num_replicas_in_sync
        self._batch_size = batch_size
        self._shuffle = shuffle
        self._seed = seed
        self._drop_remainder = drop_remainder
        self._epoch = 0
        self._treedef: Any = None
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise ValueError(
                    f"Expected batch_size to be a positive int (the GLOBAL batch size); found "
                    f"{batch_size!r}."
                )
            self._arrays = jax.tree.map(_as_host_array, source)
            self._size = _leading_size(jax.tree.leaves(self._arrays))
            if self._size == 0:
                raise ValueError("Expected a non-empty dataset; found arrays with 0 rows.")
            self._source: Iterable[Any] | None = None
        else:
            if isinstance(source, np.ndarray | jax.Array | dict) or not isinstance(
                source, Iterable
            ):
                raise TypeError(
                    "Expected an iterable of GLOBAL batches, or in-memory arrays together with "
                    f"batch_size=...; found {type(source).__name__} without batch_size. Fix: "
                    "strategy.experimental_distribute_dataset((x, y), batch_size=256)."
                )
            self._source = source

    @property
    def num_replicas_in_sync(self) -> int:
        return self._n

    def __len__(self) -> int:
        if self._source is not None:
            return len(self._source)  # type: ignore[arg-type]
        assert self._batch_size is not None
        if self._drop_remainder:
            return self._size // self._batch_size
        return math.ceil(self._size / self._batch_size)

    def _array_batches(self) -> Iterator[Any]:
        assert self._batch_size is not None
        order = np.arange(self._size)
        if self._shuffle:
            order = np.random.default_rng([self._seed, self._epoch]).permutation(self._size)
        for start in range(0, self._size, self._batch_size):
            index = order[start : start + self._batch_size]
            if self._drop_remainder and len(index) < self._batch_size:
                return
            yield jax.tree.map(lambda a, i=index: a[i], self._arrays)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._source) if self._source is not None else self._array_batches()
        self._epoch += 1
        produced = 0
        for batch in batches:
            produced += 1
            yield self._place(batch)
        if produced == 0:
            raise ValueError(
                "Expected the dataset to yield at least one batch; it yielded none. Fix: check "
                "that it is not exhausted (a generator can only be iterated once) or empty."
            )

    def _place(self, batch: Any) -> Any:
        leaves, treedef = jax.tree.flatten(batch)
        if not leaves:
            raise ValueError(f"Expected a batch of arrays; found {batch!r} with no array leaves.")
        if self._treedef is None:
            self._treedef = treedef
        elif treedef != self._treedef:
            raise ValueError(
                f"Expected every batch to have the structure of the first one, {self._treedef}; "
                f"found {treedef}. Fix: yield the same tuple/dict layout every step."
            )
        leaves = [_as_host_array(x) for x in leaves]
        size = _leading_size(leaves)
        if size == 0:
            raise ValueError(
                "Expected a batch with at least one row; found a batch of 0 rows (0 per "
                "replica). Fix: skip empty batches in the dataset."
            )
        if size % self._n:
            raise ValueError(
                f"Expected the global batch size to be divisible by the {self._n} replicas; "
                f"found a batch of {size} rows ({size} / {self._n} = {size / self._n:g} per "
                "replica). Fix: pick a global batch size that is a multiple of "
                f"num_replicas_in_sync, or pass drop_remainder=True to skip a short last batch."
            )
        sharding = self._strategy._split
        placed = [
            jax.device_put(x, sharding)
            if isinstance(x, jax.Array)
            else jax.make_array_from_process_local_data(sharding, x)
            for x in leaves
        ]
        return jax.tree.unflatten(
            treedef, [PerReplica(x, num_replicas=self._n, stacked=False) for x in placed]
        )
