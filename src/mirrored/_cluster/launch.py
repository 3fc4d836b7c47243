"""`mirrored launch`: N local worker processes with the right environment, stopped together."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO


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


def _stop(processes: Sequence[subprocess.Popen[str]], grace_s: float) -> None:
    # SIGTERM first; a process that initialised jax.distributed may ignore it, so SIGKILL after.
    alive = [p for p in processes if p.poll() is None]
    for p in alive:
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


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    grace_s: float = 5.0,
) -> int:
    """Run `command` as `num_processes` workers on 127.0.0.1; returns the first failure's code.

    Each output line is prefixed with its rank; gloo's "Rank i is connected to n peer ranks"
    lines are left out unless a peer is missing. When a worker fails, the others are stopped
    (SIGTERM, then SIGKILL after `grace_s`), so nothing of the job is left running.
    """
    if num_processes < 1:
        raise ValueError(f"Expected at least one process; found -n {num_processes}.")
    port = free_port()
    lock = threading.Lock()
    processes: list[subprocess.Popen[str]] = []
    pumps = []
    for rank in range(num_processes):
        env = dict(
            os.environ,
            MIRRORED_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            MIRRORED_NUM_PROCESSES=str(num_processes),
            MIRRORED_PROCESS_ID=str(rank),
            PYTHONUNBUFFERED="1",
        )
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
    failure = 0
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                failure = failed[0]
                _stop(processes, grace_s)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        _stop(processes, grace_s)
        failure = 130
    for pump in pumps:
        pump.join(timeout=5)
    if failure < 0:  # killed by a signal: report it the way shells do
        failure = 128 - failure
    return failure
