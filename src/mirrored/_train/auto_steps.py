"""`Trainer(steps_per_execution="auto")`, the default: how many training steps `fit` runs in
one program, chosen from a measured step.

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
# program (estimated as the first step's compile): it pays for itself at a 10% gain.
PAYBACK = 10
# Steps timed in a row, after the first, for a step's time.
MEASURED_STEPS = 4
# K steps in one program are given up for one at a time when their steps take this many times
# a step alone (a margin over the timing noise of a shared machine).
SLOWER = 1.1
# Fits shorter than this run one step per program, unmeasured (two waits are not worth it).
MIN_STEPS = 64


@dataclasses.dataclass
class Measured:
    """One input structure's measured step: a compiled step, and what the first one took
    beyond it (its compile); `k`: the K whose program was built, if one was."""

    step_s: float
    compile_s: float
    k: int = 1
    built: bool = False  # a K-step execution ran (its program was built)
    checked: bool = False  # a K-step execution was timed against `step_s`


def choose(measured: Measured, steps_left: int, epoch_steps: int) -> int:
    """The steps per execution for `steps_left` more steps, epochs of `epoch_steps`, of a
    step measured as `measured`: the most an execution of `TARGET_S` holds, evened out over
    the epoch (200 steps with room for 32: 7 executions of 28, the 4 left one at a time)."""
    if measured.k > 1 or measured.checked:
        return measured.k  # built already (nothing more to pay), or timed slower (1)
    most = min(MAX_STEPS, epoch_steps, int(TARGET_S / max(measured.step_s, 1e-9)))
    if most < 2 or steps_left * measured.step_s < PAYBACK * measured.compile_s:
        return 1
    return epoch_steps // -(-epoch_steps // most)  # ceil(epoch / most) executions an epoch


class AutoSteps:
    """One `fit`'s batches under `steps_per_execution="auto"`: the first epoch's first
    `1 + MEASURED_STEPS` steps one at a time and timed (`wait` waits for the last dispatched
    step), then the chosen K at a time for the rest of the fit (chunks of K, what is left of
    an epoch one batch a chunk: no program for another length), the first K-step execution
    after the one that built its program timed against one step at a time."""

    def __init__(
        self,
        seen: dict[Any, Measured],
        key: Any,
        train: Any,
        wait: Callable[[], None],
        span: tuple[int, int, int, int],
    ) -> None:
        self._seen, self._key, self._train = seen, key, train
        self._wait, self._span = wait, span
        measured = seen.get(key)
        self.k = 0 if measured is None else self._chosen(measured, span[0], span[1], False)

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        """Epoch `epoch`'s (1-based) batches from batch `skip` on."""
        if self.k == 0:
            return self._measuring(epoch, skip)
        if self.k == 1:
            return _epoch_batches(self._train, epoch, skip, 0)
        return self._checking(epoch, skip)

    def _measuring(self, epoch: int, skip: int) -> Iterator[Any]:
        one = self._train.epoch_iterator(epoch, skip=skip)
        took = []
        for steps in (1, MEASURED_STEPS):  # the first (its compile), then a few in a row
            start = time.perf_counter()
            for _ in range(steps):
                batch = next(one, None)
                if batch is None:
                    return
                yield batch
            self._wait()  # the steps fit dispatched after taking the batches, finished
            took.append((time.perf_counter() - start) / steps)
        measured = Measured(step_s=took[1], compile_s=max(took[0] - took[1], 0.0))
        self._seen[self._key] = measured
        skip += 1 + MEASURED_STEPS
        self.k = self._chosen(measured, epoch - 1, skip)
        if self.k == 1:
            yield from one
            return
        getattr(one, "close", lambda: None)()
        yield from self._checking(epoch, skip)

    def _checking(self, epoch: int, skip: int) -> Iterator[Any]:
        """Chunks of K; the first full one after the one that built its program is timed
        (once per input) and, if its steps are slower than one at a time, the rest of the fit
        runs one step per program (XLA can run a loop's body slower than the step alone)."""
        measured = self._seen[self._key]
        chunks = _epoch_batches(self._train, epoch, skip, self.k, True)
        for chunk in chunks:
            # A batch, not a chunk, when K batches are over `chunks.CHUNK_BYTES`.
            size = len(chunk) if isinstance(chunk, StackedBatches) else 1
            if measured.checked or size < self.k or not measured.built:
                skip += size
                yield chunk
                measured.built |= size == self.k
                continue
            self._wait()  # the first chunk's program built and run: time this one alone
            start = time.perf_counter()
            yield chunk
            self._wait()
            skip += size
            step_s = (time.perf_counter() - start) / size
            measured.checked = True
            if step_s > SLOWER * measured.step_s:
                logger.info(
                    "fit: one step per program after all (steps_per_execution='auto': %d "
                    "steps in one took %.2f ms a step, one at a time %.2f ms)",
                    self.k,
                    1e3 * step_s,
                    1e3 * measured.step_s,
                )
                measured.k = self.k = 1
                getattr(chunks, "close", lambda: None)()
                yield from _epoch_batches(self._train, epoch, skip, 0)
                return

    def _chosen(self, measured: Measured, epoch: int, step: int, new: bool = True) -> int:
        """The K from step `step` of epoch `epoch` (from 0) on, logged when just measured or
        not the one built."""
        _, _, epochs, epoch_steps = self._span
        steps_left = (epochs - epoch) * epoch_steps - step
        k = choose(measured, steps_left, epoch_steps)
        if not new and k == measured.k:
            return k
        measured.k = max(k, measured.k)
        logger.info(
            "fit: %s (steps_per_execution='auto': a step takes %.2f ms, its compile about %.2f "
            "s, %d steps left; pass steps_per_execution=K to choose)",
            f"{k} steps per program" if k > 1 else "one step per program",
            1e3 * measured.step_s,
            measured.compile_s,
            steps_left,
        )
        return k


class FixedSteps:
    """The batches of a `fit` whose steps per execution are set (K, or 0: one at a time)."""

    def __init__(self, train: Any, k: int) -> None:
        self._train, self.k = train, k

    def batches(self, epoch: int, skip: int) -> Iterator[Any]:
        return _epoch_batches(self._train, epoch, skip, self.k)


def plan(
    trainer: Any,
    train: Any,
    inputs: tuple[Any, ...],
    chunked: int,
    fixed: bool,
    span: tuple[int, int, int, int | None],
) -> AutoSteps | FixedSteps:
    """How `fit` reads its batches: `AutoSteps` under `steps_per_execution="auto"` unless
    `fixed` (not in-memory arrays read from the host, checked steps, or a callback reading
    every batch), in one process, compiled, for at least `MIN_STEPS` steps unless its K-step
    program is built already; else `FixedSteps(chunked)`. `inputs`: x, y, the weights and
    the batch size; `span`: the first epoch, its first step, the end epoch and the steps of
    each."""
    first_epoch, first_step, epochs, steps = span
    if (
        not trainer._auto_steps
        or chunked
        or fixed
        or steps is None
        or jax.process_count() > 1
        or trainer.run_eagerly
        or functions_run_eagerly()
    ):
        return FixedSteps(train, chunked)
    *arrays, batch_size = inputs  # measured per batch size and example shapes and dtypes
    leaves, treedef = jax.tree.flatten(arrays)
    examples = tuple((np.shape(a)[1:], str(np.asarray(a[:0]).dtype)) for a in leaves)
    key = (treedef, examples, batch_size)
    built = getattr(trainer._auto_measured.get(key), "k", 1) > 1  # a K-step program exists
    if not built and (epochs - first_epoch) * steps - first_step < MIN_STEPS:
        return FixedSteps(train, 0)

    def wait() -> None:
        jax.block_until_ready(trainer._train_totals.global_value)

    return AutoSteps(
        trainer._auto_measured, key, train, wait, (first_epoch, first_step, epochs, steps)
    )
