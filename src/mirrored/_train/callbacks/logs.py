"""Callbacks that log or run user code: `CSVLogger`, `LambdaCallback`."""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from mirrored._persist import checkpoint as _checkpoint
from mirrored._train.callbacks.base import _HOOKS, Callback

logger = logging.getLogger("mirrored")


class CSVLogger(Callback):
    """Append one row of epoch logs per epoch to a CSV file."""

    def __init__(
        self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False
    ) -> None:
        self.filename = os.fspath(filename)
        if not self.filename:
            raise ValueError(
                "Expected CSVLogger(filename) to be a file path; found ''. Fix: e.g. "
                "CSVLogger('training.csv')."
            )
        self.separator = separator
        self.append = append

    def check(self) -> None:
        """Keras opens the file when training begins: the file must be writable then, not
        after the first epoch trained."""
        if not _checkpoint.is_chief():
            return
        folder = os.path.dirname(os.path.abspath(self.filename))
        if os.path.isdir(self.filename):
            raise IsADirectoryError(
                f"Expected CSVLogger's filename to be a file; found the directory "
                f"{self.filename!r}. Fix: name a file in it, e.g. "
                f"{os.path.join(self.filename, 'log.csv')!r}."
            )
        if not os.path.isdir(folder):
            raise FileNotFoundError(
                f"Expected CSVLogger's folder {folder!r} to exist (the log {self.filename!r} "
                f"goes there); found none. Fix: os.makedirs({folder!r}, exist_ok=True) first."
            )
        if not os.access(folder, os.W_OK):
            raise PermissionError(
                f"Expected to write CSVLogger's file in {folder!r}; found the folder not "
                "writable. Fix: choose a folder you can write to."
            )

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
