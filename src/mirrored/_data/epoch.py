"""`iter(dataset)`: one epoch's distributed batches, one at a time (`next`), or K at a time
for `strategy.run_steps` when the source is in-memory arrays (`stacked`).

K batches asked for at once are gathered at once on the host and placed in one transfer per
leaf (the dataset's `epoch_chunks`, as `fit` reads them), not one at a time through a
prefetch queue: a custom loop of `run_steps` gets `fit`'s input path. The batches, their order,
padding and masks are the same either way, and a loop may mix `next` and `run_steps`: each
switch goes on from the batches handed out so far.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from mirrored._core.values import StackedBatches


class _Dataset(Protocol):
    def epoch_iterator(self, epoch: int, *, skip: int = 0) -> Iterator[Any]: ...

    def epoch_chunks(self, epoch: int, steps: int, *, skip: int = 0) -> Iterator[Any] | None: ...


# `Epoch.stacked`'s answer when K batches cannot be gathered at once (another kind of source,
# or K batches over the chunk bound): take them one at a time.
ONE_AT_A_TIME = object()


class Epoch(Iterator[Any]):
    """Epoch `epoch` of `dataset`, read one batch at a time or K at a time; at its end,
    check_numerics' pending steps are looked at (a non-finite value in one of a loop's last
    steps raises as the loop ends, not at a later read or at exit)."""

    def __init__(self, dataset: _Dataset, epoch: int, strategy: Any) -> None:
        self._dataset = dataset
        self._epoch = epoch
        self._strategy = strategy
        self._taken = 0  # batches handed out
        self._source: Iterator[Any] | None = None  # started on first use
        self._steps: int | None = None  # the source's K; None: one batch at a time
        self._single: set[int] = set()  # the K that cannot be gathered at once

    def __next__(self) -> Any:
        if self._source is None or self._steps is not None:
            self._switch(self._dataset.epoch_iterator(self._epoch, skip=self._taken), None)
        assert self._source is not None
        try:
            batch = next(self._source)
        except StopIteration:
            self._strategy._check_pending()
            raise
        self._taken += 1
        return batch

    def stacked(self, steps: int) -> StackedBatches | object | None:
        """The next `steps` batches stacked on a step axis (fewer at the epoch's end), None
        when the epoch has ended, or `ONE_AT_A_TIME`."""
        if steps in self._single:
            return ONE_AT_A_TIME
        if self._steps != steps:
            chunks = self._dataset.epoch_chunks(self._epoch, steps, skip=self._taken)
            if chunks is None:
                self._single.add(steps)
                return ONE_AT_A_TIME
            self._switch(chunks, steps)
        assert self._source is not None
        chunk = next(self._source, None)
        if chunk is None:
            self._strategy._check_pending()
            return None
        self._taken += len(chunk)
        return chunk  # type: ignore[no-any-return]

    def _switch(self, source: Iterator[Any], steps: int | None) -> None:
        """Read from `source` from now on; the previous one's thread, if any, stops."""
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
        self._source, self._steps = source, steps

    def get_next(self) -> Any:
        """TensorFlow's `iterator.get_next()`: the next distributed batch (StopIteration at the
        end, where TensorFlow raises OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """TensorFlow's `iterator.get_next_as_optional()`: the next distributed batch in an
        `Optional`, empty at the epoch's end (TensorFlow's input guide loops on it:
        `while (optional := it.get_next_as_optional()).has_value(): ...`)."""
        try:
            return Optional(next(self))
        except StopIteration:
            return Optional()

    def __getattr__(self, name: str) -> Any:  # the prefetcher's `starved_s`, say
        source = self.__dict__.get("_source")
        if source is None or name.startswith("__") or not hasattr(source, name):
            raise AttributeError(
                f"A distributed dataset's iterator has no attribute {name!r}. Fix: next(it) "
                "or it.get_next() for the next batch (it.get_next_as_optional() at the "
                "epoch's end without StopIteration); strategy.run_steps(step, it, steps=K) "
                "for K of them."
            )
        return getattr(source, name)


_EMPTY = object()


class Optional:
    """TensorFlow's `tf.experimental.Optional` of a distributed batch (what
    `get_next_as_optional` returns): `has_value()`, then `get_value()`."""

    __slots__ = ("_value",)

    def __init__(self, value: Any = _EMPTY) -> None:
        self._value = value

    def has_value(self) -> bool:
        return self._value is not _EMPTY

    def get_value(self) -> Any:
        if self._value is _EMPTY:
            raise ValueError(
                "Expected an Optional holding the next batch; found an empty one: the "
                "iterator's epoch has ended (TensorFlow raises InvalidArgumentError here). "
                "Fix: check optional.has_value() first, and stop the loop when it is False."
            )
        return self._value

    def __repr__(self) -> str:
        return f"Optional(has_value={self.has_value()})"
