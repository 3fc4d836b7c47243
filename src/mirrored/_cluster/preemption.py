"""TensorFlow's `PreemptionCheckpointHandler` and `TerminationConfig`.

On a termination notice to any process (SIGTERM, which SLURM, Kubernetes and spot VMs send
before they kill, or a `termination_watcher_fn` returning True), every process finishes the
same step S, the chief writes one checkpoint tagged S, and every process exits with 42 (the
restart code a launcher or platform recognises: `mirrored launch --max-restarts`). Creating the
handler again after the restart restores that checkpoint, and `total_run_calls` says where the
loop was.

Several processes agree on S through JAX's preemption service (`jax.distributed` catches
SIGTERM and spreads the notice through its coordination service;
`multihost_utils.reached_preemption_sync_point(step)` is True on every process at the same
step, the largest step any process had reached plus one). One process (`MirroredStrategy`,
TensorFlow's local mode) catches SIGTERM itself and saves before its next step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from mirrored._core import background
from mirrored._persist import checkpoint as _checkpoint
from mirrored._run.errors import coordination_client

logger = logging.getLogger("mirrored")

RESTART_EXIT_CODE = 42  # TensorFlow's default exit code after a preemption checkpoint
_RUN_CALLS = "total_run_calls"  # the extra a preemption checkpoint carries
WATCH_INTERVAL_S = 0.5  # how often a termination_watcher_fn is polled
NOTICE_STEPS = 4  # a grace period counts from this many steps before the agreed one


@dataclasses.dataclass
class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of a termination, saves and exits.

    Args:
        termination_watcher_fn: called every 0.5 s on a background thread; True is a
            termination notice, as SIGTERM is (without one, SIGTERM is the notice). It must
            not block.
        exit_fn: called after the preemption checkpoint is saved; default `sys.exit(42)`.
        grace_period: seconds between the notice and the kill (default 0: save at the agreed
            step, then exit). With more, the handler saves at the agreed step, trains on, and
            saves again at a second agreed step before the period ends (leaving room for the
            longest step so far twice and the first save's time, plus 1 s), then exits.
        save_fn: replaces the checkpoint the handler writes (called on every process at the
            agreed step, with no arguments).

    Example:
        >>> config = mirrored.TerminationConfig(exit_fn=lambda: sys.exit(7))
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], Any] | None = None
    grace_period: float | None = None
    save_fn: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(
                    f"Expected TerminationConfig({name}=...) to be a function or None; found "
                    f"{value!r}. Fix: pass a function (e.g. {name}=lambda: ...)."
                )
        grace = self.grace_period
        if grace is not None and (
            isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0
        ):
            raise ValueError(
                "Expected TerminationConfig(grace_period=...) to be None or a number of seconds "
                f">= 0 (the time between the termination notice and the kill); found {grace!r}. "
                "Fix: e.g. grace_period=30, or leave it out to save at once and exit."
            )


def _preemption_service() -> Any:
    """JAX's preemption sync manager when `jax.distributed` runs with it, else None."""
    from jax._src import distributed

    return distributed.global_state.preemption_sync_manager


class TerminationNotice:
    """Whether a termination notice (SIGTERM, or `watcher_fn` returning True) has reached
    every process by a given step.

    With several processes, JAX's preemption service agrees on the step: `reached(step)` is
    True on every process at the same step, the largest any had reached plus one; the
    processes must call it at every step, with the same numbers. With one, a SIGTERM handler
    (installed while the notice is open) sets a flag that `reached` reads.
    """

    def __init__(self, watcher_fn: Callable[[], bool] | None = None) -> None:
        self._several = _preemption_service() is not None
        self._flag = threading.Event()
        self._stop = threading.Event()
        self._previous: Any = None
        self.received_at: float | None = None  # when this process got the notice (one process)
        if watcher_fn is not None:
            background.start(self._watch, "mirrored-termination-watcher", self._stop, (watcher_fn,))
        elif not self._several:  # jax.distributed's notifier catches SIGTERM otherwise
            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    "Expected to watch for SIGTERM from the main thread (Python handles "
                    f"signals there); found {threading.current_thread().name!r}. Fix: train "
                    "from the main thread, or pass TerminationConfig(termination_watcher_fn=...)."
                )
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        del signum, frame
        self.received_at = self.received_at or time.monotonic()
        self._flag.set()

    def _watch(self, watcher: Callable[[], bool]) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            if watcher():
                if self._several:  # JAX's notifier spreads a SIGTERM to every process
                    os.kill(os.getpid(), signal.SIGTERM)
                else:
                    self.received_at = time.monotonic()
                    self._flag.set()
                return

    def reached(self, step: int) -> bool:
        """Whether every process stops at `step` (call it before every step, in order)."""
        if self._several:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag.is_set()

    def close(self) -> None:
        """Stop watching; the SIGTERM handler that was there before is back."""
        self._stop.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def announce(step: int, directory: str, grace_period: float = 0.0) -> None:
    """The line every process prints when it stops for a preemption."""
    then = f"training on for the grace period ({grace_period:g} s)" if grace_period else "exiting"
    print(
        f"mirrored: preempted at step {step} (process {jax.process_index()}): saving a "
        f"checkpoint in {directory}, then {then}",
        file=sys.stderr,
        flush=True,
    )


_GRACE_NOTICE = "mirrored/grace/final"  # process 0: the grace period ends
_GRACE_STEPS = "mirrored/grace/steps/"  # each process' step when it read that
AGREE_TIMEOUT_S = 60.0


class GraceCountdown:
    """After the first preemption checkpoint of a grace period: when (at which step, the same
    on every process) to save the last one.

    Process 0 decides that the time has come (the period's end minus `margin` and twice the
    longest step so far) and says so in JAX's key-value store. A thread in each process reads
    that, publishes the last step its loop asked about and waits for every process' number,
    holding the loop at its next question meanwhile; all agree on the largest plus one. The
    thread, not the loop, answers (as in JAX's own preemption sync): a loop may be waiting in
    a collective of a step that needs the others, so it cannot be the one to answer.
    """

    def __init__(self, deadline: float, margin: float) -> None:
        self._deadline = deadline
        self._margin = margin
        self._agreed: int | None = None
        self._error: Exception | None = None
        self._told = False
        self._current = -1
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._longest = 0.0
        self._stop = threading.Event()
        if jax.process_count() > 1:
            background.start(self._agree, "mirrored-grace", self._stop)

    def reached(self, step: int) -> bool:
        """Whether every process saves its final checkpoint at `step` (call before each step)."""
        now = time.monotonic()
        self._longest = max(self._longest, now - self._last)
        self._last = now
        due = now + self._margin + 2 * self._longest >= self._deadline
        with self._lock:
            if self._error is not None:
                raise self._error
            self._current = step
            if self._agreed is None and due:
                if jax.process_count() == 1:
                    self._agreed = step
                elif jax.process_index() == 0 and not self._told:
                    coordination_client().key_value_set(_GRACE_NOTICE, "1")
                    self._told = True
            return self._agreed is not None and step >= self._agreed

    def _agree(self) -> None:
        client = coordination_client()
        rank, count = jax.process_index(), jax.process_count()
        while True:
            try:
                client.key_value_try_get(_GRACE_NOTICE)
                break
            except Exception:  # not yet
                if self._stop.wait(0.05):  # the interpreter exits
                    return
        with self._lock:
            client.key_value_set(f"{_GRACE_STEPS}{rank}", str(self._current))
            stop = time.monotonic() + AGREE_TIMEOUT_S
            steps: list[tuple[str, str]] = []
            while time.monotonic() < stop and not self._stop.is_set():
                steps = client.key_value_dir_get(_GRACE_STEPS)
                if len(steps) == count:
                    self._agreed = max(int(value) for _, value in steps) + 1
                    return
                time.sleep(0.01)
            self._error = TimeoutError(
                f"Expected every one of the {count} processes to report its step for the "
                f"final preemption checkpoint within {AGREE_TIMEOUT_S:g} s; found "
                f"{len(steps)}. Fix: call handler.run at every step on every process."
            )


class PreemptionCheckpointHandler:
    """Save one checkpoint at the same step on every process when any is told to terminate.

    Created after the model and optimizer (in the strategy's scope), it restores the newest
    checkpoint in `checkpoint_dir` if there is one. Wrap each training step in `run`: before
    the step, a termination notice anywhere (SIGTERM, or the config's watcher) makes every
    process stop at the same step S; the chief saves the objects of `checkpoint` with S, and
    every process calls `exit_fn` (default `sys.exit(42)`). Started again, the handler restores
    them and `total_run_calls` is S.

    Args:
        cluster_resolver: the job's resolver (TensorFlow's signature), or None; the process'
            identity comes from JAX.
        checkpoint: the objects to save, by name: `{"model": model, "optimizer": optimizer}`
            (NNX modules and optimizers, Keras models and optimizers).
        checkpoint_dir: the directory of the preemption checkpoint (the newest one is kept).
        termination_config: a `TerminationConfig`; default SIGTERM, `sys.exit(42)`.

    Example:
        >>> handler = mirrored.PreemptionCheckpointHandler(
        ...     None, {"model": model, "optimizer": optimizer}, "ckpt/preemption")
        >>> for step in range(handler.total_run_calls, STEPS):
        ...     loss = handler.run(distributed_train_step, next(iterator))

    Differs from tf.distribute: `checkpoint` is a dict of objects, not a `tf.train.Checkpoint`;
    the data position is the user's to restore from `total_run_calls`, as in TensorFlow.
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint: Mapping[str, Any],
        checkpoint_dir: str | os.PathLike[str],
        termination_config: TerminationConfig | None = None,
    ) -> None:
        if not isinstance(checkpoint, Mapping) or not checkpoint:
            raise TypeError(
                "Expected checkpoint to be a dict of the objects to save, e.g. {'model': "
                f"model, 'optimizer': optimizer}}; found {checkpoint!r}. Fix: pass such a dict."
            )
        if not isinstance(checkpoint_dir, str | os.PathLike) or not os.fspath(checkpoint_dir):
            raise TypeError(
                f"Expected checkpoint_dir to be a directory path; found {checkpoint_dir!r}. "
                "Fix: pass a path, e.g. 'ckpt/preemption'."
            )
        config = TerminationConfig() if termination_config is None else termination_config
        if not isinstance(config, TerminationConfig):
            raise TypeError(
                "Expected termination_config to be a mirrored.TerminationConfig or None; found "
                f"{type(config).__name__}. Fix: mirrored.TerminationConfig(exit_fn=...)."
            )
        self._cluster_resolver = cluster_resolver
        self._objects = dict(checkpoint)
        self._directory = os.path.abspath(os.fspath(checkpoint_dir))
        self._exit_fn = config.exit_fn or (lambda: sys.exit(RESTART_EXIT_CODE))
        self._save_fn = config.save_fn
        self._grace_period = float(config.grace_period or 0.0)
        self._countdown: GraceCountdown | None = None
        self._times: collections.deque[float] = collections.deque(maxlen=NOTICE_STEPS + 1)
        self._run_counter = self._restore()
        self._notice = TerminationNotice(config.termination_watcher_fn)

    @property
    def total_run_calls(self) -> int:
        """Calls of `run` so far, counting those before the restart (saved in the checkpoint)."""
        return self._run_counter

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`distributed_train_function(*args, **kwargs)`, after saving and exiting if a
        termination notice has reached every process by now."""
        self._check_preemption_and_maybe_checkpoint()
        result = distributed_train_function(*args, **kwargs)
        self._run_counter += 1
        return result

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """Nothing to do with these strategies (TensorFlow's is for TPUStrategy); kept so that
        code written for it runs unchanged."""
        yield

    # -- internals -------------------------------------------------------------------------

    def _check_preemption_and_maybe_checkpoint(self) -> None:
        step = self._run_counter
        self._times.append(time.monotonic())
        if self._countdown is not None:  # in the grace period: is it time for the last save?
            if not self._countdown.reached(step):
                return
            print(
                f"mirrored: the grace period ends: saving the final checkpoint at step {step} "
                f"(process {jax.process_index()}) in {self._directory}, then exiting",
                file=sys.stderr,
                flush=True,
            )
        elif not self._notice.reached(step):
            return
        else:
            announce(step, self._directory, self._grace_period)
        started = time.monotonic()
        if self._save_fn is not None:
            self._save_fn()
        else:
            self._save(step)
        logger.info("Preemption checkpoint %d saved in %s", step, self._directory)
        if self._grace_period and self._countdown is None:
            # One process knows when the notice came; with several it came a few steps before
            # the agreed one, on whichever process got it: counted from NOTICE_STEPS back.
            noticed = self._notice.received_at or self._times[0]
            saving = time.monotonic() - started
            self._countdown = GraceCountdown(noticed + self._grace_period, saving + 1.0)
            return
        self._notice.close()
        self._exit_fn()

    def _save(self, step: int) -> None:
        _checkpoint.save_objects(
            self._directory, self._objects, step=step, max_to_keep=1, extras={_RUN_CALLS: step}
        )

    def _restore(self) -> int:
        """The newest checkpoint's objects restored; its run count (0 without one)."""
        if _checkpoint.latest_checkpoint(self._directory) is None:
            return 0
        step, extras = _checkpoint.restore_objects(self._directory, self._objects, with_extras=True)
        calls = int(extras.get(_RUN_CALLS, step))
        print(
            f"mirrored: restored the preemption checkpoint at step {calls} from {self._directory}",
            file=sys.stderr,
            flush=True,
        )
        return calls
