"""Preparing the next batches on a background thread while the devices compute."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from mirrored._core import background

T = TypeVar("T")

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _put(box: queue.Queue[Any], stop: threading.Event, item: Any) -> bool:
    while not stop.is_set():
        try:
            box.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def _work(items: Iterator[Any], box: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        for item in items:
            if not _put(box, stop, item):
                return
        _put(box, stop, _END)
    except BaseException as error:  # handed to the consumer, raised there
        _put(box, stop, _Failure(error))


class Prefetcher(Generic[T]):
    """Runs `items` on a daemon thread, keeping at most `depth` finished items waiting.

    An exception raised while producing is raised again by `__next__`, in order. `close()` (or
    garbage collection) stops the thread without consuming the rest.
    """

    def __init__(self, items: Iterator[T], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.starved_s = 0.0  # time the consumer waited on an empty buffer: input too slow
        # The thread holds the queue and the event, not `self`: a consumer that drops the
        # iterator unfinished lets it be collected, and __del__ stops the thread.
        work = (items, self._queue, self._stop)
        self._thread = background.start(_work, "mirrored-prefetch", self._stop, work)

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._queue.empty():
            start = time.perf_counter()
            item = self._queue.get()
            self.starved_s += time.perf_counter() - start
        else:
            item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __del__(self) -> None:
        self._stop.set()
