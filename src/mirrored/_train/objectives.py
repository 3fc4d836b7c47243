"""Keras-style losses and metrics, as per-example functions the Trainer reduces exactly.

Every loss and metric maps `(y_true, y_pred)` to one value per example. The Trainer sums them
over the real (unpadded) examples of every replica and step and divides by the global count,
so an 8-replica number equals the single-device number (no mean of means).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mirrored._train import confusion as _confusion
from mirrored._train import keras_objectives as _keras
from mirrored._train import metrics as _metrics

_EPSILON = 1e-7


def per_example(values: jax.Array) -> jax.Array:
    """Average everything but the batch axis, as Keras' `sum_over_batch_size` does."""
    return values.reshape(values.shape[0], -1).mean(axis=1) if values.ndim > 1 else values


def _shape_error(name: str, expected: str, y_true: Any, y_pred: Any, fix: str) -> ValueError:
    return ValueError(
        f"{name} expected {expected}; found labels of shape {tuple(y_true.shape)} "
        f"({y_true.dtype}) for predictions of shape {tuple(y_pred.shape)}. Fix: {fix}"
    )


_REDUCTIONS = ("sum_over_batch_size", "mean")  # what the Trainer does with per-example losses


class Loss:
    """A per-example loss: `loss(y_true, y_pred)` → shape `(batch,)`.

    The arguments are Keras' (`from_logits` first, positional as in Keras; `name`); the
    Trainer averages the per-example values over the global batch, Keras' default
    `reduction="sum_over_batch_size"`. Another reduction: pass Keras' own loss object.
    """

    name = "loss"

    def __init__(
        self,
        from_logits: bool = False,
        *,
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
    ) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"Expected reduction='sum_over_batch_size' (Keras' default: the mean over the "
                f"global batch) for a mirrored loss; found reduction={reduction!r}. Fix: drop "
                f"it, or pass Keras' own loss object (keras.losses.{type(self).__name__}("
                f"reduction={reduction!r})), which the Trainer reduces as Keras does."
            )
        self.from_logits = from_logits
        if name is not None:
            self.name = name

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(from_logits={self.from_logits})"


class SparseCategoricalCrossentropy(Loss):
    """Integer class labels `(batch,)` against scores `(batch, classes)`.

    `ignore_class`, as Keras: labels equal to it count for nothing, and the batch's loss is
    the mean over the others (the Trainer divides by the global batch's count of them).
    """

    name = "sparse_categorical_crossentropy"

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        *,
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
    ) -> None:
        super().__init__(from_logits, reduction=reduction, name=name)
        if ignore_class is not None and (
            isinstance(ignore_class, bool) or not isinstance(ignore_class, int | np.integer)
        ):
            raise ValueError(
                f"Expected ignore_class to be an int label (or None); found {ignore_class!r}. "
                "Fix: e.g. ignore_class=-1 for padding labels of -1."
            )
        self.ignore_class = None if ignore_class is None else int(ignore_class)

    def masked(self, y_true: Any, y_pred: Any) -> tuple[jax.Array, jax.Array]:
        """(the losses, 1 where the label is not `ignore_class`), one of each per label."""
        if y_true.ndim == y_pred.ndim and y_true.shape[-1:] == (1,):
            y_true = y_true[..., 0]
        valid = y_true.astype(jnp.int32) != self.ignore_class
        losses = self._values(jnp.where(valid, y_true, 0), y_pred)
        return jnp.where(valid, losses, 0.0), valid.astype(jnp.float32)

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        if self.ignore_class is not None:  # one number: the mean over the labels counted
            losses, valid = self.masked(y_true, y_pred)
            return jnp.sum(losses) / jnp.maximum(jnp.sum(valid), 1.0)
        return per_example(self._values(y_true, y_pred))

    def _values(self, y_true: Any, y_pred: Any) -> jax.Array:
        if y_true.ndim == y_pred.ndim and y_true.shape[-1:] == (1,):
            y_true = y_true[..., 0]
        if y_true.shape != y_pred.shape[:-1]:
            raise _shape_error(
                self.name,
                f"class-index labels of shape {tuple(y_pred.shape[:-1])}",
                y_true,
                y_pred,
                "pass class indices (not one-hot rows; for those use 'categorical_crossentropy').",
            )
        labels = y_true.astype(jnp.int32)  # float class indices too, as Keras casts them
        if self.from_logits:
            return optax.softmax_cross_entropy_with_integer_labels(y_pred, labels)
        log_probs = _log_probabilities(y_pred)
        return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def _smoothing(label_smoothing: float) -> float:
    if isinstance(label_smoothing, bool) or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(
            f"Expected label_smoothing to be a number in [0, 1]; found {label_smoothing!r}. "
            "Fix: e.g. label_smoothing=0.1 (Keras' default is 0: no smoothing)."
        )
    return float(label_smoothing)


def _axis(axis: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise ValueError(
            f"Expected axis to be an int (the classes' axis, Keras' default -1); found "
            f"{axis!r}. Fix: e.g. axis=-1."
        )
    return int(axis)


class _Smoothed(Loss):
    """A crossentropy of Keras' `(from_logits, label_smoothing, axis)` arguments."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        *,
        reduction: str = "sum_over_batch_size",
        name: str | None = None,
    ) -> None:
        super().__init__(from_logits, reduction=reduction, name=name)
        self.label_smoothing = _smoothing(label_smoothing)
        self.axis = _axis(axis)


class CategoricalCrossentropy(_Smoothed):
    """One-hot (or soft) labels `(batch, classes)` against scores `(batch, classes)`.

    As Keras: `label_smoothing` mixes the labels with the uniform `1 / classes`, and `axis`
    is the classes' axis.
    """

    name = "categorical_crossentropy"

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        if self.axis not in (-1, y_pred.ndim - 1):  # the classes last, as below
            y_true = jnp.moveaxis(y_true, self.axis, -1)
            y_pred = jnp.moveaxis(y_pred, self.axis, -1)
        if y_true.shape != y_pred.shape:
            raise _shape_error(
                self.name,
                f"one-hot labels of shape {tuple(y_pred.shape)}",
                y_true,
                y_pred,
                "one-hot encode the labels, or use 'sparse_categorical_crossentropy' for "
                "class indices.",
            )
        y_true = y_true.astype(y_pred.dtype)
        if self.label_smoothing:
            classes = y_true.shape[-1]
            y_true = y_true * (1.0 - self.label_smoothing) + self.label_smoothing / classes
        if self.from_logits:
            return per_example(optax.softmax_cross_entropy(y_pred, y_true))
        return per_example(-jnp.sum(y_true * _log_probabilities(y_pred), axis=-1))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(from_logits={self.from_logits}, "
            f"label_smoothing={self.label_smoothing}, axis={self.axis})"
        )


def _log_probabilities(y_pred: Any) -> jax.Array:
    """Keras' rule for probabilities: each row divided by its sum, then clipped to
    [epsilon, 1 - epsilon], then the log (keras/src/backend/jax/nn.py)."""
    probs = y_pred / jnp.sum(y_pred, axis=-1, keepdims=True)
    return jnp.log(jnp.clip(probs, _EPSILON, 1.0 - _EPSILON))


def _same_shape(name: str, y_true: Any, y_pred: Any) -> jax.Array:
    if y_true.shape != y_pred.shape and y_pred.shape[-1:] == (1,):
        y_true = y_true.reshape(y_pred.shape)
    if y_true.shape != y_pred.shape:
        raise _shape_error(
            name,
            f"labels of the predictions' shape {tuple(y_pred.shape)}",
            y_true,
            y_pred,
            "make the model's output match the labels (e.g. one output unit per target).",
        )
    return y_true.astype(y_pred.dtype)


class BinaryCrossentropy(_Smoothed):
    """0/1 labels against one probability (or logit) per target.

    As Keras: `label_smoothing` moves the labels towards 0.5 (`y * (1 - s) + s / 2`); the
    mean over `axis` then over the example's other axes is the mean over all of them.
    """

    name = "binary_crossentropy"

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        y_true = _same_shape(self.name, y_true, y_pred)
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            return per_example(optax.sigmoid_binary_cross_entropy(y_pred, y_true))
        p = jnp.clip(y_pred, _EPSILON, 1 - _EPSILON)
        return per_example(-(y_true * jnp.log(p) + (1 - y_true) * jnp.log(1 - p)))


class MeanSquaredError(Loss):
    name = "mse"

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        return per_example((_same_shape(self.name, y_true, y_pred) - y_pred) ** 2)


class MeanAbsoluteError(Loss):
    name = "mae"

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        return per_example(jnp.abs(_same_shape(self.name, y_true, y_pred) - y_pred))


def _is_binary(y_true: Any, y_pred: Any) -> bool:
    return tuple(y_pred.shape[-1:]) == (1,)


def _is_sparse(y_true: Any, y_pred: Any) -> bool:
    return y_true.ndim < y_pred.ndim or (tuple(y_true.shape[-1:]) == (1,) and y_pred.shape[-1] > 1)


class Crossentropy(Loss):
    """Keras' `"crossentropy"` / `"ce"`: binary, sparse or categorical by the shapes.

    keras/src/trainers/compile_utils.py (get_loss): one output unit is binary; labels of
    lower rank, or one label column against several outputs, are sparse; else categorical.
    """

    name = "crossentropy"

    def __call__(self, y_true: Any, y_pred: Any) -> jax.Array:
        kind: type[Loss] = CategoricalCrossentropy
        if _is_binary(y_true, y_pred):
            kind = BinaryCrossentropy
        elif _is_sparse(y_true, y_pred):
            kind = SparseCategoricalCrossentropy
        return kind(from_logits=self.from_logits)(y_true, y_pred)


_LOSSES: dict[str, type[Loss]] = {
    "crossentropy": Crossentropy,
    "ce": Crossentropy,
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
}


def get_loss(spec: str | Loss | Callable[[Any, Any], Any], *, from_logits: bool = False) -> Any:
    """A per-example loss from a Keras name, a `Loss`, or a callable `(y_true, y_pred)`."""
    if isinstance(spec, str):
        keras_loss = None if spec in _LOSSES else _keras.named("losses", spec)
        if keras_loss is not None:  # Keras' function of that name ("huber"), per example
            return keras_loss
        if spec not in _LOSSES:
            raise ValueError(
                f"Expected a loss name from {sorted(_LOSSES)}; found {spec!r}. Fix: use one of "
                "those, a mirrored.losses.Loss, or a callable (y_true, y_pred) -> per-example "
                "losses."
            )
        return _LOSSES[spec](from_logits=from_logits)
    if _keras.is_keras_loss(spec):  # weighted and reduced as Keras does
        return _keras.KerasLoss(spec)
    if callable(spec):
        return spec
    raise TypeError(
        f"Expected loss to be a name, a mirrored.losses.Loss or a callable; found {spec!r}. "
        "Fix: e.g. loss='sparse_categorical_crossentropy', or a function (y_true, y_pred) -> "
        "one value per example."
    )


class Metric:
    """A metric averaged over examples: `values(y_true, y_pred)` → one value per example."""

    def __init__(
        self,
        name: str,
        values: Callable[[Any, Any], jax.Array],
        direction: str | None = None,
        *,
        named: bool = False,
    ) -> None:
        self.name = name
        self.values = values
        self.direction = direction  # "up", "down" or None (unknown): as `metrics.Metric`'s
        self.named = named  # one of Keras' names: takes one output array

    def __repr__(self) -> str:
        return f"Metric({self.name!r})"


def _sparse_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    return per_example(_metrics.sparse_categorical_accuracy(y_true, y_pred))


def _categorical_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    return per_example(_metrics.categorical_accuracy(y_true, y_pred))


def _binary_accuracy(threshold: float) -> Callable[[Any, Any], jax.Array]:
    def binary_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
        return per_example(_metrics.binary_accuracy(y_true, y_pred, threshold))

    return binary_accuracy


def _shape_resolved_accuracy(threshold: float) -> Callable[[Any, Any], jax.Array]:
    """Keras' "accuracy": binary, sparse or categorical by the shapes of labels and outputs.

    keras/src/trainers/compile_utils.py (is_binary_or_sparse_categorical): one output unit is
    binary; labels of lower rank, or one label column against several outputs, are sparse;
    otherwise categorical. Decided when the step is traced, from static shapes.

    Differs from Keras: with a `from_logits=True` loss the binary threshold is 0 (a logit of
    0 is probability 0.5); Keras keeps 0.5, which silently miscounts logits.
    """
    binary = _binary_accuracy(threshold)

    def accuracy(y_true: Any, y_pred: Any) -> jax.Array:
        if _is_binary(y_true, y_pred):
            return binary(y_true, y_pred)
        if _is_sparse(y_true, y_pred):
            return _sparse_accuracy(y_true, y_pred)
        if tuple(y_true.shape) != tuple(y_pred.shape):
            raise _shape_error(
                "accuracy",
                f"one-hot labels of shape {tuple(y_pred.shape)} (categorical accuracy), "
                "integer labels of shape "
                f"{tuple(y_pred.shape[:-1])} (sparse), or one output unit (binary)",
                y_true,
                y_pred,
                "give labels and outputs shapes Keras can pair, as listed.",
            )
        return _categorical_accuracy(y_true, y_pred)

    return accuracy


_STATEFUL: dict[str, Callable[[], _confusion._Confusion]] = {
    "precision": _confusion.Precision,
    "recall": _confusion.Recall,
    "auc": _confusion.AUC,
}


def get_metric(spec: Any, loss: Any) -> Metric | _metrics.Metric:
    """A metric from a Keras name (\"accuracy\" follows the shapes, as in Keras) or a callable."""
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, _metrics.MeanMetricWrapper):  # a mean over examples: exact running sums
        return Metric(spec.name, functools.partial(spec._fn, **spec._fn_kwargs), spec.direction)
    if isinstance(spec, _metrics.Metric):  # Precision, AUC, a subclass: its own state
        return spec
    if _keras.is_keras_metric(spec):
        if _keras.is_plain_mean_wrapper(spec):  # Keras' MeanMetricWrapper: per example
            values = functools.partial(spec._fn, **spec._fn_kwargs)
            return Metric(spec.name, values, getattr(spec, "_direction", None))
        return _keras.KerasMetric(spec)  # AUC, F1Score, MeanIoU...: Keras' state, summed
    from_logits = getattr(loss, "from_logits", False)
    if isinstance(spec, str) and spec.lower() in _STATEFUL:  # Keras takes "AUC" too
        spec = spec.lower()
    if spec in _STATEFUL:
        # As "accuracy": with a from_logits=True loss the outputs are logits, so the names
        # score their sigmoid (Keras would threshold or bucket the logits themselves).
        metric = _STATEFUL[spec]()
        metric.from_logits = from_logits
        return metric
    if isinstance(spec, str):
        if spec in ("accuracy", "acc"):
            accuracy = _shape_resolved_accuracy(0.0 if from_logits else 0.5)
            return Metric(spec, accuracy, "up", named=True)
        named: dict[str, Callable[[Any, Any], jax.Array]] = {
            "sparse_categorical_accuracy": _sparse_accuracy,
            "categorical_accuracy": _categorical_accuracy,
            "binary_accuracy": _binary_accuracy(0.5),
            "sparse_top_k_categorical_accuracy": _metrics.sparse_top_k_categorical_accuracy,
            "mse": MeanSquaredError(),
            "mae": MeanAbsoluteError(),
            "mean_squared_error": MeanSquaredError(),
            "mean_absolute_error": MeanAbsoluteError(),
        }
        keras_metric = None if spec in named else _keras.named("metrics", spec)
        if keras_metric is not None:  # Keras' metric of that name ("r2_score"), so named
            keras_metric.name = spec
            return get_metric(keras_metric, loss)
        if spec not in named:
            raise ValueError(
                f"Expected a metric name from {sorted(['accuracy', *named, *_STATEFUL])}; "
                f"found {spec!r}. "
                "Fix: use one of those, or a callable (y_true, y_pred) -> per-example values."
            )
        return Metric(spec, named[spec], "up" if "accuracy" in spec else "down", named=True)
    if callable(spec):
        return Metric(getattr(spec, "__name__", "metric"), spec, getattr(spec, "direction", None))
    raise TypeError(f"Expected a metric name, a Metric or a callable; found {spec!r}.")


# -- pitfalls Keras leaves silent -----------------------------------------------------------------

CROSSENTROPIES = (
    SparseCategoricalCrossentropy,
    CategoricalCrossentropy,
    BinaryCrossentropy,
    Crossentropy,
)


_KERAS_CROSSENTROPIES = (
    "SparseCategoricalCrossentropy",
    "CategoricalCrossentropy",
    "BinaryCrossentropy",
)


def is_crossentropy(loss: Any) -> bool:
    """Whether `loss` is a crossentropy of Keras' names or classes (its labels and outputs
    are checked on the first batch)."""
    if isinstance(loss, _keras.KerasLoss):
        return loss.kind in _KERAS_CROSSENTROPIES
    return isinstance(loss, CROSSENTROPIES)


def _sparse_loss(loss: Any, y_true: np.ndarray, y_pred_shape: tuple[int, ...]) -> bool:
    if isinstance(loss, SparseCategoricalCrossentropy):
        return True
    if isinstance(loss, _keras.KerasLoss):  # labels outside the classes may be ignore_class
        return loss.kind == "SparseCategoricalCrossentropy" and not loss.masks
    if isinstance(loss, Crossentropy):  # Keras' shape rule, on the shapes alone
        y_pred = jax.ShapeDtypeStruct(y_pred_shape, np.float32)
        return not _is_binary(y_true, y_pred) and _is_sparse(y_true, y_pred)
    return False


def check_labels(loss: Any, y_true: Any, y_pred_shape: tuple[int, ...]) -> None:
    """Sparse labels must be class indices in [0, classes): optax would silently misread them."""
    y_true = np.asarray(y_true)
    sparse_shape = y_true.shape[1:] in (tuple(y_pred_shape[1:-1]), (*y_pred_shape[1:-1], 1))
    if (
        not _sparse_loss(loss, y_true, y_pred_shape)
        or y_true.size == 0
        or not sparse_shape
        or not np.issubdtype(y_true.dtype, np.number)
    ):
        return
    if not np.issubdtype(y_true.dtype, np.integer) and not np.all(y_true == np.round(y_true)):
        bad = y_true[y_true != np.round(y_true)].flat[0].item()
        raise ValueError(
            f"{loss.name} expected class indices (Keras casts float labels to int); found the "
            f"label {bad!r} ({y_true.dtype}), which is no class. Fix: pass the class of each "
            "example (0..classes-1), or use a regression loss ('mse') for such targets."
        )
    ignored = getattr(loss, "ignore_class", None)
    if ignored is not None:  # those labels count for nothing, whatever their value
        y_true = y_true[y_true != ignored]
        if y_true.size == 0:
            return
    classes = y_pred_shape[-1]
    low, high = y_true.min(), y_true.max()
    if low < 0 or high >= classes:
        bad = (low if low < 0 else high).item()
        raise ValueError(
            f"{loss.name} expected class labels in [0, {classes}) for a model with "
            f"{classes} outputs; found label {bad!r} ({y_true.dtype}). Fix: give the model one "
            "output per class (the largest label + 1), or remap the labels to 0..classes-1."
        )


def logits_warning(loss: Any, y_pred: Any) -> str | None:
    """Why `y_pred` looks like logits given to a loss that expects probabilities, or None.

    Keras' `from_logits=False` default silently clips logits into (0, 1) and trains badly.
    """
    if not is_crossentropy(loss) or loss.from_logits:
        return None
    binary = isinstance(loss, BinaryCrossentropy) or getattr(loss, "kind", "").startswith("Binary")
    y_pred = np.asarray(y_pred, np.float64)
    if y_pred.size == 0:
        return None
    problem = None
    if y_pred.min() < 0 or y_pred.max() > 1:
        problem = f"values from {y_pred.min():.3g} to {y_pred.max():.3g}, outside [0, 1]"
    elif y_pred.shape[-1] > 1 and not binary:
        sums = y_pred.sum(axis=-1)
        if np.abs(sums - 1).max() > 1e-3:
            problem = f"rows summing to {sums.min():.3g}..{sums.max():.3g}, not 1"
    if problem is None:
        return None
    return from_logits_warning(
        loss.name, f"the model's outputs on the first batch have {problem}: they look like logits"
    )


def from_logits_warning(loss_name: str, evidence: str) -> str:
    """Keras' silent trap, said once for `Trainer` and Keras' `fit`: `evidence` that the model
    outputs logits, given to a loss that expects probabilities."""
    return (
        f"{loss_name} has from_logits=False (Keras' default), which expects probabilities, but "
        f"{evidence}, which the loss clips into (0, 1) and trains badly on (TensorFlow's Keras "
        "does the same, silently). Fix: pass from_logits=True to the loss, or end the model "
        "with a softmax / sigmoid."
    )
