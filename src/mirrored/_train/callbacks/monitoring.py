"""Callbacks that watch a logged value: `EarlyStopping`, `TerminateOnNaN`, and the shared
rule for what improves."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mirrored._persist import checkpoint as _checkpoint
from mirrored._train.callbacks.base import Callback

logger = logging.getLogger("mirrored")


def _improved(
    mode: str, monitor: str, directions: Mapping[str, str | None] | None = None, who: str = ""
) -> Any:
    """np.greater or np.less: what `mode` makes an improvement of `monitor`. "auto" follows
    the monitored metric's direction (Keras 3's rule: the loss falls; accuracy, AUC, precision
    and recall rise; errors fall) from the trainer's `directions` of its logged names; for a
    name without one (a metric function of your own), "acc" in it rises, else it falls, said
    in a warning (Keras 3 raises there)."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(
            f"Expected mode 'auto', 'min' or 'max'; found {mode!r}. Fix: 'min' for losses, "
            "'max' for accuracies, or 'auto' to choose from the monitored name."
        )
    if mode == "auto":
        direction = (directions or {}).get(monitor.removeprefix("val_"))
        if direction is None:
            direction = "up" if "acc" in monitor else "down"
            if directions is not None and monitor.removeprefix("val_") in directions:
                logger.warning(
                    "%s: mode='auto' cannot tell whether %r should rise or fall (a metric "
                    "without a direction); it takes %s as better. Fix: pass mode='max' or "
                    "mode='min' (or give the metric direction='up' or 'down').",
                    who,
                    monitor,
                    "higher" if direction == "up" else "lower",
                )
        mode = "max" if direction == "up" else "min"
    return np.greater if mode == "max" else np.less


def _improved_for(callback: Any, who: str) -> Any:
    """`_improved` of `callback`'s mode and monitor, with its trainer's metric directions
    (none before the callback is given a trainer)."""
    directions = getattr(getattr(callback, "trainer", None), "_directions", None)
    return _improved(callback.mode, callback.monitor, directions, who)


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
    elif np.ndim(value) > 0:
        raise ValueError(
            f"{who} expected the monitored metric {monitor!r} to be one number; found "
            f"{np.size(value)} values (a metric per class or threshold). Fix: monitor a "
            "scalar metric, e.g. keras.metrics.F1Score(average='macro')."
        )
    return value


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
        verbose: int = 0,
    ) -> None:
        self.verbose = verbose  # Keras' messages: the epoch it stopped at, the weights restored
        self.monitor = monitor
        self.min_delta = abs(min_delta)
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.mode = mode
        self._better = _improved(mode, monitor)  # refuse an unknown mode now
        self.stopped_epoch = 0
        self.best_epoch = 0

    def _is_improvement(self, value: float, reference: float) -> bool:
        return bool(self._better(value + self._sign * self.min_delta, reference))

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._better = _improved_for(self, "EarlyStopping")
        self._sign = 1.0 if self._better is np.less else -1.0
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
        if self.stopped_epoch > 0 and self.verbose > 0:
            _chief_print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0:
                _chief_print(
                    "Restoring model weights from the end of the best epoch: "
                    f"{self.best_epoch + 1}."
                )
            _checkpoint.load_state_arrays(
                {"model": self.trainer.model},
                self.best_weights,
                "EarlyStopping's best weights",
            )


def _chief_print(message: str) -> None:
    if _checkpoint.is_chief():
        print(message)


class TerminateOnNaN(Callback):
    """Stop training at the first batch whose loss is NaN or infinite (Keras' callback), with
    the model as it was before that batch.

    While it is given, `fit` checks each step for non-finite values (its loss, gradients and
    new parameters) and looks at the check right after each execution: the step that would
    make a parameter NaN or infinite changes nothing, and training stops there ("Batch 3:
    Invalid loss, terminating training"); `on_epoch_end` and `on_train_end` still run. Keras
    applies that step first (its model is NaN afterwards): a deliberate difference
    (docs/migration.md). A non-finite gradient of a finite loss stops training too. With
    `raise_error=True` it raises a RuntimeError instead, and no callback's `on_train_end`
    runs. One wait for the devices per execution, as Keras' per-batch read of the loss.
    """

    checks_numerics = True
    logs_read_on_every_process = True  # the loss, on every process alike

    def __init__(self, raise_error: bool = False) -> None:
        self.raise_error = raise_error

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        error = getattr(self.trainer, "_non_finite", None)
        if error is not None and error.batch is not None:
            batch = error.batch
        else:  # steps not checked: the epoch's running loss, as Keras' batch logs
            loss = (logs or {}).get("loss")
            if loss is None or math.isfinite(loss):
                return
        detail = (
            "loss" if error is None or error.stage == "outputs" else f"{error.stage} ({error.path})"
        )
        if self.raise_error:
            raise RuntimeError(
                "Expected a finite loss and gradients; found non-finite values in the "
                f"{detail} at batch {batch} of epoch {self.trainer._epoch + 1}"
                + (" (that batch's update was not applied)" if error is not None else "")
                + ". Fix: lower the learning rate, clip gradients (Trainer(..., "
                "global_clipnorm=1.0)), or look for NaN or infinite inputs."
                + (f"\nWhat the check found: {error}" if error is not None else "")
            ) from error
        _chief_print(f"Batch {batch}: Invalid {detail}, terminating training")
        self.trainer.stop_training = True
