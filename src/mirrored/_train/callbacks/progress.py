"""`ProgbarLogger`: a progress bar per epoch (rich), printed by the chief only."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from mirrored._persist import checkpoint as _checkpoint
from mirrored._train.callbacks.base import Callback

logger = logging.getLogger("mirrored")


def _format(logs: Mapping[str, Any]) -> str:
    # Keras' progress bar (utils/progbar.py): 4 decimals above 1e-3, else scientific; a
    # metric of several values (F1Score per class) shows them all.
    def number(v: float) -> str:
        return f"{v:.4f}" if v > 1e-3 else f"{v:.4e}"

    def shown(v: Any) -> str:
        if np.ndim(v):
            return "[" + " ".join(number(float(x)) for x in np.ravel(v)) + "]"
        return number(v)

    return "  ".join(f"{k} {shown(v)}" for k, v in logs.items())


class ProgbarLogger(Callback):
    """A progress bar per epoch: steps, ETA, examples/second and running metrics (rich).

    `verbose=1` shows the bar on a terminal (one line per epoch elsewhere), `verbose=2` one line
    per epoch, `verbose=0` nothing. Metrics are read from the devices at most every
    `refresh_s` seconds, so the bar never adds a per-step synchronisation. `evaluate` shows
    one bar (and line) too; inside `fit`, validation is silent, as in Keras.
    """

    logs_read_on_every_process = True  # several processes: never read mid-epoch
    reads_every_batch = False  # refreshed on a clock: fine with K steps at a time

    def __init__(self, verbose: int = 1, *, refresh_s: float = 0.25) -> None:
        self.verbose = verbose
        self.refresh_s = refresh_s
        from rich.console import Console  # rich on first use: a custom loop never needs it

        self.console = Console(soft_wrap=True)
        self._progress: Any = None
        self._in_fit = False

    def _live(self) -> bool:
        return self.verbose == 1 and self.console.is_terminal and _checkpoint.is_chief()

    def _begin(self, label: str) -> None:
        self._label, self._start, self._last = label, time.perf_counter(), 0.0
        if self._live():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[speed]}  {task.fields[metrics]}"),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                label, total=self.params.get("steps"), speed="", metrics=""
            )

    def _advance(self, batch: int, logs: Mapping[str, float] | None) -> None:
        if self._progress is None:
            return
        now = time.perf_counter()
        self._progress.update(self._task, completed=batch + 1)
        if now - self._last >= self.refresh_s and logs is not None:
            self._last = now
            rate = (batch + 1) * self.params.get("batch_size", 0) / max(now - self._start, 1e-9)
            self._progress.update(self._task, speed=f"{rate:,.0f} ex/s")
            # Several processes: steps and speed only; reading the metrics here, on the chief
            # alone and on its own clock, would run their all-reduce on one process.
            if jax.process_count() == 1:
                self._progress.update(self._task, metrics=_format(dict(logs)))

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _end(self, logs: Mapping[str, float] | None) -> None:
        self._stop()
        if self.verbose and _checkpoint.is_chief():
            seconds = time.perf_counter() - self._start
            self.console.print(f"{self._label}  {seconds:.1f}s  {_format(logs or {})}")

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._in_fit = True

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self._begin(f"epoch {epoch + 1}/{self.params['epochs']}")

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        self._advance(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self._end(logs)

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        self._stop()
        self._in_fit = False

    def on_test_begin(self, logs: Mapping[str, float] | None = None) -> None:
        if not self._in_fit:
            self._begin("evaluate")

    def on_test_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        if not self._in_fit:
            self._advance(batch, logs)

    def on_test_end(self, logs: Mapping[str, float] | None = None) -> None:
        if not self._in_fit:
            self._end(logs)
