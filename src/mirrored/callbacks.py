"""Keras-style callbacks for `mirrored.Trainer`: history, progress, checkpoints, logs.

Only the chief process (process 0) prints and writes files.
"""

from __future__ import annotations

import csv
import logging
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from mirrored import _checkpoint
from mirrored._tensorboard import EventWriter

if TYPE_CHECKING:
    from mirrored._trainer import Trainer

logger = logging.getLogger("mirrored")

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "History",
    "ModelCheckpoint",
    "ProgbarLogger",
    "TensorBoard",
]


class Callback:
    """Base class: override the hooks you need. `self.model` is the Trainer (as in Keras)."""

    trainer: Trainer
    params: dict[str, Any]

    def set_trainer(self, trainer: Trainer, params: dict[str, Any]) -> None:
        self.trainer = trainer
        self.params = params

    @property
    def model(self) -> Trainer:
        """The Trainer, so that `self.model.stop_training = True` works as in Keras."""
        return self.trainer

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None: ...
    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_test_begin(self, logs: Mapping[str, float] | None = None) -> None: ...
    def on_test_end(self, logs: Mapping[str, float] | None = None) -> None: ...


class CallbackList:
    """Calls every callback's hook in order, skipping the ones a callback does not override."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.callbacks = list(callbacks)

    def overrides(self, hook: str) -> bool:
        """Whether any callback implements `hook` (per-step hooks cost time on the hot path)."""
        base = getattr(Callback, hook, None)
        return any(getattr(type(c), hook, None) is not base for c in self.callbacks)

    def __getattr__(self, hook: str) -> Any:
        base = getattr(Callback, hook, None)
        methods = [
            getattr(c, hook)
            for c in self.callbacks
            if not hook.startswith("on_") or getattr(type(c), hook, None) is not base
        ]

        def call(*args: Any, **kwargs: Any) -> None:
            for method in methods:
                method(*args, **kwargs)

        setattr(self, hook, call)  # resolved once per fit
        return call


class History(Callback):
    """Records the epoch logs: `history.history["loss"]` is one value per epoch."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)


def _format(logs: Mapping[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in logs.items())


class ProgbarLogger(Callback):
    """A progress bar per epoch: steps, ETA, examples/second and running metrics (rich).

    `verbose=1` shows the bar on a terminal (one line per epoch elsewhere), `verbose=2` one line
    per epoch, `verbose=0` nothing. Metrics are read from the devices at most every
    `refresh_s` seconds, so the bar never adds a per-step synchronisation.
    """

    def __init__(self, verbose: int = 1, *, refresh_s: float = 0.25) -> None:
        self.verbose = verbose
        self.refresh_s = refresh_s
        self.console = Console(soft_wrap=True)
        self._progress: Progress | None = None

    def _live(self) -> bool:
        return self.verbose == 1 and self.console.is_terminal and _checkpoint.is_chief()

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self._epoch, self._start, self._last = epoch, time.perf_counter(), 0.0
        if self._live():
            self._progress = Progress(
                TextColumn(f"epoch {epoch + 1}/{self.params['epochs']}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[speed]}  {task.fields[metrics]}"),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                "fit", total=self.params.get("steps"), speed="", metrics=""
            )

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        if self._progress is None:
            return
        now = time.perf_counter()
        self._progress.update(self._task, completed=batch + 1)
        if now - self._last >= self.refresh_s and logs is not None:
            self._last = now
            rate = (batch + 1) * self.params.get("batch_size", 0) / max(now - self._start, 1e-9)
            self._progress.update(
                self._task, speed=f"{rate:,.0f} ex/s", metrics=_format(dict(logs))
            )

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.verbose and _checkpoint.is_chief():
            seconds = time.perf_counter() - self._start
            self.console.print(
                f"epoch {epoch + 1}/{self.params['epochs']}  {seconds:.1f}s  {_format(logs or {})}"
            )

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _improved(mode: str, monitor: str) -> Any:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"Expected mode 'auto', 'min' or 'max'; found {mode!r}.")
    if mode == "auto":
        mode = "max" if "acc" in monitor else "min"
    return np.greater if mode == "max" else np.less


def _monitored(logs: Mapping[str, float] | None, monitor: str, who: str) -> float | None:
    value = (logs or {}).get(monitor)
    if value is None:
        logger.warning(
            "%s: the monitored metric %r is not in the logs (%s); skipping. Fix: monitor one of "
            "those, e.g. 'val_loss' needs validation data.",
            who,
            monitor,
            ", ".join(logs or {}),
        )
    return value


class ModelCheckpoint(Callback):
    """Save the model (and optimizer) with Orbax at the end of epochs.

    Args:
        filepath: a directory; may contain `{epoch}` or log names, e.g. `"ckpt/{epoch:02d}"`.
        monitor: the log compared when `save_best_only` (e.g. `"val_loss"`).
        save_best_only: only save when `monitor` improved.
        save_weights_only: save the model's variables only, not the optimizer state.
        mode: `"min"`, `"max"` or `"auto"` (max for accuracies).
        max_to_keep: how many checkpoints one directory keeps, newest first (default 1: each
            save replaces the previous one); None keeps every one. A `filepath` with
            `{epoch}` names a new directory each epoch, so every epoch's checkpoint is kept.

    Restore with `mirrored.restore_checkpoint(filepath, model, optimizer)`, or the path
    `mirrored.latest_checkpoint(filepath)` returns. The checkpoint's step is `epoch + 1`.
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        monitor: str = "val_loss",
        *,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        max_to_keep: int | None = 1,
    ) -> None:
        _checkpoint.check_max_to_keep(max_to_keep)
        self.filepath = os.fspath(filepath)
        self.max_to_keep = max_to_keep
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self._better = _improved(mode, monitor)
        self.best: float | None = None

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if self.save_best_only:
            value = _monitored(logs, self.monitor, "ModelCheckpoint")
            if value is None or (self.best is not None and not self._better(value, self.best)):
                return
            self.best = value
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        optimizer = None if self.save_weights_only else self.trainer.optimizer
        _checkpoint.save_checkpoint(
            path, self.trainer.model, optimizer, step=epoch + 1, max_to_keep=self.max_to_keep
        )


class EarlyStopping(Callback):
    """Stop training when `monitor` has not improved by `min_delta` for `patience` epochs.

    Keras' rules (keras/src/callbacks/early_stopping.py): every epoch counts towards `wait`;
    an improvement resets it only if it also beats `baseline`; training stops once
    `wait >= patience` (never after the first epoch). With `restore_best_weights`, the weights
    of the best epoch are restored when training ends, whether it stopped early or not, and
    even if no epoch beat the baseline (the first epoch's weights are the best then).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        *,
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self._better = _improved(mode, monitor)
        self._sign = 1.0 if self._better is np.less else -1.0
        self.stopped_epoch = 0
        self.best_epoch = 0

    def _is_improvement(self, value: float, reference: float) -> bool:
        return bool(self._better(value + self._sign * self.min_delta, reference))

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best_epoch = 0
        self.best = np.inf if self._better is np.less else -np.inf
        self.best_weights: dict[str, np.ndarray] | None = None

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        value = _monitored(logs, self.monitor, "EarlyStopping")
        if value is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = _checkpoint.state_arrays({"model": self.trainer.model})
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(value, self.best):
            self.best, self.best_epoch = value, epoch
            if self.restore_best_weights:
                self.best_weights = _checkpoint.state_arrays({"model": self.trainer.model})
            if self.baseline is None or self._is_improvement(value, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        if self.restore_best_weights and self.best_weights is not None:
            _checkpoint.load_state_arrays(
                {"model": self.trainer.model},
                self.best_weights,
                "EarlyStopping's best weights",
            )


class BackupAndRestore(Callback):
    """Resume an interrupted `fit` where its last backup left off.

    Backs up the model, optimizer state, the epoch's running metrics and the position in the
    data (epoch and step; the shuffled order is a function of the seed and epoch) at the end of
    every epoch, or every `save_freq` steps. A `fit` that finds a backup restores it and
    continues; a `fit` that completes deletes it (unless `delete_checkpoint=False`). Only the
    newest backup is kept (one step directory in `backup_dir`), as in Keras; that is all a
    resumed `fit` needs, so it is not an option. Keep checkpoints with `ModelCheckpoint`.
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        *,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
    ) -> None:
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"Expected save_freq to be 'epoch' or a positive number of steps; found "
                f"{save_freq!r}."
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._steps_done = 0

    def _save(self, epoch: int, step: int) -> None:
        arrays = self.trainer._training_state()
        arrays["position/epoch"] = np.asarray(epoch)
        arrays["position/step"] = np.asarray(step)
        self._steps_done += 1
        self._checkpoints.save(self._steps_done, arrays)

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._checkpoints = _checkpoint.Checkpoints(self.backup_dir, max_to_keep=1)
        latest = self._checkpoints.latest()
        if latest is None:
            return
        like = self.trainer._training_state()
        like["position/epoch"] = np.asarray(0)
        like["position/step"] = np.asarray(0)
        arrays = self._checkpoints.restore(like, latest)
        epoch, step = int(arrays.pop("position/epoch")), int(arrays.pop("position/step"))
        self.trainer._load_training_state(arrays, self.backup_dir)
        self.trainer._resume_at(epoch, step)
        self._steps_done = latest
        logger.info("BackupAndRestore: resuming at epoch %d, step %d", epoch + 1, step)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        if self.save_freq != "epoch" and (batch + 1) % int(self.save_freq) == 0:
            self._save(self.trainer._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self._save(epoch + 1, 0)

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        self._checkpoints.close()
        if self.delete_checkpoint and not self.trainer._interrupted and _checkpoint.is_chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)


class CSVLogger(Callback):
    """Append one row of epoch logs per epoch to a CSV file."""

    def __init__(
        self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False
    ) -> None:
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = append

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._keys: list[str] | None = None
        self._has_header = self.append and os.path.exists(self.filename)
        if not self.append and _checkpoint.is_chief() and os.path.exists(self.filename):
            os.remove(self.filename)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if not _checkpoint.is_chief():
            return
        logs = dict(logs or {})
        if self._keys is None:
            self._keys = sorted(logs)
        with open(self.filename, "a", newline="") as f:
            writer = csv.writer(f, delimiter=self.separator)
            if not self._has_header:
                writer.writerow(["epoch", *self._keys])
                self._has_header = True
            writer.writerow([epoch, *(logs.get(k, math.nan) for k in self._keys)])


class TensorBoard(Callback):
    """Write epoch scalars for TensorBoard: `log_dir/train` and `log_dir/validation`."""

    def __init__(self, log_dir: str | os.PathLike[str] = "logs") -> None:
        self.log_dir = os.fspath(log_dir)

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._writers: dict[str, EventWriter] = {}
        if _checkpoint.is_chief():
            for split in ("train", "validation"):
                self._writers[split] = EventWriter(os.path.join(self.log_dir, split))

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        for key, value in (logs or {}).items():
            split, tag = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            if split in self._writers:
                self._writers[split].scalar(f"epoch_{tag}", float(value), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
