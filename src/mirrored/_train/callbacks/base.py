"""The callback base class, the list that calls callbacks, and `History`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

logger = logging.getLogger("mirrored")


class TrainerLike(Protocol):
    """What callbacks read and set of the `Trainer` they are attached to (`TrainerLike`)."""

    model: Any
    optimizer: Any
    strategy: Any
    stop_training: bool
    learning_rate: Any
    _epoch: int
    _interrupted: bool
    _resume_at: Any

    def _training_state(self) -> dict[str, Any]: ...

    def _load_training_state(self, arrays: dict[str, Any], source: str) -> None: ...


class Callback:
    """Base class: override the hooks you need. `self.model` is the Trainer (as in Keras)."""

    trainer: TrainerLike
    params: dict[str, Any]
    # True: `fit` checks its steps for non-finite values while this callback is given, so the
    # step that would make a parameter NaN or infinite changes nothing (`TerminateOnNaN`).
    checks_numerics = False
    # True: this callback reads a batch's logs on every process or on none (mirrored's own).
    # Reading them runs a collective (an all-reduce of the running sums), so in a job of
    # several processes the logs of a callback that may read them on one process only (say
    # the chief's print) are read on every process before it is called.
    logs_read_on_every_process = False
    # True: a batch hook of this callback wants every batch (Keras' steps_per_execution=1),
    # so `steps_per_execution="auto"` runs one step per program while it is given; False:
    # it is as fine with K steps at a time (the progress bar, refreshed on a clock).
    reads_every_batch = True

    def set_trainer(self, trainer: TrainerLike, params: dict[str, Any]) -> None:
        self.trainer = trainer
        self.params = params

    @property
    def model(self) -> TrainerLike:
        """The Trainer, so that `self.model.stop_training = True` works as in Keras."""
        return self.trainer

    def check(self) -> None:
        """Raise if this callback cannot work (a path that cannot be written, say): `fit`
        asks every callback before anything runs or changes. Override it for your own."""

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


class History(Callback):
    """Records the epoch logs: `history.history["loss"]` is one value per epoch."""

    def __init__(self) -> None:
        self.history: dict[str, list[float]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Mapping[str, float] | None = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)
