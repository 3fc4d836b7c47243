"""`verify` across processes: whether every process holds the same mirrored state, and the
batches and copies it needs there (each process holds its own rows of a global batch)."""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mirrored._core import heartbeat as _heartbeat
from mirrored._core.leaves import raw_array
from mirrored._proof.checks import FAIL, INFO, PASS, WARN, Check


def digest(array: jax.Array) -> np.ndarray:
    """This process' copy of `array` as two uint32 words of its SHA-1: equal iff the bytes are
    (up to a 2^-64 chance)."""
    local = np.ascontiguousarray(np.asarray(raw_array(array).addressable_data(0)))
    return np.frombuffer(hashlib.sha1(local.tobytes()).digest()[:8], np.uint32).copy()


def check_processes(named: dict[str, jax.Array], agreed: set[str]) -> Check:
    """Compare every process' copy of each named array (one gather of 8 bytes per array).
    Arrays `run` already made agree (`agreed`) and differ now: FAIL, the processes diverged.
    Others differ before any step: INFO, the first step gives them the chief's values."""
    from jax.experimental import multihost_utils

    names = sorted(named)
    local = np.stack([digest(named[n]) for n in names]) if names else np.zeros((0, 2), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(local))  # (processes, arrays, 2)
    differ: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        others = [p for p in range(every.shape[0]) if not np.array_equal(every[p, i], every[0, i])]
        if others:
            differ[name] = others
    processes = every.shape[0]
    if not differ:
        return Check(
            "Processes agree",
            PASS,
            f"{len(names)} mirrored array(s) identical on all {processes} processes",
            data={"arrays": len(names), "processes": processes},
        )
    diverged = [name for name in differ if name in agreed]
    listed = ", ".join(f"{n} (processes {differ[n]} vs 0)" for n in sorted(differ)[:5])
    if diverged:
        return Check(
            "Processes agree",
            FAIL,
            f"{len(diverged)} mirrored array(s) differ between processes after training began: "
            f"{listed}",
            "Every process held the chief's values once; something wrote different values on "
            "different processes since (a per-process assign, load or random draw outside "
            "strategy.run), so the processes now train different models. Fix: change mirrored "
            "state only inside strategy.run, or write the same values on every process.",
            {"differ": differ},
        )
    return Check(
        "Processes agree",
        INFO,
        f"{len(differ)} of {len(names)} array(s) start from different values on different "
        f"processes: {listed}; the first step takes process 0's, as TensorFlow does",
        "Each process built its own model without a common seed. mirrored broadcasts the "
        "chief's values the first time a step sees them (verify already did, for its checks); "
        "seed every process the same to make runs reproducible.",
        {"differ": differ},
    )


def global_host_value(array: jax.Array) -> np.ndarray:
    """The whole of a (possibly multi-process) array on this host."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


STRAGGLER_SHARE = 0.2  # a process working this share of a step longer than the least busy one


def check_stragglers(run_step: Callable[[], Any], steps: int = 20) -> Check:
    """Run `steps` steps and compare the processes (the hang watchdog's heartbeats: how long
    each one's host waited for the devices): a straggler is the process that waits least, for
    the others wait for it in every step's collective."""
    from jax.experimental import multihost_utils

    beat = _heartbeat.BEAT
    waited = beat.waited
    intervals = []
    last = time.perf_counter()
    for _ in range(steps):
        run_step()
        now = time.perf_counter()
        intervals.append(now - last)
        last = now
    local = np.asarray([statistics.median(intervals), (beat.waited - waited) / steps])
    every = np.asarray(multihost_utils.process_allgather(local.astype(np.float32)))
    return stragglers(every[:, 0].tolist(), every[:, 1].tolist())


def stragglers(step_s: list[float], waited_s: list[float]) -> Check:
    """The Stragglers line from each process' median step time and its wait per step."""
    own = [max(s - w, 0.0) for s, w in zip(step_s, waited_s, strict=True)]
    slowest = int(np.argmax(own))
    typical = float(np.median(step_s))
    gap = own[slowest] - min(own)
    times = ", ".join(f"{s * 1e3:.2f}" for s in step_s)
    data = {"step_ms": [s * 1e3 for s in step_s], "waited_ms": [w * 1e3 for w in waited_s]}
    if gap <= STRAGGLER_SHARE * typical or gap < 5e-4:
        return Check(
            "Stragglers",
            PASS,
            f"none: median step per process {times} ms; each works within "
            f"{gap * 1e3:.2f} ms of the others per step",
            data=data,
        )
    others = [w for i, w in enumerate(waited_s) if i != slowest]
    return Check(
        "Stragglers",
        WARN,
        f"process {slowest} is the slowest: it works {own[slowest] * 1e3:.2f} ms per step "
        f"outside the collectives, {gap * 1e3:.2f} ms more than the quickest, and the others "
        f"wait up to {max(others) * 1e3:.2f} ms per step for it (median step per process "
        f"{times} ms)",
        "Every step waits for the slowest process. Look at its input pipeline and host work "
        "(a slower disk, a busier machine, more Python per step); left alone, a straggler "
        "that stops becomes a hang (hang_timeout).",
        data,
    )
