"""The hang watchdog: a stalled process never hangs the job silently.

Every process keeps a heartbeat (`mirrored._core.heartbeat`: steps dispatched, phase), which
the step path writes for nanoseconds. A thread publishes it in `jax.distributed`'s key-value
store once a second when it changed (outside the collectives: no extra op in any compiled
program) and reads everyone's. When no process has moved for `hang_timeout` seconds (more
while one compiles, starts or writes a checkpoint), one of them declares a hang; every process
then publishes where it is (its phase, its main thread's line, a host callback that has not
returned), reads the others', and prints the same verdict: which process is behind, where, and
at which step the others wait. Each dumps its threads' stacks (`faulthandler`), raises
`HangError` in its main thread where that thread can still run Python, and exits with
`HANG_EXIT_CODE` within seconds (never SIGABRT in JAX's shutdown). One process alone (several
local devices) is watched the same way when asked for, without the store.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Mapping
from typing import Any

import jax

from mirrored._core import background
from mirrored._core import heartbeat as _heartbeat
from mirrored._run.errors import (
    HANG_EXIT_CODE,
    HANG_VERDICT,
    HangError,
    _dead_processes,
    _exit_at_the_end,
    _exit_without_the_shutdown_barrier,
    coordination_client,
    register_hang_diagnosis,
)

logger = logging.getLogger("mirrored")

TIMEOUT_ENV = "MIRRORED_HANG_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0  # several processes; one process: off unless asked
SLOW_EXTRA_S = 600.0  # more while a process starts, compiles or writes a checkpoint
REPORT_WAIT_S = 5.0  # how long the verdict waits for every process' report
MAIN_GRACE_S = 2.0  # how long the main thread gets to end on its HangError
_BEATS = "mirrored/heartbeat/"
_DECLARED = "mirrored/hang"
_REPORTS = "mirrored/hang_report/"
_ACKS = "mirrored/hang_exiting/"


def hang_seconds(value: float | None, processes: int) -> float | None:
    """The watchdog's timeout: `value` (0 turns it off), else `$MIRRORED_HANG_TIMEOUT`, else
    DEFAULT_TIMEOUT_S with several processes and off with one; None means off."""
    source = "hang_timeout"
    if value is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S if processes > 1 else None
        source = f"${TIMEOUT_ENV}"
        try:
            value = float(text)
        except ValueError:
            value = math.nan
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(
            f"Expected {source} to be a number of seconds >= 0 (0: no watchdog); found "
            f"{value!r}. Fix: e.g. hang_timeout=300 (the default with several processes)."
        )
    return float(value) or None


def _library_paths() -> tuple[str, ...]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mirrored's package
    stdlib = sysconfig.get_paths().get("stdlib", "")
    packages = [os.path.dirname(os.path.dirname(os.path.abspath(jax.__file__)))]
    return tuple(p for p in (here, stdlib, *packages) if p)


_LIBRARY = _library_paths()


def _is_library(filename: str) -> bool:
    """Whether a frame's file is library code (mirrored, the standard library, site-packages)
    rather than the user's script."""
    return filename.startswith(_LIBRARY) or filename.startswith("<")


def _frames(frame: Any) -> list[Any]:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out  # innermost first


def _line(frame: Any) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


def _own_report() -> dict[str, Any]:
    """Where this process is: its heartbeat, its main thread's innermost line of user code,
    whether that thread waits in JAX, and a host callback still running, if any."""
    beat = _heartbeat.BEAT
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident or -1)
    stack = _frames(main)
    user = next((f for f in stack if not _is_library(f.f_code.co_filename)), None)
    innermost = stack[0].f_code.co_filename if stack else ""
    in_jax = any(part in innermost for part in (f"{os.sep}jax{os.sep}", f"{os.sep}jaxlib{os.sep}"))
    callback = ""
    for ident, frame in frames.items():
        if ident == threading.get_ident() or frame is main:
            continue
        stack_of = _frames(frame)
        names = [f.f_code.co_filename for f in stack_of]
        if any(n.endswith(("jax/_src/callback.py", "jax/_src/debugging.py")) for n in names):
            inside = next((f for f in stack_of if not _is_library(f.f_code.co_filename)), None)
            callback = _line(inside) if inside is not None else "a host callback"
            break
    return {
        "steps": beat.steps,
        "phase": beat.phase,
        "fn": beat.fn,
        "main": _line(user) if user is not None else (_line(stack[0]) if stack else "?"),
        "in_jax": in_jax,
        "callback": callback,
    }


def _waits(report: Mapping[str, Any]) -> bool:
    """Whether a process waits for the devices (and so for the others' collectives)."""
    if report.get("callback"):
        return False
    phase = report["phase"]
    return phase in _heartbeat.WAITING or (phase == "host" and bool(report.get("in_jax")))


def _name(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"process {ranks[0]} (worker {ranks[0]})"
    return "processes " + ", ".join(str(r) for r in ranks)


_WHERE = {
    "input": "in its input",
    "host": "in its own code",
    "compile": "compiling",
    "checkpoint": "writing or reading a checkpoint",
    "start": "before its first step",
}


def verdict(
    reports: Mapping[int, Mapping[str, Any]],
    processes: int,
    stalled_s: float,
    timeout_s: float,
    dead: list[int] | None = None,
    timed_out: bool = False,
) -> str:
    """One sentence for every process: who is behind and where, at which step the others
    wait. `reports` by rank (missing: did not answer); `dead`: ranks known to be gone."""
    dead = sorted(dead or [])
    silent = [r for r in range(processes) if r not in reports and r not in dead]
    waiting = sorted(r for r, rep in reports.items() if _waits(rep))
    behind = sorted(r for r in reports if r not in waiting)
    parts = []
    if dead:
        parts.append(f"{_name(dead)} {'is' if len(dead) == 1 else 'are'} no longer alive")
    if silent:
        parts.append(
            f"{_name(silent)} did not answer (its Python is blocked, e.g. in a C extension "
            "holding the GIL)"
        )
    counted = False
    if not behind and not dead and not silent and waiting:
        counts = {r: reports[r]["steps"] for r in waiting}
        if len(set(counts.values())) > 1:  # a process that skipped a step, or stopped early
            low = min(counts.values())
            behind = [r for r in waiting if counts[r] == low]
            waiting = [r for r in waiting if r not in behind]
            top = max(counts.values())
            counted = True
            parts.append(
                f"{_name(behind)} dispatched {low} steps and the others {top}: it skipped a "
                "step or stopped calling them (a Python branch that differs between processes?)"
            )
    for rank in () if counted else behind:
        rep = reports[rank]
        if rep.get("callback"):
            parts.append(
                f"{_name([rank])} is stuck inside a step: a host callback has not returned "
                f"({rep['callback']})"
            )
        elif rep["phase"] == "compile":
            parts.append(
                f"{_name([rank])} stopped after step {rep['steps']}, compiling {rep['fn']}"
            )
        else:
            where = _WHERE.get(rep["phase"], f"in {rep['phase']}")
            parts.append(
                f"{_name([rank])} stopped after step {rep['steps']}, {where} ({rep['main']})"
            )
    if waiting:
        ahead = [reports[r]["steps"] for r in behind if not reports[r].get("callback")]
        step = min(ahead) + 1 if ahead else min(reports[r]["steps"] for r in waiting)
        fn = next((reports[r]["fn"] for r in waiting if reports[r]["fn"]), "the step")
        verb = "waits" if len(waiting) == 1 else "wait"
        if behind or dead or silent:
            parts.append(f"{_name(waiting)} {verb} in the all-reduce of step {step} ({fn})")
        else:
            parts.append(
                f"{_name(waiting)} {verb} for the devices at step {step} ({fn}) and none is "
                "behind in Python: a device, a host callback or a collective itself is stuck"
            )
    alone = " " if processes > 1 else " this process: "
    return (
        f"No process advanced in {stalled_s:.0f} s ("
        + ("a collective timed out; " if timed_out else "")
        + f"hang_timeout={timeout_s:g} s);{alone}"
        + "; ".join(parts)
        + "."
    )


class Watchdog:
    """The thread that watches the heartbeats; one per process (`start`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self.rank = jax.process_index()
        self.processes = jax.process_count()
        self._stop = threading.Event()  # set by background.stop_all at exit
        self._declared = threading.Event()  # this process asks for the verdict now
        self.concluding = threading.Event()  # this watchdog is at its verdict (local: no RPC)
        self._concluded = threading.Event()  # the verdict is out (HANG_VERDICT)
        self._released = threading.Event()  # this process may end (the chief: the others did)
        self._message = ""
        self._published: tuple[int, str] | None = None

    @property
    def client(self) -> Any:
        """jax.distributed's client, read afresh: None once JAX shut it down at exit (a call
        in flight as the interpreter finalizes would abort the process)."""
        return coordination_client() if self.processes > 1 else None

    # -- watching ----------------------------------------------------------------------------

    def _beats(self) -> dict[int, tuple[int, str]]:
        """Every process' (beats, phase); this one's from memory, published if it changed."""
        beat = _heartbeat.BEAT
        own = (beat.beats, beat.phase)
        if self.client is None:
            return {self.rank: own}
        if own != self._published:
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_BEATS}{self.rank}", f"{own[0]} {own[1]}", True)
                self._published = own
        found = {self.rank: own}
        with contextlib.suppress(Exception):
            for key, value in self.client.key_value_dir_get(_BEATS):
                beats, phase = value.split(" ", 1)
                found.setdefault(int(key.rsplit("/", 1)[-1]), (int(beats), phase))
        return found

    def _declaration(self) -> str | None:
        """The published declaration of a hang ("RANK", or "RANK timeout" when a collective
        timed out), or None when there is none (or no service to ask)."""
        if self.client is None:
            return None
        try:
            return str(self.client.key_value_try_get(_DECLARED))
        except Exception:  # not there (or the service is gone)
            return None

    def _someone_declared(self) -> bool:
        return self._declared.is_set() or self._declaration() is not None

    def _watch(self) -> None:
        last: dict[int, int] = {}
        since = time.monotonic()
        while not self._stop.wait(self.interval_s):
            if self.processes > 1 and self.client is None:  # the runtime has shut down
                return
            beats = self._beats()
            now = time.monotonic()
            counts = {rank: count for rank, (count, _) in beats.items()}
            if counts != last:
                last, since = counts, now
            slow = any(phase in _heartbeat.SLOW for _, phase in beats.values())
            limit = self.timeout_s + (SLOW_EXTRA_S if slow else 0.0)
            if now - since > limit or self._someone_declared():
                if self.client is not None:
                    with contextlib.suppress(Exception):  # the first to declare wins
                        self.client.key_value_set(_DECLARED, str(self.rank))
                self._conclude(now - since)
                return

    # -- the verdict -------------------------------------------------------------------------

    def _reports(self) -> dict[int, dict[str, Any]]:
        own = _own_report()
        if self.client is None:
            return {self.rank: own}
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{_REPORTS}{self.rank}", json.dumps(own), True)
        reports = {self.rank: own}
        deadline = time.monotonic() + REPORT_WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                for key, value in self.client.key_value_dir_get(_REPORTS):
                    reports[int(key.rsplit("/", 1)[-1])] = json.loads(value)
            if len(reports) == self.processes:
                break
            time.sleep(0.1)
        return reports

    def _conclude(self, stalled_s: float) -> None:
        self.concluding.set()
        reports = self._reports()
        missing = [r for r in range(self.processes) if r not in reports]
        dead = [r for r in _dead_processes() if r in missing] if missing else []
        timed_out = (self._declaration() or "").endswith(" timeout")
        message = verdict(reports, self.processes, stalled_s, self.timeout_s, dead, timed_out)
        self._message = message
        HANG_VERDICT.append(message)
        own = reports[self.rank]
        doing = (
            "waiting for its own host callback"
            if own["callback"]
            else "waiting for the devices"
            if _waits(own)
            else _WHERE.get(own["phase"], "in a step")
        )
        print(
            f"mirrored: HangError: {message}\nmirrored: process {self.rank} was {doing} at "
            f"{own['main']}; every thread's stack follows, then it exits with code "
            f"{HANG_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        folder = os.environ.get(_heartbeat.VERDICT_DIR_ENV)
        if folder:
            with (
                contextlib.suppress(OSError),
                open(os.path.join(folder, f"verdict.{self.rank}"), "w") as f,
            ):
                f.write(message)
        _exit_at_the_end(HANG_EXIT_CODE)
        self._concluded.set()
        self._leave()

    def _leave(self) -> None:
        """The others end first: the coordination service ends with process 0."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_ACKS}{self.rank}", "1", True)
            # Nobody leaves before every process has its verdict: a peer's exit would reach
            # one still concluding as a failed collective instead.
            deadline = time.monotonic() + REPORT_WAIT_S
            while time.monotonic() < deadline:
                acks: list[Any] = []
                with contextlib.suppress(Exception):
                    acks = self.client.key_value_dir_get(_ACKS)
                if len(acks) >= self.processes:
                    break
                time.sleep(0.1)
            if self.rank == 0:
                time.sleep(MAIN_GRACE_S + 0.5)  # the others are gone by now
        self._released.set()
        main = threading.main_thread()
        waits = self._declared.is_set()  # in diagnose_now: it raises the HangError itself
        if _HANDLER_INSTALLED and main.is_alive() and not waits:  # a HangError where it is
            with contextlib.suppress(Exception):
                signal.pthread_kill(main.ident or 0, _SIGNAL)
            main.join(MAIN_GRACE_S)
        _exit_without_the_shutdown_barrier(HANG_EXIT_CODE)

    # -- a collective that timed out -----------------------------------------------------------

    def diagnose_now(self, timed_out: bool) -> str:
        """A collective failed while a hang is declared, or timed out (gloo's timeout, on
        CPU): the verdict now instead of at hang_timeout, returned to the caller, which
        raises it; the watchdog then ends the process, the chief last."""
        _heartbeat.BEAT.phase = "step"  # it waited in the step's collective
        if self.client is not None and timed_out:  # before the event: the first declaration
            with contextlib.suppress(Exception):
                self.client.key_value_set(_DECLARED, f"{self.rank} timeout")
        self._declared.set()
        self._concluded.wait(REPORT_WAIT_S + 5 * self.interval_s + 5)
        self._released.wait(2 * REPORT_WAIT_S + MAIN_GRACE_S + 1)  # the chief leaves last
        return HANG_VERDICT[0] if HANG_VERDICT else ""


_SIGNAL = signal.SIGUSR2
_HANDLER_INSTALLED = False
_WATCHDOG: list[Watchdog] = []


def _raise_hang(signum: int, frame: Any) -> None:
    message = _WATCHDOG[0]._message if _WATCHDOG else "a hang"
    raise HangError(
        f"{message}\nFix: look at the process that is behind (its stack is above); restart "
        "the job (BackupAndRestore resumes it; `mirrored launch --max-restarts N` restarts it "
        "by itself); hang_timeout= (MIRRORED_HANG_TIMEOUT) sets how long a stall may last."
    )


def _script_ended() -> None:
    beat = _heartbeat.BEAT
    beat.beats += 1
    beat.phase = "exit"


def _shut_down_while_watching() -> None:
    """At exit, JAX's shutdown barrier with the watchdog still watching: a peer that never
    reaches it (it hangs in a step this process skipped) is a hang it reports. The watchdog
    is stopped after it (`background.stop_all`), before the interpreter finalizes; JAX's own
    exit handler then finds jax.distributed shut down."""
    jax.distributed.shutdown()


def start_watchdog(hang_timeout: float | None) -> Watchdog | None:
    """Watch this process (once; a later call sets the timeout): `hang_timeout` as
    `hang_seconds` reads it. Returns the watchdog, or None when it is off."""
    global _HANDLER_INSTALLED
    timeout_s = hang_seconds(hang_timeout, jax.process_count())
    if _WATCHDOG:
        if timeout_s is not None:
            _WATCHDOG[0].timeout_s = timeout_s
            _WATCHDOG[0].interval_s = min(1.0, timeout_s / 10)
        return _WATCHDOG[0]
    if timeout_s is None:
        return None
    watchdog = Watchdog(timeout_s)
    _WATCHDOG.append(watchdog)
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(_SIGNAL) in (signal.SIG_DFL, None)
    ):
        signal.signal(_SIGNAL, _raise_hang)
        _HANDLER_INSTALLED = True
    register_hang_diagnosis(watchdog.diagnose_now, watchdog.concluding.is_set)
    atexit.register(_script_ended)  # runs before JAX's shutdown barrier (registered earlier)
    if watchdog.processes > 1:
        background.first_at_exit(_shut_down_while_watching)
    background.start(watchdog._watch, "mirrored-hang-watchdog", watchdog._stop)
    logger.info("Hang watchdog: a stall of %g s is reported and ends the job.", timeout_s)
    return watchdog
