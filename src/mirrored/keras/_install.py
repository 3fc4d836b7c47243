"""Installing `mirrored.keras`: Keras' methods patched (the list is here, in one place) and the
extension registered with the core."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import keras

from mirrored._core import context as _context
from mirrored._core import hooks, patching
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


logger = logging.getLogger("mirrored")

K = "keras 3.15"
_T = patching.target
_INITIALIZE_LAYOUT = _T(
    "keras.src.backend.jax.core.JaxVariable",
    "_initialize_layout",
    reason="a variable created in strategy.scope() is placed mirrored on the strategy's devices",
    checked=K,
)
_LOSS_CALL = _T(
    "keras.src.losses.loss.Loss",
    "__call__",
    reason="a padded batch's rows masked out of the loss, divided by the global real count",
    checked=K,
)
_ADDITIONAL_LOSS = _T(
    "keras.src.trainers.trainer.Trainer",
    "_aggregate_additional_loss",
    reason="regularization losses counted once per global batch, not once per replica",
    checked=K,
)
_ACTIVITY_REGULARIZER = _T(
    "keras.layers.Layer",
    "activity_regularizer",
    reason="activity penalties count the global batch's real rows once (a descriptor)",
    checked=K,
    adds=True,
)
_RNN = _T(
    "keras.src.backend",
    "rnn",
    reason="recurrent layers' initial states start varying across replicas",
    checked=K,
)
_BATCH_NORM_INIT = _T(
    "keras.layers.BatchNormalization",
    "__init__",
    reason="synchronized=True remembered for global-batch statistics",
    checked=K,
)
_BATCH_NORM_MOMENTS = _T(
    "keras.layers.BatchNormalization",
    "_moments",
    reason="batch statistics over real rows; moving statistics averaged over replicas",
    checked=K,
)
_OPTIMIZER_APPLY = _T(
    "keras.src.optimizers.base_optimizer.BaseOptimizer",
    "apply",
    reason="(on every optimizer class defining it) slots created mirrored, updates in sync",
    checked=K,
)
_TRAINER_INIT = _T(
    "keras.src.backend.jax.trainer.JAXTrainer",
    "__init__",
    reason="a model built in a scope is tied to its strategy",
    checked=K,
)
_COMPILE = _T(
    "keras.src.trainers.trainer.Trainer",
    "compile",
    reason="compile in a scope ties the model; the from_logits warning reads the model",
    checked=K,
)
_LOOPS = {
    name: _T(
        "keras.src.backend.jax.trainer.JAXTrainer",
        name,
        reason="fit, evaluate and predict of a mirrored model run inside its strategy",
        checked=K,
    )
    for name in (
        "fit",
        "evaluate",
        "predict",
        "train_on_batch",
        "test_on_batch",
        "predict_on_batch",
    )
}
_MAKE_FUNCTIONS = {
    kind: _T(
        "keras.src.backend.jax.trainer.JAXTrainer",
        f"make_{kind}_function",
        reason="the step Keras compiles becomes one SPMD program over the replicas",
        checked=K,
    )
    for kind in ("train", "test", "predict")
}


TESTED_KERAS = ">=3.15,<4"  # the range the patches above were checked against


def check_version(version: str) -> bool:
    """Warn once when Keras' major version is one the patches were never checked against."""
    if version.split(".")[0] == "3":
        return True
    if version in _warned_versions:
        return False
    _warned_versions.add(version)
    logger.warning(
        "mirrored.keras is tested with Keras %s; found Keras %s. Its patches of Keras internals "
        "(listed in mirrored._core.patching.TARGETS) may no longer fit, and a mirrored model "
        "may train with wrong numbers. Fix: pip install 'keras%s', or run mirrored.verify on "
        "your model before trusting it.",
        TESTED_KERAS,
        version,
        TESTED_KERAS,
    )
    return False


_warned_versions: set[str] = set()


def install() -> None:
    """Apply the patches and register the extension (once per process: at the first
    `import mirrored.keras`)."""
    check_version(keras.__version__)
    replace = functools.partial(patching.replace, inherited=True)
    replace(_INITIALIZE_LAYOUT, _patches._initialize_layout)
    replace(_LOSS_CALL, _patches._loss_call)
    replace(_ADDITIONAL_LOSS, _patches._aggregate_additional_loss)
    replace(_ACTIVITY_REGULARIZER, lambda _: _patches._ActivityRegularizer())
    replace(_RNN, _patches._rnn)
    replace(_BATCH_NORM_INIT, _patches._batch_norm_init)
    replace(_BATCH_NORM_MOMENTS, _patches._batch_norm_moments)
    # LossScaleOptimizer has an `apply` of its own.
    for cls in list(_patches._defining(keras.src.optimizers.base_optimizer.BaseOptimizer, "apply")):
        patching.replace(_OPTIMIZER_APPLY, _patches._optimizer_apply, owner=cls)
    replace(_TRAINER_INIT, _patches._tie_at_init)
    replace(_COMPILE, _patches._compile)
    for name, found in _LOOPS.items():
        replace(found, functools.partial(_patches._in_strategy, what=name))
    for kind, found in _MAKE_FUNCTIONS.items():
        replace(found, functools.partial(_make_function, kind=kind))
    hooks.register(KerasExtension())
