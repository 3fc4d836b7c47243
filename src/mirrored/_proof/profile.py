"""`mirrored.profile`: capture a few steps with `jax.profiler` and say where the time goes.

The trace is read back with JAX's own reader of XLA's trace format (`jax.profiler.ProfileData`,
from jaxlib: no extra dependency): every XLA operation is an event with its HLO name and the
device it ran on. A step's wall time is split, per device, into compute (operations other than
collectives), collectives (all-reduce, all-gather, …), input (the device idle while the host
waits for the next batch, its transfer included) and other idle time (dispatch and Python);
the four add up to the wall time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from mirrored._proof.checks import FAIL, INFO, PASS, WARN, Check, HasChecks, checks_table
from mirrored._proof.trace import (
    _BUS_FACTOR,
    _PROFILED,
    _STEP,
    INPUT,
    PARTS,
    _Op,
    _trace_files,
    breakdown,
    collective_bytes,
    kind_of,
    read_trace,
)

COLLECTIVE_SHARE_WARNING = 0.25  # of the step: the model is small for this many devices
INPUT_SHARE_WARNING = 0.2  # of the step: devices wait on the input pipeline


@dataclasses.dataclass
class ProfileReport(HasChecks):
    """Where the profiled steps' time went, with the verdicts and the trace's location.

    `steps`: per step, its wall time (s) and the fractions of it (mean over devices) in
    `compute`, `collectives`, `input` and `idle` (they sum to 1). `devices`: per device, the
    busy fraction. `collectives`: per collective operation of the step, its kind, calls per
    step, bytes, mean time and achieved bandwidth. `checks`: verdicts in words.
    """

    logdir: str
    trace_files: list[str]
    replicas: int
    steps: list[dict[str, float]]
    devices: dict[str, float]
    collectives: list[dict[str, Any]]
    checks: list[Check]

    @property
    def breakdown(self) -> dict[str, float]:
        """The fractions over all profiled steps (weighted by their wall time)."""
        total = sum(s["wall_s"] for s in self.steps)
        return {
            part: sum(s[part] * s["wall_s"] for s in self.steps) / total if total else 0.0
            for part in PARTS
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "logdir": self.logdir,
            "trace_files": self.trace_files,
            "replicas": self.replicas,
            "breakdown": self.breakdown,
            "steps": self.steps,
            "devices": self.devices,
            "collectives": self.collectives,
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=float)

    def print(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title="mirrored: where the time goes (per step, mean over devices)")
        for column in ("step", "wall", *PARTS):
            table.add_column(column, justify="right")
        rows = [(str(i), s) for i, s in enumerate(self.steps)]
        rows.append(("all", {"wall_s": _mean_wall(self.steps), **self.breakdown}))
        for label, s in rows:
            table.add_row(
                label,
                f"{s['wall_s'] * 1e3:,.2f} ms",
                *(f"{s[part]:.0%}" for part in PARTS),
            )
        console.print(table)
        if self.collectives:
            ops = Table(title="collectives per step")
            columns = ("op", "calls", "bytes", "time", "waiting", "transfer", "bus GB/s")
            for column in columns:
                ops.add_column(column, justify="right")
            for c in self.collectives:
                ops.add_row(
                    c["op"],
                    f"{c['calls_per_step']:g}",
                    _bytes(c["bytes"]) if c["bytes"] else "—",
                    f"{c['mean_s'] * 1e6:,.0f} µs",
                    f"{c['waiting_for_replicas_s'] * 1e6:,.0f} µs",
                    f"{c['transfer_s'] * 1e6:,.0f} µs",
                    f"{c['bus_bytes_per_s'] / 1e9:,.2f}" if c["bus_bytes_per_s"] else "—",
                )
            console.print(ops)
            console.print(
                "waiting: until the last replica reaches the collective; transfer: from then "
                "to its end (the bandwidth is over the transfer)."
            )
        busy = ", ".join(f"{d}: {f:.0%}" for d, f in self.devices.items())
        console.print(f"Busy fraction per device: {busy}")
        console.print(checks_table(self.checks, "verdicts"))
        console.print(
            f"Trace: {self.logdir} — open it with `tensorboard --logdir {self.logdir}` (Profile "
            "tab), or load the .trace.json.gz file in https://ui.perfetto.dev."
        )


def profile(
    strategy: Any,
    fn: Callable[..., Any],
    *,
    args: Sequence[Any] = (),
    data: Iterable[Any] | None = None,
    steps: int = 5,
    logdir: str | os.PathLike[str] = "profile",
    warmup: int = 1,
) -> ProfileReport:
    """Run `steps` steps of `strategy.run(fn, ...)` under `jax.profiler` and break each step's
    time down into compute, collectives, input and idle, with verdicts in words.

    Args:
        strategy: the strategy the step runs under.
        fn: the step, as given to `strategy.run`.
        args: `fn`'s leading arguments (the model, the optimizer …). Without `data`, the
            whole argument list, batch included, reused every step.
        data: batches for the step: a dataset `experimental_distribute_dataset` takes (or one
            it made); each step calls `fn(*args, *batch)` with the next one, and the time the
            host waits for it is the step's input time.
        steps: steps to profile, after `warmup` steps (default 1) that compile the program
            and are not traced.
        logdir: where the trace goes (TensorBoard's layout: `logdir/plugins/profile/<run>/`,
            an `.xplane.pb` for TensorBoard's profile plugin and a `.trace.json.gz` for
            Perfetto).

    Example:
        >>> report = mirrored.profile(strategy, train_step, args=(model, optimizer),
        ...                           data=dataset, steps=5, logdir="profile")
        >>> report.print()                 # the breakdown, the collectives and the verdicts
        >>> report.breakdown["collectives"]
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"Expected steps to be a positive int; found {steps!r}. Fix: steps=5.")
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"Expected args to be a tuple or list of arguments; found {type(args).__name__}. "
            "Fix: args=(model, optimizer)."
        )
    batches = _batches(strategy, data)
    last: list[tuple[Any, ...]] = [tuple(args)]  # the arguments of the latest step

    def one_step() -> Any:
        if batches is not None:
            with jax.profiler.TraceAnnotation(INPUT):
                batch = next(batches, None)
            if batch is None:
                return None
            batch = tuple(batch) if isinstance(batch, tuple | list) else (batch,)
            last[0] = (*args, *batch)
        out = strategy.run(fn, args=last[0])
        return () if out is None else out

    for _ in range(warmup):
        if one_step() is None:
            raise ValueError(_too_few(warmup, steps))
    _wait(args)
    tracer = Tracer(logdir)
    tracer.start()
    try:
        for step in range(steps):
            tracer.step_begin(step)
            out = one_step()
            tracer.step_end(ran=out is not None)
            if out is None:
                break
    finally:
        tracer.stop(lambda: _wait(args))
    if tracer.steps == 0:
        raise ValueError(_too_few(warmup, steps))
    return tracer.report(strategy, _step_collective_bytes(strategy, fn, last[0]))


class Tracer:
    """A `jax.profiler` trace of some steps, marked so that `report` can find them: the
    profiled region, each step, and the host's waits for input."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = os.fspath(logdir)
        self.steps = 0
        self.files: list[str] = []
        self._open: list[Any] = []

    def start(self) -> None:
        os.makedirs(self.logdir, exist_ok=True)
        self._before = set(_trace_files(self.logdir))
        options = jax.profiler.ProfileOptions()
        # Python function calls are not traced: on a small step, tracing them doubles the
        # host time it measures. TraceAnnotations (the steps, the input) are still recorded.
        options.python_tracer_level = 0
        jax.profiler.start_trace(self.logdir, create_perfetto_trace=True, profiler_options=options)
        self._enter(jax.profiler.TraceAnnotation(_PROFILED))

    def step_begin(self, step: int) -> None:
        self._enter(jax.profiler.StepTraceAnnotation(_STEP, step_num=step))

    def step_end(self, *, ran: bool = True) -> None:
        """The step's end; `ran=False`: it found no batch (the trace's last step marker is
        then not a step)."""
        if len(self._open) > 1:
            self._open.pop().__exit__(None, None, None)
        self.steps += ran

    def stop(self, wait: Callable[[], None]) -> None:
        """After `wait()` (the devices finish what was dispatched), the trace written."""
        try:
            wait()
        finally:
            while self._open:
                self._open.pop().__exit__(None, None, None)
            jax.profiler.stop_trace()
        self.files = sorted(set(_trace_files(self.logdir)) - self._before)

    def _enter(self, annotation: Any) -> None:
        annotation.__enter__()
        self._open.append(annotation)

    def report(self, strategy: Any, sizes: dict[str, int] | None = None) -> ProfileReport:
        xplanes = [f for f in self.files if f.endswith(".xplane.pb")]
        if not xplanes:
            raise RuntimeError(
                f"Expected jax.profiler to write a trace under {self.logdir!r}; found none. "
                "Fix: check that the folder is writable and that no other profiler session "
                "is running."
            )
        return analyse(xplanes[-1], strategy, self.files, self.logdir, sizes or {}, self.steps)


def _batches(strategy: Any, data: Iterable[Any] | None) -> Iterator[Any] | None:
    if data is None:
        return None
    from mirrored._data.input import DistributedDataset

    if isinstance(data, Iterator) and not isinstance(data, DistributedDataset):
        # A distributed iterator already (iter(dataset)), or a plain one of host batches.
        first = next(data, None)
        if first is None:
            raise ValueError(_too_few(1, 1))
        if _is_distributed(first):
            return itertools.chain([first], data)
        return iter(strategy.experimental_distribute_dataset(itertools.chain([first], data)))
    if isinstance(data, DistributedDataset):
        return iter(data)
    return iter(strategy.experimental_distribute_dataset(data))


def _is_distributed(batch: Any) -> bool:
    from mirrored._core.values import PerReplica, is_per_replica

    return any(isinstance(v, PerReplica) for v in jax.tree.leaves(batch, is_leaf=is_per_replica))


def _too_few(warmup: int, steps: int) -> str:
    return (
        f"Expected data with at least {warmup + 1} batches ({warmup} to compile, then up to "
        f"{steps} profiled); found fewer. Fix: pass more batches, or a repeating dataset."
    )


def _wait(args: Sequence[Any]) -> None:
    """Until the devices finished everything dispatched (the state in `args` is written by
    the last step)."""
    from flax import nnx

    leaves = [
        leaf
        for a in args
        for leaf in jax.tree.leaves(nnx.state(a) if isinstance(a, nnx.Object) else a)
        if isinstance(leaf, jax.Array)
    ]
    jax.block_until_ready(leaves)
    jax.effects_barrier()


def analyse(
    path: str, strategy: Any, files: list[str], logdir: str, sizes: dict[str, int], steps: int
) -> ProfileReport:
    """The report of one trace of `steps` steps under `strategy` (collective sizes by name)."""
    ops, windows, inputs = read_trace(path, steps)
    local = jax.local_devices()
    ordinal = {d.id: i for i, d in enumerate(local)}
    used = sorted({ordinal.get(d.id, d.id) for d in strategy.extended.worker_devices})
    seen = sorted({op.device for op in ops})
    devices = sorted(set(used) | set(seen))
    rows, busy = breakdown(ops, windows, inputs, devices)
    n_steps = len(windows)
    collectives = _collective_table(ops, n_steps, sizes, len(used))
    report = ProfileReport(
        logdir=logdir,
        trace_files=[os.path.relpath(f, logdir) for f in files],
        replicas=strategy.num_replicas_in_sync,
        steps=rows,
        devices={str(local[d]) if d < len(local) else str(d): f for d, f in busy.items()},
        collectives=collectives,
        checks=[],
    )
    report.checks = verdicts(report, visible=len(local), seen_devices=len(seen))
    return report


def _step_collective_bytes(
    strategy: Any, fn: Callable[..., Any], args: Sequence[Any]
) -> dict[str, int]:
    """Bytes of each collective of the step's compiled program (the trace names them; the
    program comes from the compilation cache)."""
    try:
        program = strategy._compiled_text(fn, tuple(args), {})
    except Exception:  # the breakdown does not need the bytes; the table shows none then
        return {}
    return collective_bytes(program)


def _collective_table(
    ops: list[_Op], n_steps: int, sizes: dict[str, int], replicas: int
) -> list[dict[str, Any]]:
    rows = []
    names = sorted({op.name for op in ops if kind_of(op.name)})
    for name in names:
        kind = kind_of(name)
        assert kind is not None
        calls = [op for op in ops if op.name == name]
        by_device: dict[int, list[_Op]] = {}
        for op in sorted(calls, key=lambda op: op.start):
            by_device.setdefault(op.device, []).append(op)
        per_device = len(calls) / len(by_device)
        mean = sum(op.end - op.start for op in calls) / len(calls)
        # A collective starts moving data when the last replica arrives: before that, the
        # others wait for it (a slower replica, or simulated devices sharing cores).
        waits, moves = [], []
        counts = {len(v) for v in by_device.values()}
        if len(by_device) > 1 and len(counts) == 1:
            for same in zip(*by_device.values(), strict=True):
                last = max(op.start for op in same)
                waits += [last - op.start for op in same]
                moves += [max(op.end - last, 0.0) for op in same]
        wait = sum(waits) / len(waits) if waits else 0.0
        move = sum(moves) / len(moves) if moves else mean
        nbytes = sizes.get(name, sizes.get(name.removesuffix("-start"), 0))
        factor = _BUS_FACTOR.get(kind, lambda n: 1.0)(replicas) if replicas > 1 else 0.0
        rows.append(
            {
                "op": name,
                "kind": kind,
                "calls_per_step": per_device / n_steps,
                "bytes": nbytes,
                "mean_s": mean,
                "waiting_for_replicas_s": wait,
                "transfer_s": move,
                "bytes_per_s": nbytes / move if move > 0 else 0.0,
                "bus_bytes_per_s": nbytes / move * factor if move > 0 else 0.0,
            }
        )
    return rows


def verdicts(report: ProfileReport, *, visible: int, seen_devices: int) -> list[Check]:
    """The verdicts in words, each with its cause and its fix."""
    share = report.breakdown
    checks: list[Check] = []
    n = report.replicas
    kinds = sorted({c["kind"] for c in report.collectives})
    reduces = [c for c in report.collectives if c["kind"] == "all-reduce"]
    data = {"replicas": n, "visible_devices": visible, "collective_kinds": kinds}
    if reduces and n > 1:
        moved = sum(c["bytes"] * c["calls_per_step"] for c in reduces)
        checks.append(
            Check(
                "All-reduce in the trace",
                PASS,
                f"{sum(c['calls_per_step'] for c in reduces):g} all-reduce(s) per step over "
                f"{n} replicas" + (f", {_bytes(moved)} per step" if moved else ""),
                "",
                {**data, "all_reduce_bytes_per_step": moved},
            )
        )
    elif n > 1 or visible > 1:
        cause = (
            f"The strategy has {n} replica{'s' if n != 1 else ''} while {visible} devices are "
            "visible: the step runs on one device. Fix: mirrored.MirroredStrategy() (every "
            "device) instead of OneDeviceStrategy or a one-device list."
            if n == 1
            else "The step never combines the replicas' gradients: each replica trains on its "
            "own shard. Fix: take the gradients of the mirrored parameters passed to "
            "strategy.run as arguments (JAX sums them over replicas), with the loss from "
            "mirrored.compute_average_loss, and update the model inside the step."
        )
        checks.append(
            Check(
                "All-reduce in the trace",
                FAIL if n > 1 else WARN,  # one replica: maybe deliberate (a baseline)
                "no all-reduce in the trace: gradients are not synchronized",
                cause,
                data,
            )
        )
    else:
        checks.append(
            Check("All-reduce in the trace", INFO, "one device: nothing to all-reduce", "", data)
        )
    waiting = sum(c["waiting_for_replicas_s"] * c["calls_per_step"] for c in report.collectives)
    in_collectives = sum(c["mean_s"] * c["calls_per_step"] for c in report.collectives)
    waiting_share = waiting / in_collectives if in_collectives else 0.0
    if n > 1 and share["collectives"] >= COLLECTIVE_SHARE_WARNING:
        checks.append(
            Check(
                "Communication",
                WARN,
                f"collectives take {share['collectives']:.0%} of the step "
                f"({waiting_share:.0%} of that waiting for the slowest replica)",
                f"The model is too small for {n} devices, or the per-replica batch is: each "
                "step moves every gradient between devices whatever the batch. Fix: raise the "
                "per-replica batch (batch_size is the GLOBAL batch), use fewer devices, or "
                "compute in bfloat16 (mirrored.mixed_precision)."
                + (
                    " Much of it is replicas waiting for each other at the collective: "
                    "uneven work per replica (or simulated CPU devices sharing a few cores)."
                    if waiting_share >= 0.5
                    else ""
                ),
                {"collectives": share["collectives"], "waiting_share": waiting_share},
            )
        )
    elif n > 1:
        checks.append(
            Check(
                "Communication",
                PASS,
                f"collectives take {share['collectives']:.0%} of the step",
                "",
                {"collectives": share["collectives"]},
            )
        )
    if share["input"] >= INPUT_SHARE_WARNING:
        checks.append(
            Check(
                "Input",
                WARN,
                f"devices idle {share['input']:.0%} of the step waiting for input",
                "The host produces batches slower than the devices train on them. Fix: see "
                "the input section of the docs (docs/where-does-the-time-go.md#input): keep "
                "the data in arrays or a Grain pipeline with workers, move decoding and "
                "augmentation out of Python, and check with a larger steps_per_execution.",
                {"input": share["input"]},
            )
        )
    else:
        checks.append(
            Check(
                "Input",
                PASS,
                f"devices idle {share['input']:.0%} of the step waiting for input",
                "",
                {"input": share["input"]},
            )
        )
    busy = report.devices
    if visible > 1 and seen_devices <= 1:
        checks.append(
            Check(
                "Work per device",
                WARN,
                f"one device does all the work ({seen_devices} of {visible} ran operations)",
                f"Only one of the {visible} visible devices ran the step. Fix: "
                "mirrored.MirroredStrategy() replicates the step on every device.",
                {"busy": busy},
            )
        )
    else:
        values = list(busy.values())
        spread = max(values) - min(values) if values else 0.0
        status = WARN if spread > 0.5 else PASS
        checks.append(
            Check(
                "Work per device",
                status,
                f"{seen_devices} device(s) busy {min(values, default=0):.0%}–"
                f"{max(values, default=0):.0%} of the time",
                "Some devices work much more than others: check that every replica gets a "
                "batch of the same size (a ragged last batch does this once)."
                if status == WARN
                else "",
                {"busy": busy},
            )
        )
    return checks


def _mean_wall(steps: list[dict[str, float]]) -> float:
    return sum(s["wall_s"] for s in steps) / len(steps) if steps else 0.0


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"
