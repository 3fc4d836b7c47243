"""Keras-style callbacks for `mirrored.Trainer`: history, progress, checkpoints, logs, rates.

Only the chief process (process 0) prints and writes files.
"""

from __future__ import annotations

import csv
import inspect
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrored._optim import learning_rate as _learning_rate
from mirrored._persist import checkpoint as _checkpoint
from mirrored._strategy.strategy import to_host
from mirrored._train.tensorboard import EventWriter

if TYPE_CHECKING:
    from mirrored._train.trainer import Trainer

logger = logging.getLogger("mirrored")

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "EarlyStopping",
    "History",
    "LambdaCallback",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "ReduceLROnPlateau",
    "TensorBoard",
    "TerminateOnNaN",
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

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        """`logs` is the epoch's dict: keys added here reach later callbacks and `History`."""

    def on_batch_begin(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        """Keras' older name of `on_train_batch_begin`, which calls it."""

    def on_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        """Keras' older name of `on_train_batch_end`, which calls it."""

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        self.on_batch_begin(batch, logs=logs)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        self.on_batch_end(batch, logs=logs)

    def on_test_begin(self, logs: Mapping[str, float] | None = None) -> None: ...
    def on_test_end(self, logs: Mapping[str, float] | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None: ...
    def on_predict_begin(self, logs: Mapping[str, Any] | None = None) -> None: ...
    def on_predict_end(self, logs: Mapping[str, Any] | None = None) -> None: ...

    def on_predict_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Before predict's batch `batch`."""

    def on_predict_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """After predict's batch `batch`; `logs["outputs"]` holds its outputs (Keras' key)."""


_HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_"))
_ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def _implements(callback: Callback, hook: str) -> bool:
    """Whether `callback` does something in `hook`: its class overrides it, or it was given
    a function for it (`LambdaCallback`), or for Keras' older alias of it."""
    names = (hook, _ALIASES[hook]) if hook in _ALIASES else (hook,)
    return any(
        name in vars(callback)
        or getattr(type(callback), name, None) is not vars(Callback).get(name)
        for name in names
    )


class CallbackList:
    """Calls every callback's hook in order, skipping the ones a callback does not implement.

    As in Keras' `CallbackList(add_history=..., add_progbar=...)`, a `History` and a
    `ProgbarLogger(verbose)` are appended after the given callbacks unless one is among them,
    so they see what the others add to the logs.
    """

    def __init__(
        self,
        callbacks: Sequence[Callback] = (),
        *,
        add_history: bool = False,
        add_progbar: bool = False,
        verbose: int = 1,
    ) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"Expected mirrored.callbacks.Callback instances; found "
                    f"{type(callback).__module__}.{type(callback).__name__}. Fix: use "
                    "mirrored.callbacks.<Name> (Keras' names), subclass "
                    "mirrored.callbacks.Callback, or wrap functions in LambdaCallback."
                )
        self.history = next((c for c in self.callbacks if isinstance(c, History)), None)
        if self.history is None and add_history:
            self.history = History()
            self.callbacks.append(self.history)
        if add_progbar and not any(isinstance(c, ProgbarLogger) for c in self.callbacks):
            self.callbacks.append(ProgbarLogger(verbose))

    def overrides(self, hook: str) -> bool:
        """Whether any callback implements `hook` (per-step hooks cost time on the hot path)."""
        return any(_implements(c, hook) for c in self.callbacks)

    def __getattr__(self, hook: str) -> Any:
        if hook.startswith("__"):
            raise AttributeError(hook)
        methods = [
            getattr(c, hook)
            for c in self.callbacks
            if not hook.startswith("on_") or _implements(c, hook)
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
    # Keras' progress bar (utils/progbar.py): 4 decimals above 1e-3, else scientific.
    return "  ".join(f"{k} {v:.4f}" if v > 1e-3 else f"{k} {v:.4e}" for k, v in logs.items())


class ProgbarLogger(Callback):
    """A progress bar per epoch: steps, ETA, examples/second and running metrics (rich).

    `verbose=1` shows the bar on a terminal (one line per epoch elsewhere), `verbose=2` one line
    per epoch, `verbose=0` nothing. Metrics are read from the devices at most every
    `refresh_s` seconds, so the bar never adds a per-step synchronisation. `evaluate` shows
    one bar (and line) too; inside `fit`, validation is silent, as in Keras.
    """

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
            self._progress.update(
                self._task, speed=f"{rate:,.0f} ex/s", metrics=_format(dict(logs))
            )

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


def _improved(mode: str, monitor: str) -> Any:
    if mode not in ("auto", "min", "max"):
        raise ValueError(
            f"Expected mode 'auto', 'min' or 'max'; found {mode!r}. Fix: 'min' for losses, "
            "'max' for accuracies, or 'auto' to choose from the monitored name."
        )
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


def _chief_print(message: str) -> None:
    if _checkpoint.is_chief():
        print(message)


def _takes_rate(schedule: Callable[..., Any]) -> bool:
    """Whether `schedule` is Keras' `schedule(epoch, lr)` (else the older `schedule(epoch)`)."""
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):  # no signature to read: Keras' first try is (epoch, lr)
        return True
    for args in ((0, 0.1), (0,)):
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return len(args) == 2
    raise TypeError(
        f"Expected schedule(epoch, lr) or schedule(epoch); found {schedule!r} with the "
        f"signature {signature}. Fix: e.g. LearningRateScheduler(lambda epoch, lr: lr * 0.9)."
    )


class LearningRateScheduler(Callback):
    """Set the learning rate at the start of every epoch to `schedule(epoch, lr)`.

    Keras' callback: `epoch` counts from 0 and `lr` is the current rate; a one-argument
    `schedule(epoch)` works too. The epoch logs, and so `History`, get the rate as
    `"learning_rate"`. The optimizer must keep its rate in its state, e.g.
    `optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)` (see `Trainer.learning_rate`);
    a new rate does not recompile the step. An optimizer whose rate cannot be set fails at
    the start of `fit`, before any step.

    Example:
        >>> decay = mirrored.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
        >>> history = trainer.fit(x, y, epochs=3, callbacks=[decay])
        >>> history.history["learning_rate"]  # e.g. [0.0005, 0.00025, 0.000125]
    """

    def __init__(self, schedule: Callable[..., Any], verbose: int = 0) -> None:
        if not callable(schedule):
            raise TypeError(
                f"Expected schedule to be a function schedule(epoch, lr); found {schedule!r}. "
                "Fix: e.g. LearningRateScheduler(lambda epoch, lr: lr * 0.9)."
            )
        self.schedule = schedule
        self.verbose = verbose
        self._takes_rate = _takes_rate(schedule)

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        _learning_rate.check_settable(self.trainer.optimizer)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if self._takes_rate:
            rate = self.schedule(epoch, self.trainer.learning_rate)
        else:
            rate = self.schedule(epoch)
        self.trainer.learning_rate = _learning_rate.as_rate(
            rate,
            found_in=f" from the schedule at epoch {epoch}",
            fix="return a float, e.g. LearningRateScheduler(lambda epoch, lr: lr * 0.9)",
        )
        if self.verbose > 0:
            _chief_print(
                f"Epoch {epoch + 1}: LearningRateScheduler setting learning rate to {rate}."
            )

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if logs is not None:
            logs[_learning_rate.NAME] = self.trainer.learning_rate


class ReduceLROnPlateau(Callback):
    """Reduce the learning rate when `monitor` has stopped improving.

    Keras' rules (keras/src/callbacks/reduce_lr_on_plateau.py), step by step at each epoch end:
    the epoch logs get the rate the epoch used as `"learning_rate"`; during a cooldown the
    counter drops by one and `wait` resets; an improvement (below `best - min_delta` in
    `"min"` mode, above `best + min_delta` in `"max"`) becomes the best and resets `wait`;
    otherwise, outside a cooldown, `wait` grows and once `wait >= patience` the rate becomes
    `max(lr * factor, min_lr)` (only while `lr > min_lr`), a cooldown of `cooldown` epochs
    starts and `wait` resets. `mode="auto"` means "max" for a monitor with "acc" in its name.
    The optimizer must keep its rate in its state (see `Trainer.learning_rate`); a new rate
    does not recompile the step.

    Example:
        >>> reduce = mirrored.callbacks.ReduceLROnPlateau(factor=0.2, patience=5, min_lr=1e-5)
        >>> trainer.fit(x, y, epochs=50, validation_split=0.1, callbacks=[reduce])
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        verbose: int = 0,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
    ) -> None:
        if factor >= 1.0:
            raise ValueError(
                f"Expected factor < 1.0 (new_lr = lr * factor); found factor={factor!r}. Fix: "
                "e.g. factor=0.1 divides the rate by 10."
            )
        _improved(mode, monitor)  # refuse an unknown mode now
        self.monitor = monitor
        self.factor = factor
        self.patience = patience
        self.verbose = verbose
        self.mode = mode
        self.min_delta = min_delta
        self.cooldown = cooldown
        self.min_lr = min_lr
        self._reset()

    def _reset(self) -> None:
        if _improved(self.mode, self.monitor) is np.less:
            self.monitor_op = lambda a, b: np.less(a, b - self.min_delta)
            self.best = np.inf
        else:
            self.monitor_op = lambda a, b: np.greater(a, b + self.min_delta)
            self.best = -np.inf
        self.cooldown_counter = 0
        self.wait = 0

    def in_cooldown(self) -> bool:
        return self.cooldown_counter > 0

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        _learning_rate.check_settable(self.trainer.optimizer)
        self._reset()

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        rate = self.trainer.learning_rate
        if logs is not None:
            logs[_learning_rate.NAME] = rate
        current = _monitored(logs, self.monitor, "ReduceLROnPlateau")
        if current is None:
            return
        if self.in_cooldown():
            self.cooldown_counter -= 1
            self.wait = 0
        if self.monitor_op(current, self.best):
            self.best = current
            self.wait = 0
        elif not self.in_cooldown():
            self.wait += 1
            # The rate is stored as float32: compare with min_lr in float32 too, as Keras does.
            if self.wait >= self.patience and rate > np.float32(self.min_lr):
                new_rate = max(rate * self.factor, self.min_lr)
                self.trainer.learning_rate = new_rate
                if self.verbose > 0:
                    _chief_print(
                        f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate to "
                        f"{new_rate}."
                    )
                self.cooldown_counter = self.cooldown
                self.wait = 0


class LambdaCallback(Callback):
    """A callback made of functions, Keras' `LambdaCallback`.

    Each function is called as the hook it stands for: `on_epoch_begin(epoch, logs)`,
    `on_epoch_end(epoch, logs)`, `on_train_begin(logs)`, `on_train_end(logs)`, and
    `on_train_batch_begin(batch, logs=...)` / `on_train_batch_end(batch, logs=...)`. Other
    hooks by keyword, e.g. `on_test_end=lambda logs: ...`. A batch hook reads the epoch's
    running logs only if the function looks at `logs` (each look waits for the step).

    Example:
        >>> losses = []
        >>> record = mirrored.callbacks.LambdaCallback(
        ...     on_epoch_end=lambda epoch, logs: losses.append(logs["loss"]))
    """

    def __init__(
        self,
        on_epoch_begin: Callable[..., Any] | None = None,
        on_epoch_end: Callable[..., Any] | None = None,
        on_train_begin: Callable[..., Any] | None = None,
        on_train_end: Callable[..., Any] | None = None,
        on_train_batch_begin: Callable[..., Any] | None = None,
        on_train_batch_end: Callable[..., Any] | None = None,
        **kwargs: Callable[..., Any],
    ) -> None:
        hooks = {
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
            **kwargs,
        }
        for name, function in hooks.items():
            if name not in _HOOKS:
                raise TypeError(
                    f"Expected callback hook names ({', '.join(sorted(_HOOKS))}); found "
                    f"{name!r}. Fix: LambdaCallback(on_epoch_end=lambda epoch, logs: ...)."
                )
            if function is None:
                continue
            if not callable(function):
                raise TypeError(
                    f"Expected {name} to be a function; found {function!r}. Fix: e.g. "
                    f"LambdaCallback({name}=lambda *args, logs=None: ...)."
                )
            setattr(self, name, function)


class TerminateOnNaN(Callback):
    """Stop training right after a batch whose loss is NaN or infinite (Keras' callback).

    After every batch it reads the epoch's running loss (what Keras' batch logs hold too):
    one NaN or infinite batch loss makes it NaN or infinite from that batch on, so training
    stops after the first bad batch; `on_epoch_end` and `on_train_end` still run. With
    `raise_error=True` it raises a RuntimeError instead, and no callback's `on_train_end` runs.
    Reading the loss waits for each step to finish on the devices: one synchronisation per
    step, as in Keras.
    """

    def __init__(self, raise_error: bool = False) -> None:
        self.raise_error = raise_error

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(loss):
            return
        if self.raise_error:
            raise RuntimeError(
                f"Expected a finite loss; found {loss} after batch {batch} of epoch "
                f"{self.trainer._epoch + 1}. Fix: lower the learning rate, clip gradients "
                "(Trainer(..., global_clipnorm=1.0)), or look for NaN or infinite inputs."
            )
        _chief_print(f"Batch {batch}: Invalid loss, terminating training")
        self.trainer.stop_training = True


def _model_weights(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every floating-point variable of the model (Keras' `model.weights`), by its path."""
    weights = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating):
            weights["/".join(map(str, path))] = np.asarray(to_host(value), np.float32)
    return weights


class TensorBoard(Callback):
    """Write logs for TensorBoard (with tensorboardX; no TensorFlow needed).

    Keras' callback, tags and steps: epoch logs as `epoch_<name>` at step `epoch` in
    `log_dir/train`, and `val_` logs in `log_dir/validation` (created only when there are
    validation logs); the learning rate as `epoch_learning_rate` when `Trainer.learning_rate`
    is readable.

    Args:
        log_dir: the directory of the `train` and `validation` event files.
        histogram_freq: every this many epochs (epochs 0, N, 2N, ...), a histogram of every
            floating-point model variable, tagged `<path>/histogram` (e.g.
            `hidden/kernel/histogram`); 0 writes none.
        update_freq: `"epoch"`; `"batch"` or an integer N: also the running logs as
            `batch_<name>` every N batches, at the number of batches since `fit` began
            (counting from 1). Each write waits for the step, as in Keras.
        profile_batch: Keras' argument: profile batch N, or batches `(start, stop)` (counting
            from 1 since `fit` began; 0, the default, profiles none) with `jax.profiler`
            into `log_dir/train` (TensorBoard's Profile tab, Perfetto), then read the trace
            back: `profile_report` holds where the time went (`mirrored.ProfileReport`) and
            its verdicts are logged.

    Example:
        >>> tb = mirrored.callbacks.TensorBoard("logs", histogram_freq=1, update_freq=100)
        >>> tb = mirrored.callbacks.TensorBoard("logs", profile_batch=(10, 15))
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        *,
        histogram_freq: int = 0,
        update_freq: str | int = "epoch",
        profile_batch: int | tuple[int, int] = 0,
    ) -> None:
        if (
            isinstance(histogram_freq, bool)
            or not isinstance(histogram_freq, int)
            or histogram_freq < 0
        ):
            raise ValueError(
                f"Expected histogram_freq to be a number of epochs >= 0; found "
                f"{histogram_freq!r}. Fix: e.g. histogram_freq=1 (every epoch), 0 for none."
            )
        if update_freq not in ("epoch", "batch") and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"Expected update_freq to be 'epoch', 'batch' or a positive number of batches; "
                f"found {update_freq!r}. Fix: e.g. update_freq=100."
            )
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.update_freq: str | int = 1 if update_freq == "batch" else update_freq
        self._writers: dict[str, EventWriter] = {}
        self._profile = _profile_range(profile_batch)
        self._tracer: Any = None
        self.profile_report: Any = None  # a mirrored.ProfileReport once batches were profiled

    def _writer(self, split: str) -> EventWriter:
        # Created on first use, as in Keras: no validation/ directory without validation logs.
        if split not in self._writers:
            self._writers[split] = EventWriter(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._writers = {}
        self._global_batch = 0
        self._tracer = None
        try:
            self.trainer.learning_rate  # noqa: B018 - readable or not, decided once
            self._log_rate = True
        except (ValueError, TypeError):
            self._log_rate = False

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        if self._profile is None:
            return
        from mirrored._proof import profile as _profile

        if self._global_batch + 1 == self._profile[0]:
            self._tracer = _profile.Tracer(os.path.join(self.log_dir, "train"))
            self._tracer.start()
        if self._tracer is not None:
            self._tracer.step_begin(self._global_batch)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        self._global_batch += 1
        if self._tracer is not None:
            self._tracer.step_end()
            if self._global_batch >= self._profile[1]:  # type: ignore[index]
                self._stop_profile()
        if (
            self.update_freq == "epoch"
            or self._global_batch % int(self.update_freq)
            or logs is None
            or not _checkpoint.is_chief()
        ):
            return
        writer = self._writer("train")
        for name, value in logs.items():
            writer.scalar(f"batch_{name}", float(value), self._global_batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        if not _checkpoint.is_chief():
            return
        train = {k: v for k, v in (logs or {}).items() if not k.startswith("val_")}
        validation = {k[4:]: v for k, v in (logs or {}).items() if k.startswith("val_")}
        if self._log_rate:
            train.setdefault(_learning_rate.NAME, self.trainer.learning_rate)
        for split, values in (("train", train), ("validation", validation)):
            for name, value in values.items():
                self._writer(split).scalar(f"epoch_{name}", float(value), epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0:
            for name, weights in _model_weights(self.trainer.model).items():
                self._writer("train").histogram(f"{name}/histogram", weights, epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        if self._tracer is not None:  # fit ended inside the profiled range
            self._stop_profile()
        for writer in self._writers.values():
            writer.close()
        self._writers = {}

    def _stop_profile(self) -> None:
        from mirrored._proof import profile as _profile

        tracer, self._tracer = self._tracer, None
        trainer = self.trainer
        tracer.stop(lambda: _profile._wait((trainer.model, trainer.optimizer)))
        self.profile_report = tracer.report(trainer.strategy)
        share = self.profile_report.breakdown
        logger.info(
            "Profiled %d batch(es) into %s: compute %.0f%%, collectives %.0f%%, input %.0f%%, "
            "idle %.0f%% of the step.",
            tracer.steps,
            tracer.logdir,
            *(100 * share[part] for part in _profile.PARTS),
        )
        for check in self.profile_report.checks:
            if check.status in ("WARN", "FAIL"):
                logger.warning("%s: %s. %s", check.name, check.summary, check.explanation)


def _profile_range(profile_batch: Any) -> tuple[int, int] | None:
    """Keras' `profile_batch`: N, (start, stop) or "start,stop"; 0 for none."""
    value = profile_batch
    if isinstance(value, str):
        try:
            value = tuple(int(v) for v in value.split(","))
        except ValueError:
            value = None
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value, value)
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or value[0] < 0
        or value[1] < value[0]
        or (value[0] == 0 and value[1] != 0)
    ):
        raise ValueError(
            "Expected profile_batch to be a non-negative int or a pair (start, stop) of "
            f"batches to profile, counting from 1; found {profile_batch!r}. Fix: e.g. "
            "profile_batch=5 or profile_batch=(10, 15); 0 profiles none."
        )
    return None if value[0] == 0 else (value[0], value[1])
