"""`mirrored launch`: N local worker processes with the right environment, stopped together."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO

from mirrored._cluster.preemption import RESTART_EXIT_CODE
from mirrored._core.heartbeat import VERDICT_DIR_ENV
from mirrored._run.errors import HANG_EXIT_CODE


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# gloo (inside jaxlib) prints "[Gloo] Rank i is connected to n peer ranks. Expected number of
# connected peer ranks is : n" to stdout, unconditionally, whenever it connects the processes of
# a collective; several threads of one process print at once, so their pieces interleave.
_GLOO_PIECES = re.compile(
    r"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. "
    r"|Expected number of connected peer ranks is : )+\s*"
)
_GLOO_LINE = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)\s*"
)


def is_gloo_noise(line: str) -> bool:
    """Whether `line` is (pieces of) gloo's report that a collective connected its peers.

    A whole report with fewer peers than expected is not noise: it names a missing peer.
    """
    text = line.rstrip("\r\n")
    if "[Gloo] Rank " not in text and " peer ranks" not in text:
        return False
    whole = _GLOO_LINE.fullmatch(text)
    if whole is not None:
        return whole[1] == whole[2]
    return _GLOO_PIECES.fullmatch(text) is not None


def _pump(stream: IO[str], rank: int, lock: threading.Lock) -> None:
    for line in stream:
        if is_gloo_noise(line):
            continue
        with lock:
            sys.stdout.write(f"[rank {rank}] {line}")
            sys.stdout.flush()


def _stop(processes: Sequence[subprocess.Popen[str]], grace_s: float, terminate: bool) -> None:
    """Every process ended within `grace_s`, then SIGKILLed. `terminate`: SIGTERM them first
    (a preemption: each saves its checkpoint); else (a worker failed) they are left to exit by
    themselves, which they do within a second when a peer is gone (43), with no preemption
    save attempted against a dead peer."""
    alive = [p for p in processes if p.poll() is None]
    for p in alive if terminate else ():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.05)
    for p in alive:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in alive:
        p.wait()


RESTART_COUNT_ENV = "MIRRORED_RESTART_COUNT"  # torchrun: TORCHELASTIC_RESTART_COUNT


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    grace_s: float = 5.0,
    max_restarts: int = 0,
) -> int:
    """Run `command` as `num_processes` workers on 127.0.0.1; returns the last attempt's code.

    Each output line is prefixed with its rank; gloo's "Rank i is connected to n peer ranks"
    lines are left out unless a peer is missing. When a worker fails, the others are stopped
    (SIGTERM, then SIGKILL after `grace_s`), so nothing of the job is left running; then, up to
    `max_restarts` times, every worker is started again on a fresh coordinator port (42, a
    preemption checkpoint's exit, included), with `MIRRORED_RESTART_COUNT` set. SIGTERM to the
    launcher is passed on to the workers (each saves its preemption checkpoint), leftovers are
    killed after `grace_s`, and the launcher exits 42 without restarting.
    """
    if num_processes < 1:
        raise ValueError(f"Expected at least one process; found -n {num_processes}.")
    if max_restarts < 0:
        raise ValueError(f"Expected --max-restarts to be 0 or more; found {max_restarts}.")
    terminated = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        attempt = 0
        while True:
            rank, code = _attempt(
                command, num_processes, devices_per_process, grace_s, attempt, terminated
            )
            if terminated.is_set():
                print(
                    f"mirrored launch: SIGTERM passed on to the {num_processes} workers; "
                    f"exiting {RESTART_EXIT_CODE} without a restart",
                    flush=True,
                )
                return RESTART_EXIT_CODE
            if code == 0 or attempt >= max_restarts:
                return code
            attempt += 1
            print(
                f"mirrored launch: worker {rank} {_how(code)}; restarting all "
                f"{num_processes} workers (restart {attempt}/{max_restarts})",
                flush=True,
            )
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _how(code: int) -> str:
    """How a worker ended, from its exit code (128 + N: signal N, as shells report it)."""
    if code == HANG_EXIT_CODE:
        return f"was stopped by the hang watchdog (exit code {code})"
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(code - 128).name} (exit code {code})"
    return f"exited with code {code}"


def _attempt(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    grace_s: float,
    restart: int,
    terminated: threading.Event,
) -> tuple[int, int]:
    """One start of every worker: (the first failing rank, its code), or (-1, 0)."""
    with tempfile.TemporaryDirectory(prefix="mirrored-verdict-") as verdicts:
        rank, code = _start_and_wait(
            command, num_processes, devices_per_process, grace_s, restart, terminated, verdicts
        )
        found = sorted(os.listdir(verdicts))
        if found:  # the hang watchdog's verdict: the same on every worker
            with open(os.path.join(verdicts, found[0])) as f:
                print(f"mirrored launch: the job hung: {f.read().strip()}", flush=True)
    return rank, code


def _start_and_wait(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    grace_s: float,
    restart: int,
    terminated: threading.Event,
    verdicts: str,
) -> tuple[int, int]:
    port = free_port()
    token = os.environ.get("MIRRORED_JOB_TOKEN") or secrets.token_hex(16)
    lock = threading.Lock()
    processes: list[subprocess.Popen[str]] = []
    pumps = []
    for rank in range(num_processes):
        env = dict(
            os.environ,
            MIRRORED_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            MIRRORED_NUM_PROCESSES=str(num_processes),
            MIRRORED_PROCESS_ID=str(rank),
            MIRRORED_JOB_TOKEN=token,  # the rendezvous admits this job's workers only
            PYTHONUNBUFFERED="1",
        )
        env[RESTART_COUNT_ENV] = str(restart)
        env[VERDICT_DIR_ENV] = verdicts
        if devices_per_process:
            env["MIRRORED_LOCAL_DEVICES"] = str(devices_per_process)
        process = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,  # its own process group: stop it with everything it started
        )
        processes.append(process)
        pump = threading.Thread(target=_pump, args=(process.stdout, rank, lock), daemon=True)
        pump.start()
        pumps.append(pump)
    failure = (-1, 0)
    try:
        while True:
            if terminated.is_set():
                _stop(processes, grace_s, terminate=True)  # each one's preemption checkpoint
                break
            codes = [p.poll() for p in processes]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                failure = failed[0]
                _stop(processes, grace_s, terminate=False)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(processes, grace_s, terminate=True)
        failure = (-1, 130)
    for pump in pumps:
        pump.join(timeout=5)
    rank, code = failure
    if code < 0:  # killed by a signal: report it the way shells do
        code = 128 - code
    return rank, code
