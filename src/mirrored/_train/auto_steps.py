"""`Trainer(steps_per_execution="auto")`, the default: how many steps `fit` (and, measured
apart, `evaluate` and fit's validation) runs in one program, chosen from a measured step.

A step dispatched from Python on its own pays a fixed cost (the dispatch, one batch placed at
a time): on CPU a tenth to a third of a small model's step, more across simulated devices.
K steps in one program (`strategy.run_steps`, K batches gathered at once) pay it once, with
the same numbers. When nothing reads every batch (no callback with a batch hook but the
progress bar, which refreshes on a clock), `fit` times its first steps and picks the most
steps up to `MAX_STEPS` an execution of `TARGET_S` holds, evened out over the epoch, when the
steps left are worth one more program's compile; else one step per program, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from mirrored._core import coordination as _coordination
from mirrored._core.devices import owning_processes
from mirrored._core.settings import functions_run_eagerly
from mirrored._core.values import StackedBatches
from mirrored._train.batches import _epoch_batches

logger = logging.getLogger("mirrored")

MAX_STEPS = 32
# An execution of K steps lasts about this long at most: the progress bar moves, a preemption
# notice is acted on (grace periods are tens of seconds) and the hang watchdog (5 minutes)
# sees the loop at least that often. Long steps gain from K too: the wide MLP on 8 simulated
# devices (260 ms a step) ran an epoch 1.24x faster at K = 2 and 1.40x at K = 4.
TARGET_S = 2.0
# K steps per program only when the steps left take this many times the compile of the K-step
# program (estimated as the first step's time beyond a step: its compile, and whatever else
# compiles then, so on the high side): it pays for itself at a 25% gain. Measured gains of K
# steps: 10-50% on the MLPs, 13-52% on the transformer example, none on the CNN example
# (benchmarks.md). At 10, a 12-epoch run of the transformer compiled cold (a first step of
# 4.7 s beyond a step, of which 3.2 s the step's own compile; K = 32's: 2.8 s) ran one step
# per program, at 0.67-0.70x of K = 32.
PAYBACK = 4
# Steps timed in a row, after the first, for a step's time.
MEASURED_STEPS = 4
# K steps in one program are given up for one at a time when their steps take this many times
# a step alone (a margin over the timing noise of a shared machine).
SLOWER = 1.1
# Fits shorter than this run one step per program, unmeasured (two waits are not worth it).
MIN_STEPS = 64


@dataclasses.dataclass
class Measured:
    """One input's measured step (per batch size and example shapes): a compiled step, and
    what the first one took beyond it (its compile)."""

    step_s: float
    compile_s: float
    built: int = 0  # the K whose K-step program ran (was built), if any
    checked: bool = False  # a built K's execution was timed against `step_s`
    slower: bool = False  # ... and its steps took longer than one at a time


def choose(measured: Measured, steps_left: int, epoch_steps: int) -> int:
    """The steps per execution for `steps_left` more steps, epochs of `epoch_steps`, of a
    step measured as `measured`: the program built already if it fits, else the most an
    execution of `TARGET_S` holds, evened out over the epoch (200 steps with room for 32: 7
    executions of 28, the 4 left one at a time), if the steps left pay for its compile."""
    if measured.slower:
        return 1
    most = min(MAX_STEPS, epoch_steps, int(TARGET_S / max(measured.step_s, 1e-9)))
    if most < 2:
        return 1
    if 2 <= measured.built <= most:
        return measured.built  # nothing more to build
    if steps_left * measured.step_s < PAYBACK * measured.compile_s:
        return 1
    return epoch_steps // -(-epoch_steps // most)  # ceil(epoch / most) executions an epoch


def _size(item: Any) -> int:
    """The batches in one item of an epoch's iterator: a chunk's K, or one batch (K batches
    over `chunks.CHUNK_BYTES` come one at a time)."""
    return len(item) if isinstance(item, StackedBatches) else 1


class _Epoch(Iterator[Any]):
    """One epoch's batches, from a source `AutoSteps` may switch (one at a time, chunks of K)
    at the position reached; made (its prefetch started) when the epoch is asked for."""

    def __init__(self, auto: AutoSteps, epoch: int, skip: int) -> None:
        self.auto, self.epoch, self.position = auto, epoch, skip
        self.source = auto._source(epoch, skip)
        self.handed = 0.0  # when the last item was handed out

    def __next__(self) -> Any:
        item = next(self.source)
        self.position += _size(item)
        self.handed = time.perf_counter()
        return item

    def switch(self) -> None:
        """Read the rest of the epoch with the steps per execution chosen now."""
        getattr(self.source, "close", lambda: None)()
        self.source = self.auto._source(self.epoch, self.position)


class AutoSteps:
    """One `fit`'s (or evaluation's) batches under `steps_per_execution="auto"`. `ran(item)`,
    after each dispatch, drives it: the first `1 + MEASURED_STEPS` steps run one at a time
    and are timed (`wait` waits for the last dispatched step), then the chosen K at a time
    (chunks of K, what is left of an epoch one batch a chunk: no program for another
    length); the first K execution after the one that built its program is timed against a
    step alone, and if its steps are slower the fit goes back to one at a time (XLA can run
    a loop's body slower than the step by itself)."""

    def __init__(
        self,
        seen: dict[Any, Measured],
        key: Any,
        train: Any,
        wait: Callable[[], None],
        span: tuple[int, int, int, int],
        chiefs: Callable[[str, str], str],
        caller: str = "fit",
    ) -> None:
        self._seen, self._key, self._train = seen, key, train
        self._wait, self._span = wait, span
        self._chiefs = chiefs  # the chief's value, on a strategy over several processes
        self._caller = caller  # "fit", or "evaluate" (and fit's validation): for the log
        self._epoch: _Epoch | None = None  # the epoch being read
        self._first_s: float | None = None  # the first step's time, its compile included
        self._start = 0.0  # when the steps timed in a row began
        self._singles = 0  # steps run one at a time while measuring
        self._timing = False  # the next full chunk is timed
        measured = seen.get(key)
        self.k = 0 if measured is None else self._chosen(measured, span[0], span[1], False)

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """Epoch `epoch`'s (1-based) batches from batch `skip` on."""
        self._epoch = _Epoch(self, epoch, skip)
        return self._epoch

    def _source(self, epoch: int, skip: int) -> Iterator[Any]:
        k = self.k if self.k > 1 else 0  # 0 (measuring) and 1: one at a time
        return _epoch_batches(self._train, epoch, skip, k, True)

    def ran(self, item: Any) -> None:
        """After `item` (a batch or a chunk of the epoch being read) was dispatched."""
        current = self._epoch
        if current is None:
            return
        if self.k == 0:
            self._measure(current)
        elif self.k > 1 and _size(item) == self.k:
            self._check(current)
        elif self._timing:
            self._wait()  # the chunk to time starts on idle devices

    def _measure(self, current: _Epoch) -> None:
        if self._first_s is None:  # the first step: its compile included
            self._wait()
            self._first_s = time.perf_counter() - current.handed
            self._start = time.perf_counter()
            return
        self._singles += 1
        if self._singles < MEASURED_STEPS:
            return
        self._wait()
        step_s = (time.perf_counter() - self._start) / MEASURED_STEPS
        compile_s = max(self._first_s - step_s, 0.0)
        # Several processes: every one reads its batches as the chief's times say (from
        # here on, each process's choices are the same function of the same numbers).
        agreed = self._chiefs(f"{step_s!r} {compile_s!r}", "measured")
        step_s, compile_s = map(float, agreed.split())
        measured = Measured(step_s=step_s, compile_s=compile_s)
        self._seen[self._key] = measured
        self.k = self._chosen(measured, current.epoch - 1, current.position)
        if self.k > 1:
            current.switch()

    def _check(self, current: _Epoch) -> None:
        measured = self._seen[self._key]
        if not self._timing:
            measured.built = self.k  # built (now or before): time the next one, once
            self._timing = not measured.checked
            if self._timing:
                self._wait()
            return
        self._timing = False
        self._wait()
        step_s = (time.perf_counter() - current.handed) / self.k
        measured.checked = True
        slower = self._chiefs("slower" if step_s > SLOWER * measured.step_s else "", "checked")
        if slower == "slower":
            logger.info(
                "%s: one step per program after all (steps_per_execution='auto': %d steps "
                "in one took %.2f ms a step, one at a time %.2f ms)",
                self._caller,
                self.k,
                1e3 * step_s,
                1e3 * measured.step_s,
            )
            measured.slower, self.k = True, 1
            current.switch()

    def _chosen(self, measured: Measured, epoch: int, step: int, new: bool = True) -> int:
        """The K from step `step` of epoch `epoch` (from 0) on, logged when just measured or
        not the one built."""
        _, _, epochs, epoch_steps = self._span
        steps_left = (epochs - epoch) * epoch_steps - step
        k = choose(measured, steps_left, epoch_steps)
        if not new and (k == measured.built or (k == 1 and not measured.built) or measured.slower):
            return k
        logger.info(
            "%s: %s (steps_per_execution='auto': a step takes %.2f ms, its compile about %.2f "
            "s, %d steps left; pass steps_per_execution=K to choose)",
            self._caller,
            f"{k} steps per program" if k > 1 else "one step per program",
            1e3 * measured.step_s,
            measured.compile_s,
            steps_left,
        )
        return k


def _signature(value: Any) -> Any:
    """The structure, per-example shapes and dtypes of `value` (arrays, a tree of them, or
    a list of numbers)."""
    leaves, treedef = jax.tree.flatten(value)
    if not all(hasattr(a, "dtype") and len(getattr(a, "shape", ())) for a in leaves):
        leaves, treedef = jax.tree.flatten(np.asarray(value))  # numbers: one array
    return treedef, tuple((tuple(a.shape[1:]), str(a.dtype)) for a in leaves)


class FixedSteps:
    """The batches of a `fit` whose steps per execution are set (K, or 0: one at a time)."""

    def __init__(self, train: Any, k: int) -> None:
        self._train, self.k = train, k

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        return _epoch_batches(self._train, epoch, skip, self.k)

    def ran(self, item: Any) -> None:
        del item


def plan(
    trainer: Any,
    train: Any,
    inputs: tuple[Any, ...],
    chunked: int,
    fixed: bool,
    span: tuple[int, int, int, int | None, int | None],
    totals: Callable[[], Any] | None = None,
) -> AutoSteps | FixedSteps:
    """How `fit` reads its batches: `AutoSteps` under `steps_per_execution="auto"` unless
    `fixed` (not in-memory arrays read from the host, checked steps, or a callback reading
    every batch on any process of the job), compiled, for at least `MIN_STEPS` steps unless
    its K-step program is built already; else `FixedSteps(chunked)`. `inputs`: x, y and the
    weights; `span`: the first epoch, its first step, the end epoch, the steps of each and
    the batch size. Several processes choose alike: `fixed` is agreed, and the measured
    times are the chief's. With `totals` (the running sums of an evaluation pass), how an
    evaluation reads its batches: its step measured apart from the training step, `span`'s
    epochs its passes (fit's validation: one an epoch), each long enough to measure."""
    first_epoch, first_step, epochs, steps, batch_size = span
    if (
        not trainer._auto_steps
        or chunked
        or fixed
        or steps is None
        or trainer.run_eagerly
        or functions_run_eagerly()
    ):
        return FixedSteps(train, chunked)
    # Measured per kind of step, batch size and the examples' shapes and dtypes.
    key = (totals is None, tuple(_signature(a) for a in inputs), batch_size)
    built = getattr(trainer._auto_measured.get(key), "built", 0) > 1  # a K program exists
    if not built and (epochs - first_epoch) * steps - first_step < MIN_STEPS:
        return FixedSteps(train, 0)
    if not built and totals is not None and steps <= MEASURED_STEPS:
        return FixedSteps(train, 0)  # each pass a new one: too short to measure
    running = totals or (lambda: trainer._train_totals)

    def wait() -> None:
        jax.block_until_ready(running().global_value)

    # A strategy over several processes: they read their batches alike, by the chief's times.
    owners = owning_processes(trainer.strategy.extended.worker_devices)

    def chiefs(value: str, tag: str) -> str:
        return _coordination.chiefs(value, owners, tag=f"steps_per_execution='auto': {tag}")

    span4 = (first_epoch, first_step, epochs, steps)
    caller = "fit" if totals is None else "evaluate"
    return AutoSteps(trainer._auto_measured, key, train, wait, span4, chiefs, caller)
