"""What `fit`, `evaluate` and `predict` take: arrays, placed batches, sample weights, and
the logs they hand callbacks."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from mirrored._core import settings as config
from mirrored._core.values import PerReplica, StackedBatches, is_per_replica
from mirrored._train.keras_objectives import is_keras

if TYPE_CHECKING:
    from mirrored._data.input import DistributedDataset

logger = logging.getLogger("mirrored")


class _Logs(dict):  # type: ignore[type-arg]
    """A batch's logs: Keras' dict, filled from the devices only when a callback looks at it
    (its values are this batch's, however late they are read)."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        super().__init__()
        self._read: Callable[[], dict[str, Any]] | None = read

    def _filled(self) -> _Logs:
        if self._read is not None:
            read, self._read = self._read, None
            super().update(read())
        return self


def _filling(name: str) -> Callable[..., Any]:
    method = getattr(dict, name)

    def filled(self: _Logs, *args: Any, **kwargs: Any) -> Any:
        return method(self._filled(), *args, **kwargs)

    filled.__name__ = name
    return filled


for _name in (
    "__getitem__", "__iter__", "__len__", "__contains__", "__repr__", "__eq__", "__setitem__",
    "__delitem__", "get", "keys", "values", "items", "copy", "pop", "popitem", "setdefault",
    "update", "__or__", "__ior__",
):  # fmt: skip
    setattr(_Logs, _name, _filling(_name))


class _PyDatasetEpochs:
    """A `keras.utils.PyDataset` read as Keras' `fit` reads it: its batches by index, in a new
    order each epoch when `shuffle` (seeded), and its `on_epoch_end()` after each pass."""

    def __init__(self, source: Any, shuffle: bool, seed: int) -> None:
        self.source, self.shuffle, self.seed, self.epoch = source, shuffle, seed, 0

    @classmethod
    def wrap(cls, x: Any, *, shuffle: bool, seed: int) -> Any:
        return cls(x, shuffle, seed) if is_keras(x, "PyDataset") else x

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[Any]:
        order = np.arange(len(self.source))
        if self.shuffle:
            np.random.default_rng((self.seed, self.epoch)).shuffle(order)
        self.epoch += 1
        for index in order:
            yield self.source[int(index)]
        self.source.on_epoch_end()


def _is_arrays(x: Any) -> bool:
    if isinstance(x, np.ndarray | jax.Array):
        return True
    if isinstance(x, dict):
        return all(isinstance(v, np.ndarray | jax.Array) for v in jax.tree.leaves(x))
    return False


def _placed_batches(x: Any) -> bool:
    """A list of batches already distributed (their leaves are PerReplica values)."""
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(v, PerReplica) for v in jax.tree.leaves(x[0], is_leaf=is_per_replica))
    )


class _Placed:
    """Batches the caller already distributed: every epoch replays them in order."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches

    def __len__(self) -> int:
        return len(self._batches)

    def epoch_iterator(self, epoch: int, *, skip: int = 0) -> Iterator[Any]:
        del epoch
        return iter(self._batches[skip:])

    def epoch_chunks(self, epoch: int, steps: int, *, skip: int = 0, whole: bool = False) -> None:
        """Placed already: one at a time (`DistributedDataset.epoch_chunks`)."""
        del epoch, steps, skip, whole


def pass_position(epoch: int, steps: int, batches: int) -> tuple[int, int]:
    """Where epoch `epoch` (from 0) starts under Keras' schedule for `steps_per_epoch=steps`
    over data of `batches` batches a pass: (the pass, from 0; the batch within it).

    As Keras' `EpochIterator`, epochs continue through the data: an epoch that reaches the end
    of a pass stops there (short), and the next one starts a new, reshuffled pass.
    """
    done, position = 0, 0
    for _ in range(epoch):
        position += min(steps, batches - position)
        if position >= batches:
            done, position = done + 1, 0
    return done, position


def _batch_args(batch: Any) -> tuple[Any, ...]:
    if not isinstance(batch, tuple | list) or not 1 <= len(batch) <= 3:
        raise ValueError(
            "Expected the dataset to yield (x, y) or (x, y, sample_weight) tuples; found a "
            f"{type(batch).__name__}. Fix: yield tuples, e.g. map each element to (x, y)."
        )
    return tuple(batch)


def _eager_when_asked(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with its steps run eagerly when the trainer's `run_eagerly` is set."""

    @functools.wraps(method)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with config.eager_within(self.run_eagerly):
            return method(self, *args, **kwargs)

    return wrapped


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is None:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
        raise TypeError(
            f"Expected batch_size to be a positive int (the GLOBAL batch size) or None; found "
            f"{batch_size!r} ({type(batch_size).__name__}). Fix: e.g. batch_size=256."
        )
    if batch_size < 1:
        raise ValueError(
            f"Expected batch_size to be a positive int (the GLOBAL batch size) or None; found "
            f"{batch_size}. Fix: e.g. batch_size=256, or leave it unset for Keras' default 32."
        )


def _sample_weights(sample_weight: Any, x: Any) -> np.ndarray:
    weights = np.asarray(sample_weight)
    rows = len(jax.tree.leaves(x)[0])
    if (
        weights.ndim not in (1, 2)
        or weights.shape[0] != rows
        or weights.shape[1:] not in ((), (1,))
    ):
        raise ValueError(
            f"Expected sample_weight with one weight per example of x: shape ({rows},) or "
            f"({rows}, 1); found shape {weights.shape}. Fix: pass one weight per row of x."
        )
    return weights


def _ratio(total: float, count: float) -> float:
    return float(total / count) if count else 0.0  # Keras: divide_no_nan


def _has_per_replica(value: Any) -> bool:
    return any(is_per_replica(v) for v in jax.tree.leaves(value, is_leaf=is_per_replica))


# An execution's batches: a list of K batches, or K batches placed stacked.
Chunk = list[tuple[Any, ...]] | StackedBatches


def _epoch_batches(
    train: DistributedDataset, epoch: int, skip: int, steps: int, whole: bool = False
) -> Iterator[Any]:
    """Epoch `epoch`'s batches from batch `skip` on; with `steps` > 0 and in-memory arrays,
    `steps` at a time, each chunk gathered and placed at once (`epoch_chunks`; `whole`: what
    is left after the last full chunk, one batch a chunk)."""
    chunks = train.epoch_chunks(epoch, steps, skip=skip, whole=whole) if steps else None
    return chunks if chunks is not None else train.epoch_iterator(epoch, skip=skip)


def _next_chunk(batches: Iterator[Any], size: int) -> Chunk:
    """The next `size` batches (fewer at the end), or the K stacked ones `batches` yields."""
    chunk = list(itertools.islice(batches, 1))
    if chunk and isinstance(chunk[0], StackedBatches):
        return chunk[0]  # type: ignore[no-any-return]
    return [_batch_args(b) for b in itertools.chain(chunk, itertools.islice(batches, size - 1))]
