"""Learning-rate callbacks: `LearningRateScheduler`, `ReduceLROnPlateau`."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mirrored._optim import learning_rate as _learning_rate
from mirrored._train.callbacks.base import Callback
from mirrored._train.callbacks.monitoring import (
    _chief_print,
    _improved,
    _improved_for,
    _monitored,
)

logger = logging.getLogger("mirrored")


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
        if _improved_for(self, "ReduceLROnPlateau") is np.less:
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
