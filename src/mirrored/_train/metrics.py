"""The Keras-named metrics behind `mirrored.metrics` (whose docstring is the user's guide): sums
that every replica adds its real rows to, combined on read."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrored._nnx.metrics import MetricState, row_mask, warn_if_a_loss_share

logger = logging.getLogger("mirrored.metrics")

_EPSILON = 1e-7  # Keras' backend.epsilon()


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower().replace("a_u_c", "auc")


def _div_no_nan(a: Any, b: Any) -> Any:
    safe = jnp.where(b == 0, 1, b)
    return jnp.where(b == 0, 0, a / safe)


def _squeeze_or_expand(values: Any, weights: Any) -> tuple[Any, Any]:
    """Keras' `squeeze_or_expand_to_same_rank` for weights against values."""
    if weights.ndim == 0:
        return values, weights
    if weights.ndim == values.ndim + 1 and weights.shape[-1] == 1:
        weights = weights[..., 0]
    while weights.ndim < values.ndim:
        weights = weights[..., None]
    if values.ndim == weights.ndim - 1:
        values = values[..., None]
    return values, weights


def check_rows(metric: str, **arrays: Any) -> None:
    """The arrays given to `metric.update_state` have one batch (leading) size; a scalar
    `sample_weight` weighs every row. Else broadcasting would fail naming neither argument."""
    sizes = {
        name: tuple(np.shape(value))
        for name, value in arrays.items()
        if value is not None and np.ndim(value) > 0
    }
    if len({shape[0] for shape in sizes.values()}) > 1:
        found = ", ".join(f"{name} of shape {shape}" for name, shape in sizes.items())
        raise ValueError(
            f"Expected {metric}.update_state's arguments to have one batch size (their first "
            f"axis); found {found}. Fix: pass the same examples' labels, predictions and "
            "weights (one row each per example)."
        )


class Metric(nnx.Module):
    """Base of the metrics: Keras' `update_state`, `result`, `reset_state` and `name`."""

    # Whether a better model makes it rise ("up") or fall ("down"), as Keras' `_direction`:
    # callbacks' mode="auto" follows it. None: not known (say so in a metric of your own).
    direction: str | None = None

    def __init__(self, name: str | None = None, dtype: Any = jnp.float32) -> None:
        self.name = name or _snake(type(self).__name__)
        self.dtype = jnp.dtype(dtype)

    def add_variable(self, shape: Sequence[int] = (), dtype: Any = None) -> MetricState:
        """A running sum of `shape`, zero; mirrored when created inside `strategy.scope()`."""
        return MetricState(jnp.zeros(tuple(shape), dtype or self.dtype))

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"Expected {type(self).__name__} to define update_state(...); it does not. Fix: "
            "add to its MetricState sums there."
        )

    def result(self) -> jax.Array:
        raise NotImplementedError(
            f"Expected {type(self).__name__} to define result(); it does not. Fix: compute "
            "it from its MetricState sums."
        )

    def reset_state(self) -> None:
        """Every running sum back to zero (placement kept: still mirrored)."""
        for _, state in nnx.iter_graph(self):
            if isinstance(state, MetricState):
                state[...] = jnp.zeros_like(state[...])

    def reset_states(self) -> None:
        """Keras 2's name of `reset_state` (TensorFlow's tutorials still call it)."""
        self.reset_state()

    def weights(self, values: Any, sample_weight: Any = None) -> Any:
        """Per-row weights for `values` (batch first): `sample_weight` times the real-row mask.

        Padded rows of a ragged batch get weight 0; without `sample_weight` real rows get 1.
        Returns values' shape broadcast, in the metric's dtype.
        """
        values = jnp.asarray(values)
        weight = jnp.ones(values.shape, self.dtype)
        if sample_weight is not None:
            values, w = _squeeze_or_expand(values, jnp.asarray(sample_weight, self.dtype))
            weight = jnp.broadcast_to(w, values.shape).astype(self.dtype)
        mask = row_mask(values)
        if mask is not None:
            weight = weight * mask.reshape(mask.shape + (1,) * (weight.ndim - 1))
        return weight

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        """`update_state(...)` then `result()`, as a Keras metric called directly."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


# -- reductions -----------------------------------------------------------------------------------


class Sum(Metric):
    """The (weighted) sum of the values seen: Keras' `metrics.Sum`."""

    def __init__(self, name: str = "sum", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)
        self.total = self.add_variable()

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        values = jnp.asarray(values, self.dtype)
        self.total[...] = self.total[...] + jnp.sum(values * self.weights(values, sample_weight))

    def result(self) -> jax.Array:
        return self.total[...]


class Mean(Metric):
    """The (weighted) mean of the values seen: Keras' `metrics.Mean`.

    A value per example (batch first) counts once per example, each row averaged over its
    other axes; a scalar (a per-replica loss) counts once.
    """

    def __init__(self, name: str = "mean", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)
        self.total = self.add_variable()
        self.count = self.add_variable()

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        check_rows(type(self).__name__, values=values, sample_weight=sample_weight)
        values = jnp.asarray(values, self.dtype)
        if values.ndim == 0 and sample_weight is None:  # one value: counts once
            warn_if_a_loss_share(f"{type(self).__name__}({self.name!r})", values)
            self.total[...] = self.total[...] + values
            self.count[...] = self.count[...] + 1
            return
        if sample_weight is None:
            weight = jnp.ones(values.shape[:1], self.dtype)
        else:  # Keras' reduce_to_samplewise_values: values to the weights' rank, then per row
            values, weight = _squeeze_or_expand(values, jnp.asarray(sample_weight, self.dtype))
            if weight.ndim and values.ndim > weight.ndim:
                values = values.mean(axis=tuple(range(weight.ndim, values.ndim)))
            weight = jnp.broadcast_to(weight, values.shape)
        mask = row_mask(values)
        if mask is not None:
            weight = weight * mask.reshape(mask.shape + (1,) * (weight.ndim - 1))
        values = values * weight.reshape(weight.shape + (1,) * (values.ndim - weight.ndim))
        rows = values.reshape(values.shape[0], -1).mean(axis=1) if values.ndim > 1 else values
        counts = weight.reshape(weight.shape[0], -1).mean(axis=1) if weight.ndim > 1 else weight
        self.total[...] = self.total[...] + jnp.sum(rows)
        self.count[...] = self.count[...] + jnp.sum(counts)

    def result(self) -> jax.Array:
        return _div_no_nan(self.total[...], self.count[...])


class MeanMetricWrapper(Mean):
    """The mean over examples of `fn(y_true, y_pred)`: Keras' `MeanMetricWrapper`."""

    def __init__(
        self,
        fn: Callable[[Any, Any], Any],
        name: str | None = None,
        dtype: Any = jnp.float32,
        **kwargs: Any,
    ) -> None:
        super().__init__(name or str(getattr(fn, "__name__", "mean_metric")), dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def values(self, y_true: Any, y_pred: Any) -> jax.Array:
        """One value per example (batch first), before weighting."""
        return jnp.asarray(self._fn(y_true, y_pred, **self._fn_kwargs))

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        check_rows(type(self).__name__, y_true=y_true, y_pred=y_pred, sample_weight=sample_weight)
        super().update_state(self.values(y_true, y_pred), sample_weight)


# -- accuracies and errors (Keras' metric functions) ----------------------------------------------


def _labels_like(y_true: Any, y_pred: Any) -> Any:
    """(B, 1) labels for (B,) predictions and the reverse, as Keras squeezes them."""
    y_true = jnp.asarray(y_true)
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        return y_true[..., 0]
    if y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        return y_true[..., None]
    return y_true


def accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    y_pred = jnp.asarray(y_pred)
    return (_labels_like(y_true, y_pred) == y_pred).astype(jnp.float32)


def binary_accuracy(y_true: Any, y_pred: Any, threshold: float = 0.5) -> jax.Array:
    y_pred = jnp.asarray(y_pred)
    y_true = _labels_like(y_true, y_pred)
    return ((y_pred > threshold).astype(y_true.dtype) == y_true).astype(jnp.float32)


def categorical_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    return (jnp.argmax(y_true, -1) == jnp.argmax(y_pred, -1)).astype(jnp.float32)


def sparse_categorical_accuracy(y_true: Any, y_pred: Any) -> jax.Array:
    y_true = jnp.asarray(y_true)
    y_pred = jnp.asarray(y_pred)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true[..., 0]
    return (jnp.argmax(y_pred, -1) == y_true.astype(jnp.int32)).astype(jnp.float32)


def sparse_top_k_categorical_accuracy(y_true: Any, y_pred: Any, k: int = 5) -> jax.Array:
    y_true = jnp.asarray(y_true)
    y_pred = jnp.asarray(y_pred)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = y_true[..., 0]
    # Keras' `in_top_k`: the label's rank counts only strictly higher scores, so a tie at the
    # k-th score is in the top k (`lax.top_k` would break the tie by position); a NaN score at
    # the label ranks last.
    at_label = jnp.take_along_axis(y_pred, y_true.astype(jnp.int32)[..., None], axis=-1)
    at_label = jnp.where(jnp.isnan(at_label), -jnp.inf, at_label)
    rank = 1 + jnp.sum(y_pred > at_label, axis=-1)
    return (rank <= k).astype(jnp.float32)


def mean_squared_error(y_true: Any, y_pred: Any) -> jax.Array:
    y_pred = jnp.asarray(y_pred, jnp.float32)
    return jnp.mean(jnp.square(y_pred - _labels_like(y_true, y_pred)), axis=-1)


def mean_absolute_error(y_true: Any, y_pred: Any) -> jax.Array:
    y_pred = jnp.asarray(y_pred, jnp.float32)
    return jnp.mean(jnp.abs(y_pred - _labels_like(y_true, y_pred)), axis=-1)


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels: Keras' `metrics.Accuracy`."""

    direction = "up"

    def __init__(self, name: str = "accuracy", dtype: Any = jnp.float32) -> None:
        super().__init__(accuracy, name, dtype)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` equals binary labels: Keras' `metrics.BinaryAccuracy`."""

    direction = "up"

    def __init__(
        self, name: str = "binary_accuracy", dtype: Any = jnp.float32, threshold: float = 0.5
    ) -> None:
        super().__init__(binary_accuracy, name, dtype, threshold=threshold)
        self.threshold = threshold


class CategoricalAccuracy(MeanMetricWrapper):
    """Argmax of one-hot labels against argmax of predictions."""

    direction = "up"

    def __init__(self, name: str = "categorical_accuracy", dtype: Any = jnp.float32) -> None:
        super().__init__(categorical_accuracy, name, dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """Integer labels against argmax of predictions."""

    direction = "up"

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype: Any = jnp.float32) -> None:
        super().__init__(sparse_categorical_accuracy, name, dtype)


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the `k` highest predictions (Keras' k=5)."""

    direction = "up"

    def __init__(
        self,
        k: int = 5,
        name: str = "sparse_top_k_categorical_accuracy",
        dtype: Any = jnp.float32,
    ) -> None:
        super().__init__(sparse_top_k_categorical_accuracy, name, dtype, k=k)
        self.k = k


class MeanSquaredError(MeanMetricWrapper):
    """Mean over examples of the mean squared error over the last axis."""

    direction = "down"

    def __init__(self, name: str = "mean_squared_error", dtype: Any = jnp.float32) -> None:
        super().__init__(mean_squared_error, name, dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean over examples of the mean absolute error over the last axis."""

    direction = "down"

    def __init__(self, name: str = "mean_absolute_error", dtype: Any = jnp.float32) -> None:
        super().__init__(mean_absolute_error, name, dtype)
