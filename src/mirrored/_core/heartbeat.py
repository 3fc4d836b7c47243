"""What this process is doing, for the hang watchdog (`mirrored._run.hang`).

The step path writes a few attributes of one object (no lock, no system call: a step pays
nanoseconds); the watchdog thread reads them. `beats` grows at every change of phase, so a
process whose `beats` stands still has not moved.

Phases: "start" (before the first step), "compile" (the first call of a program: tracing and
XLA's compilation), "step" (dispatching a step, and the dispatch bound's wait for an earlier
one), "input" (the next batch of a distributed dataset), "read" (a result read on the host:
`reduce`, `gather`), "checkpoint" (saving or restoring), "exit" (the script has ended), "host"
(anything else: the user's code between steps).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Heartbeat:
    __slots__ = ("beats", "fn", "phase", "steps", "waited")

    def __init__(self) -> None:
        self.beats = 0  # changes of phase so far
        self.steps = 0  # steps dispatched (every step function; run_steps counts K)
        self.phase = "start"
        self.fn = ""  # the last step function: "train_step at train.py:12"
        self.waited = 0.0  # seconds the host waited for the devices (dispatch bound, reads)


BEAT = Heartbeat()
VERDICT_DIR_ENV = "MIRRORED_VERDICT_DIR"  # the watchdog writes its verdict here for the launcher

# Phases that wait for the devices (and so for the other processes' collectives); "exit":
# the script ended and the process waits in JAX's shutdown for the others.
WAITING = frozenset({"step", "read", "exit"})
# Phases that may legitimately take long without a step: the watchdog allows them more time.
SLOW = frozenset({"start", "compile", "checkpoint"})


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as `name` (the previous phase is back afterwards)."""
    beat = BEAT
    previous = beat.phase
    beat.beats += 1
    beat.phase = name
    start = time.perf_counter()
    try:
        yield
    finally:
        if name in WAITING:
            beat.waited += time.perf_counter() - start
        beat.beats += 1
        beat.phase = previous


def marked(name: str) -> Callable[[F], F]:
    """A function whose calls are the phase `name` (a checkpoint's save, say)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]

    return decorate
