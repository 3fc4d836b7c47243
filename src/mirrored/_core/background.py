"""mirrored's background threads, stopped and joined before the interpreter finalizes.

In Python 3.11 and 3.12, a daemon thread that comes back from a C++ call (a key-value call to
`jax.distributed`'s coordination service, a `device_put`) while the interpreter finalizes is
ended by `pthread_exit` as it takes the GIL again; the unwinding through XLA's C++ frames
then aborts a process whose work is done ("FATAL: exception not rethrown", exit code 134).
So every thread of mirrored that calls into JAX is started here with a stop event, and one
exit handler, registered after JAX's own (atexit is last in, first out: it runs first, while
JAX's client is still up), sets the events and waits for the threads to return.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

JOIN_S = 5.0  # at exit, the longest wait for all threads together (each call is short)

_THREADS: list[tuple[threading.Thread, threading.Event]] = []
_LOCK = threading.Lock()
_HOOKED: list[bool] = []
_FIRST: list[Callable[[], None]] = []  # run at exit before the threads are stopped


def start(
    target: Callable[..., Any], name: str, stop: threading.Event, args: tuple[Any, ...] = ()
) -> threading.Thread:
    """Run `target(*args)` on a daemon thread named `name`. `stop` is set at exit: `target`
    checks it between its calls and returns."""
    import jax  # noqa: F401  (JAX's exit handler is registered before this one)

    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _LOCK:
        _THREADS[:] = [(t, e) for t, e in _THREADS if t.is_alive()]
        _THREADS.append((thread, stop))
        if not _HOOKED:
            atexit.register(stop_all)
            _HOOKED.append(True)
    thread.start()
    return thread


def first_at_exit(fn: Callable[[], None]) -> None:
    """Run `fn` at exit while the threads still run, before they are stopped (once)."""
    if fn not in _FIRST:
        _FIRST.append(fn)


def stop_all(timeout_s: float = JOIN_S) -> None:
    """At exit: the `first_at_exit` functions, then stop every thread started here and wait
    for them, `timeout_s` at most in all."""
    try:
        for fn in _FIRST:
            fn()
    finally:
        _stop_threads(timeout_s)


def _stop_threads(timeout_s: float) -> None:
    with _LOCK:
        threads = list(_THREADS)
    for _, stop in threads:
        stop.set()
    deadline = time.monotonic() + timeout_s
    current = threading.current_thread()
    for thread, _ in threads:
        if thread is not current:
            thread.join(max(0.0, deadline - time.monotonic()))
