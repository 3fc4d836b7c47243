"""`TensorBoard`: scalars, histograms and a profiled batch range as event files."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrored._core.values import to_host
from mirrored._optim import learning_rate as _learning_rate
from mirrored._persist import checkpoint as _checkpoint
from mirrored._train.callbacks.base import Callback
from mirrored._train.tensorboard import EventWriter

logger = logging.getLogger("mirrored")


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

    # What the chief writes is read on every process first: logs and weights are gathered by
    # collectives, which every process must join.
    logs_read_on_every_process = True

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
        due = self.update_freq != "epoch" and self._global_batch % int(self.update_freq) == 0
        if not due or logs is None:
            return
        values = dict(logs)  # on every process: the read is an all-reduce
        if not _checkpoint.is_chief():
            return
        writer = self._writer("train")
        for name, value in _scalars(values).items():
            writer.scalar(f"batch_{name}", value, self._global_batch)

    def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
        histogram = bool(self.histogram_freq) and epoch % self.histogram_freq == 0
        # On every process: a variable split over the processes is gathered by a collective.
        weights = _model_weights(self.trainer.model) if histogram else {}
        if not _checkpoint.is_chief():
            return
        train = {k: v for k, v in (logs or {}).items() if not k.startswith("val_")}
        validation = {k[4:]: v for k, v in (logs or {}).items() if k.startswith("val_")}
        if self._log_rate:
            train.setdefault(_learning_rate.NAME, self.trainer.learning_rate)
        for split, values in (("train", train), ("validation", validation)):
            for name, value in _scalars(values).items():
                self._writer(split).scalar(f"epoch_{name}", value, epoch)
        for name, weight in weights.items():
            self._writer("train").histogram(f"{name}/histogram", weight, epoch)
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


def _scalars(logs: dict[str, Any]) -> dict[str, float]:
    """Scalar logs as they are; a metric of several values (F1Score per class) as one scalar
    per value, `name/0`, `name/1`...: an event file's scalars are numbers."""
    out = {}
    for name, value in logs.items():
        if np.ndim(value):
            out.update({f"{name}/{i}": float(v) for i, v in enumerate(np.ravel(value))})
        else:
            out[name] = float(value)
    return out
