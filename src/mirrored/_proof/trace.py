"""Reading a `jax.profiler` trace back: XLA's operations per device, the steps' windows, the
input waits, and a step's wall time split into compute, collectives, input and idle time."""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from collections.abc import Callable

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# Bus bandwidth factor of each collective over N devices (nccl-tests' definitions).
_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
}
_PROFILED = "mirrored.profile"
INPUT = "mirrored.input"
_STEP = "mirrored.step"
PARTS = ("compute", "collectives", "input", "idle")  # a step's time, in that order


def _trace_files(logdir: str) -> list[str]:
    return [
        f
        for f in glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*"))
        if os.path.isfile(f)
    ]


# -- reading the trace -------------------------------------------------------------------------


@dataclasses.dataclass
class _Op:
    name: str
    device: int
    start: float  # seconds
    end: float
    module: str = ""
    run: int | None = None  # one execution of a program on all its devices


def read_trace(
    path: str, count: int
) -> tuple[list[_Op], list[tuple[float, float]], list[tuple[float, float]]]:
    """The XLA operations of a trace (per device), the windows of its first `count` steps
    and the host's waits for input, all in seconds on the trace's clock."""
    from jax.profiler import ProfileData

    trace = ProfileData.from_file(path)
    ops: list[_Op] = []
    steps: list[tuple[float, float]] = []
    inputs: list[tuple[float, float]] = []
    region: tuple[float, float] | None = None
    for plane in trace.planes:
        device_plane = re.match(r"/device:[A-Z]+:(\d+)", plane.name)
        for line in plane.lines:
            # A GPU's plane has its operations on the "XLA Ops" line (kernels and modules on
            # others would count them twice); the CPU's run on host threads.
            if device_plane and line.name != "XLA Ops":
                continue
            for event in line.events:
                start = event.start_ns / 1e9
                end = start + event.duration_ns / 1e9
                if event.name == _PROFILED:
                    region = (start, end)
                elif event.name == _STEP:
                    steps.append((start, end))
                elif event.name == INPUT:
                    inputs.append((start, end))
                else:
                    stats = dict(event.stats)
                    if "hlo_op" not in stats and not device_plane:
                        continue
                    device = (
                        int(device_plane.group(1))
                        if device_plane
                        else int(stats.get("device_ordinal", 0))
                    )
                    run = stats.get("run_id")
                    ops.append(
                        _Op(
                            str(stats.get("hlo_op", event.name)),
                            device,
                            start,
                            end,
                            f"{stats.get('hlo_module', '')}#{stats.get('program_id', '')}",
                            int(run) if run is not None else None,
                        )
                    )
    if region is None or not steps:
        raise RuntimeError(
            f"Expected the profiled steps in the trace {path}; found no {_PROFILED!r} region."
        )
    steps = sorted(steps)[:count]
    windows = [
        (start, following)
        for (start, _), (following, _) in zip(steps, [*steps[1:], (region[1], 0.0)], strict=True)
    ]
    ops = [op for op in ops if op.end > windows[0][0] and op.start < windows[-1][1]]
    windows = _device_windows(ops) or windows
    ops = [op for op in ops if op.end > windows[0][0] and op.start < windows[-1][1]]
    return ops, windows, sorted(inputs)


def _device_windows(ops: list[_Op]) -> list[tuple[float, float]] | None:
    """The steps as the devices ran them: from the first operation of one execution of the
    step's program to that of the next (the host dispatches ahead, so its own step windows
    run early). The step's program is the one that took the most device time; None when the
    trace does not say which executions are which."""
    runs: dict[str, dict[int, list[_Op]]] = {}
    for op in ops:
        if op.run is not None:
            runs.setdefault(op.module, {}).setdefault(op.run, []).append(op)
    if not runs:
        return None
    by_time = {
        module: sum(o.end - o.start for r in by_run.values() for o in r)
        for module, by_run in runs.items()
    }
    module = max(by_time, key=by_time.__getitem__)
    executions = sorted(
        (min(o.start for o in r), max(o.end for o in r)) for r in runs[module].values()
    )
    starts = [start for start, _ in executions]
    return list(zip(starts, [*starts[1:], executions[-1][1]], strict=True))


def kind_of(op: str) -> str | None:
    """The collective an HLO operation name stands for (`all-reduce.3`, `all-gather-start`)."""
    for kind in COLLECTIVES:
        if op == kind or op.startswith(kind + ".") or op.startswith(kind + "-"):
            return kind
    return None


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes of each collective's result in compiled HLO text, by instruction name."""
    sizes: dict[str, int] = {}
    kinds = "|".join(COLLECTIVES)
    pattern = rf"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+(?:{kinds})(?:-start)?\("
    for match in re.finditer(pattern, hlo_text, re.MULTILINE):
        name, shape = match.groups()
        total = 0
        for dtype, dims in re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", shape):
            if dtype in _DTYPE_BYTES:
                total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        sizes[name] = total
    return sizes


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (merged) intervals `a` outside the (merged) intervals `b`."""
    out: list[tuple[float, float]] = []
    for start, end in a:
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out


def breakdown(
    ops: list[_Op],
    windows: list[tuple[float, float]],
    inputs: list[tuple[float, float]],
    devices: list[int],
) -> tuple[list[dict[str, float]], dict[int, float]]:
    """Per step, the wall time and the fractions in compute, collectives, input and idle
    (mean over `devices`; per device they add up to 1); per device, the busy fraction."""
    by_device: dict[int, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = {}
    for device in devices:
        mine = [op for op in ops if op.device == device]
        collective = _union([(op.start, op.end) for op in mine if kind_of(op.name)])
        busy = _union([(op.start, op.end) for op in mine])
        by_device[device] = (busy, collective)
    waiting = _union(inputs)
    rows = []
    for lo, hi in windows:
        wall = hi - lo
        parts = dict.fromkeys(PARTS, 0.0)
        for busy, collective in by_device.values():
            busy_here = _clip(busy, lo, hi)
            collective_here = _clip(collective, lo, hi)
            idle_here = _minus([(lo, hi)], busy_here)
            waiting_idle = _length(_minus(idle_here, _minus(idle_here, _clip(waiting, lo, hi))))
            parts["collectives"] += _length(collective_here)
            parts["compute"] += _length(busy_here) - _length(collective_here)
            parts["input"] += waiting_idle
            parts["idle"] += _length(idle_here) - waiting_idle
        scale = wall * len(by_device) if wall > 0 and by_device else 1.0
        rows.append({"wall_s": wall, **{k: v / scale for k, v in parts.items()}})
    lo, hi = windows[0][0], windows[-1][1]
    fractions = {d: _length(_clip(busy, lo, hi)) / (hi - lo) for d, (busy, _) in by_device.items()}
    return rows, fractions
