"""Checkpointing callbacks: `ModelCheckpoint` (best or every epoch) and `BackupAndRestore`
(resume an interrupted `fit`)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Mapping

import numpy as np

from mirrored._cluster import preemption
from mirrored._core import coordination as _coordination
from mirrored._core.devices import owning_processes
from mirrored._persist import checkpoint as _checkpoint
from mirrored._train.callbacks.base import Callback
from mirrored._train.callbacks.monitoring import (
    _chief_print,
    _improved,
    _improved_for,
    _monitored,
)

logger = logging.getLogger("mirrored")


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
        verbose: int = 0,
        save_freq: str = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        _checkpoint.check_max_to_keep(max_to_keep)
        if save_freq != "epoch":
            raise ValueError(
                f"Expected ModelCheckpoint's save_freq='epoch' (a checkpoint after each "
                f"epoch); found {save_freq!r}. Fix: BackupAndRestore(dir, save_freq={save_freq!r})"
                " backs up every N batches (and resumes there); ModelCheckpoint saves per epoch."
            )
        self.verbose = verbose  # Keras' messages: saved, improved or not
        self.filepath = os.fspath(filepath)
        if not self.filepath:
            raise ValueError(
                "Expected ModelCheckpoint(filepath) to be a directory path; found ''. Fix: "
                "e.g. ModelCheckpoint('ckpt') or ModelCheckpoint('ckpt/{epoch:02d}')."
            )
        if os.path.isfile(self.filepath):
            raise FileExistsError(
                f"Expected ModelCheckpoint(filepath) to be a directory (a checkpoint is one); "
                f"found the file {self.filepath!r}. Fix: name a directory, e.g. "
                f"{self.filepath + '_ckpt'!r}, or remove the file."
            )
        self.max_to_keep = max_to_keep
        self.monitor = monitor
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.mode = mode
        self._better = _improved(mode, monitor)  # refuse an unknown mode now
        self.best: float | None = initial_value_threshold  # Keras': beat it to save

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._better = _improved_for(self, "ModelCheckpoint")

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        said = f"Epoch {epoch + 1}: "
        if self.save_best_only:
            value = _monitored(logs, self.monitor, "ModelCheckpoint")
            if value is None:
                return
            best = self.best
            if best is not None and not self._better(value, best):
                self._say(f"{said}{self.monitor} did not improve from {best:.5f}")
                return
            start = "inf" if self._better is np.less else "-inf"
            shown = start if best is None else f"{best:.5f}"
            self._say(f"{said}{self.monitor} improved from {shown} to {value:.5f}, saving model")
            self.best = value
        else:
            self._say(f"{said}saving model to {path}")
        optimizer = None if self.save_weights_only else self.trainer.optimizer
        _checkpoint.save_checkpoint(
            path, self.trainer.model, optimizer, step=epoch + 1, max_to_keep=self.max_to_keep
        )

    def _say(self, message: str) -> None:
        if self.verbose > 0:
            _chief_print(message)


class BackupAndRestore(Callback):
    """Resume an interrupted `fit` where its last backup left off.

    Backs up the model, optimizer state, the epoch's running metrics and the position in the
    data (epoch and step; the shuffled order is a function of the seed and epoch) at the end of
    every epoch, or every `save_freq` steps. A `fit` that finds a backup restores it and
    continues; a `fit` that completes deletes it (unless `delete_checkpoint=False`). Only the
    newest backup is kept (one step directory in `backup_dir`), as in Keras; that is all a
    resumed `fit` needs, so it is not an option. Keep checkpoints with `ModelCheckpoint`.

    With `save_before_preemption=True` (tf-keras' name), a termination notice to any process
    (SIGTERM) makes every process back up at one agreed step and exit 42, for a launcher
    (`mirrored launch --max-restarts`) or platform to restart the job, which resumes there;
    `save_freq=False` then backs up at preemptions only.
    """

    logs_read_on_every_process = True  # it never reads a batch's logs

    def __init__(
        self,
        backup_dir: str | os.PathLike[str],
        *,
        save_freq: str | int | bool = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
    ) -> None:
        if save_freq is False:
            if not save_before_preemption:
                raise ValueError(
                    "Expected save_freq=False (no regular backups) only with "
                    "save_before_preemption=True; found save_before_preemption=False, which "
                    "would back up nothing. Fix: pass save_before_preemption=True, or "
                    "save_freq='epoch' or a number of steps."
                )
        elif save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"Expected save_freq to be 'epoch', a positive number of steps or False; found "
                f"{save_freq!r}. Fix: save_freq='epoch' (the default) or e.g. save_freq=100."
            )
        self.backup_dir = os.fspath(backup_dir)
        if not self.backup_dir or os.path.isfile(self.backup_dir):
            raise ValueError(
                f"Expected BackupAndRestore(backup_dir) to be a directory path; found "
                f"{self.backup_dir!r}{' (a file)' if self.backup_dir else ''}. Fix: e.g. "
                "BackupAndRestore('backup')."
            )
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = bool(save_before_preemption)
        self._steps_done = 0
        self._notice: preemption.TerminationNotice | None = None
        self._batches = 0

    def _save(self, epoch: int, step: int) -> None:
        arrays = self.trainer._training_state()
        arrays["position/epoch"] = np.asarray(epoch)
        arrays["position/step"] = np.asarray(step)
        self._steps_done += 1
        self._checkpoints.save(self._steps_done, arrays)

    def on_train_begin(self, logs: Mapping[str, float] | None = None) -> None:
        self._checkpoints = _checkpoint.Checkpoints(self.backup_dir, max_to_keep=1)
        if self.save_before_preemption:
            self._batches = 0
            self._notice = preemption.TerminationNotice()
        # Every process resumes from the chief's choice: its own listing may be stale (a
        # network file system) or taken before the chief deleted a finished fit's backup,
        # and a process that restored alone would wait in a collective the others skip.
        latest = self._checkpoints.latest()
        owners = owning_processes(self.trainer.strategy.extended.worker_devices)
        agreed = _coordination.chiefs(
            "" if latest is None else str(latest), owners, tag="BackupAndRestore's backup"
        )
        latest = int(agreed) if agreed else None
        if latest is None:
            return
        like = self.trainer._training_state()
        like["position/epoch"] = np.asarray(0)
        like["position/step"] = np.asarray(0)
        arrays = self._checkpoints.restore(like, latest, prefix="metrics/")
        epoch, step = int(arrays.pop("position/epoch")), int(arrays.pop("position/step"))
        self.trainer._load_training_state(arrays, self.backup_dir)
        self.trainer._resume_at(epoch, step)
        self._steps_done = latest
        logger.info("BackupAndRestore: resuming at epoch %d, step %d", epoch + 1, step)

    @property
    def reads_every_batch(self) -> bool:  # type: ignore[override]
        """Only when saving every `save_freq` steps or counting them for a preemption notice
        (else its batch hook does nothing: `steps_per_execution="auto"` may run K at once)."""
        return self.save_freq not in ("epoch", False) or self.save_before_preemption

    def on_train_batch_end(self, batch: int, logs: Mapping[str, float] | None = None) -> None:
        if self.save_freq not in ("epoch", False) and (batch + 1) % int(self.save_freq) == 0:
            self._save(self.trainer._epoch, batch + 1)
        if self._notice is not None:
            self._batches += 1  # the same count on every process: the agreed step's number
            if self._notice.reached(self._batches):
                self._preempted(batch)

    def _preempted(self, batch: int) -> None:
        """Back up here (every process agreed on this step) and exit 42."""
        assert self._notice is not None
        self._notice.close()
        preemption.announce(self._batches, self.backup_dir)
        self._save(self.trainer._epoch, batch + 1)
        self._checkpoints.close()
        sys.exit(preemption.RESTART_EXIT_CODE)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        if self.save_freq is not False:
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: Mapping[str, float] | None = None) -> None:
        if self._notice is not None:
            self._notice.close()
            self._notice = None
        self._checkpoints.close()
        if self.delete_checkpoint and not self.trainer._interrupted and _checkpoint.is_chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)
