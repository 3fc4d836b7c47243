"""Installing `mirrored.keras`: Keras' methods patched (the list is here, in one place) and the
extension registered with the core."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
from keras.src.backend.jax import core as jax_core
from keras.src.backend.jax.trainer import JAXTrainer
from keras.src.losses import loss as loss_module
from keras.src.trainers import trainer as base_trainer

from mirrored._core import context as _context
from mirrored._core import hooks
from mirrored.keras import _fit, _patches
from mirrored.keras._extension import KerasExtension


def _make_function(original: Callable[..., Any], kind: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def make(self: Any, force: bool = False) -> Any:
        strategy = _patches._STRATEGY_OF.get(self)
        if strategy is None or _context.entered_strategy() is None:
            return original(self, force)
        attribute = f"{kind}_function"
        current = getattr(self, attribute)
        if current is not None and not force and getattr(current, "mirrored", None) is strategy:
            return current
        function = _fit.make_function(self, strategy, kind)
        setattr(self, attribute, function)
        return function

    return make


def install() -> None:
    """Apply the patches and register the extension (once per process: at the first
    `import mirrored.keras`)."""
    variable = jax_core.JaxVariable
    variable._initialize_layout = _patches._initialize_layout(variable._initialize_layout)
    loss_module.Loss.__call__ = _patches._loss_call(loss_module.Loss.__call__)
    trainer = base_trainer.Trainer
    trainer._aggregate_additional_loss = _patches._aggregate_additional_loss(
        trainer._aggregate_additional_loss
    )
    keras.layers.Layer.activity_regularizer = _patches._ActivityRegularizer()  # type: ignore[assignment]
    keras.src.backend.rnn = _patches._rnn(keras.src.backend.rnn)
    norm = keras.layers.BatchNormalization
    norm.__init__ = _patches._batch_norm_init(norm.__init__)
    norm._moments = _patches._batch_norm_moments(norm._moments)
    # LossScaleOptimizer has an `apply` of its own.
    for cls in list(_patches._defining(keras.src.optimizers.base_optimizer.BaseOptimizer, "apply")):
        setattr(cls, "apply", _patches._optimizer_apply(cls.__dict__["apply"]))  # noqa: B010
    JAXTrainer.__init__ = _patches._tie_at_init(JAXTrainer.__init__)
    trainer.compile = _patches._compile(trainer.compile)
    for name in (
        "fit",
        "evaluate",
        "predict",
        "train_on_batch",
        "test_on_batch",
        "predict_on_batch",
    ):
        setattr(JAXTrainer, name, _patches._in_strategy(getattr(JAXTrainer, name), name))
    for kind in ("train", "test", "predict"):
        name = f"make_{kind}_function"
        setattr(JAXTrainer, name, _make_function(getattr(JAXTrainer, name), kind))
    hooks.register(KerasExtension())
