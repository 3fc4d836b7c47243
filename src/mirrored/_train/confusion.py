"""Keras' confusion-matrix metrics (`Precision`, `Recall`, `AUC`: true/false positives and
negatives per threshold, summed over replicas) and the table of Keras' metric names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrored._train.metrics import (
    _EPSILON,
    BinaryAccuracy,
    CategoricalAccuracy,
    MeanAbsoluteError,
    MeanSquaredError,
    Metric,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    _div_no_nan,
    _labels_like,
    _snake,
    check_rows,
)

_NEG_INF = -1e10  # Keras' metrics_utils.NEG_INF: the threshold that counts every prediction


# -- confusion-matrix metrics ---------------------------------------------------------------------


class _Confusion(Metric):
    """True/false positives/negatives at each threshold, from predictions in [0, 1]."""

    direction = "up"

    from_logits = False  # the Trainer's "precision"/"recall" under a from_logits=True loss

    top_k: int | None = None  # Keras' top_k and class_id (Precision, Recall)
    class_id: int | None = None

    def __init__(self, thresholds: Sequence[float], name: str | None, dtype: Any) -> None:
        super().__init__(name, dtype)
        self.thresholds = tuple(float(t) for t in thresholds)  # static, not state
        shape = (len(self.thresholds),)
        self.true_positives = self.add_variable(shape)
        self.false_positives = self.add_variable(shape)
        self.true_negatives = self.add_variable(shape)
        self.false_negatives = self.add_variable(shape)

    def _predictions(self, y_pred: Any) -> Any:
        y_pred = jnp.asarray(y_pred, jnp.float32)
        return jax.nn.sigmoid(y_pred) if self.from_logits else y_pred

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        check_rows(type(self).__name__, y_true=y_true, y_pred=y_pred, sample_weight=sample_weight)
        y_pred = self._predictions(y_pred)
        y_true = jnp.broadcast_to(_labels_like(y_true, y_pred), y_pred.shape)
        if self.top_k is not None:  # Keras' _filter_top_k: the others at NEG_INF
            _, top = jax.lax.top_k(y_pred, self.top_k)
            kept = jnp.sum(jax.nn.one_hot(top, y_pred.shape[-1], dtype=y_pred.dtype), axis=-2)
            y_pred = y_pred * kept + _NEG_INF * (1 - kept)
        if self.class_id is not None:  # one class's column, its weights per row
            if y_pred.ndim < 2:
                raise ValueError(
                    f"{type(self).__name__}(class_id={self.class_id}) expected predictions of "
                    f"shape (examples, classes); found {tuple(y_pred.shape)}. Fix: drop "
                    "class_id for one output per example."
                )
            y_true = y_true[..., self.class_id, None]
            y_pred = y_pred[..., self.class_id, None]
        weight = self.weights(y_pred, sample_weight).reshape(-1)
        positive = y_true.reshape(-1).astype(bool)
        above = y_pred.reshape(-1)[None, :] > jnp.asarray(self.thresholds, jnp.float32)[:, None]
        w = weight[None, :]
        add = [
            (self.true_positives, above & positive),
            (self.false_positives, above & ~positive),
            (self.true_negatives, ~above & ~positive),
            (self.false_negatives, ~above & positive),
        ]
        for state, hit in add:
            state[...] = state[...] + jnp.sum(jnp.where(hit, w, 0.0), axis=1).astype(self.dtype)


def _check_thresholds(thresholds: Any, metric: str) -> list[float]:
    values = np.atleast_1d(np.asarray(thresholds, dtype=np.float64)).tolist()
    if np.ndim(thresholds) > 1 or any(not 0.0 <= t <= 1.0 for t in values):
        raise ValueError(
            f"Expected {metric}'s thresholds in [0, 1] (a number or a list); found "
            f"{thresholds!r}. Fix: e.g. thresholds=0.5 or [0.3, 0.5, 0.7] (Keras' rule); for "
            "logits, a from_logits=True loss makes the Trainer score their sigmoid."
        )
    return values


def _check_index(value: Any, what: str, metric: str, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(
            f"Expected {metric}'s {what} to be an int >= {low} (or None); found {value!r}. "
            f"Fix: e.g. {what}={max(low, 1)}."
        )
    return int(value)


class _AtThresholds(_Confusion):
    """A confusion ratio at `thresholds` (Keras' default 0.5; with `top_k`, every prediction
    in the top k): a scalar for one threshold given as a number or by default, one value per
    threshold for a list. `class_id` scores one class's column."""

    def __init__(
        self,
        thresholds: float | Sequence[float] | None = None,
        top_k: int | None = None,
        class_id: int | None = None,
        name: str | None = None,
        dtype: Any = None,
    ) -> None:
        metric = type(self).__name__
        self._scalar = thresholds is None or np.ndim(thresholds) == 0
        if thresholds is None:
            values = [0.5 if top_k is None else _NEG_INF]
        else:
            values = _check_thresholds(thresholds, metric)
        super().__init__(values, name or _snake(metric), dtype or jnp.float32)
        self.top_k = _check_index(top_k, "top_k", metric, 1)
        self.class_id = _check_index(class_id, "class_id", metric, 0)

    def _ratio(self, hits: jax.Array, misses: jax.Array) -> jax.Array:
        out = _div_no_nan(hits, hits + misses)
        return out[0] if self._scalar else out


class Precision(_AtThresholds):
    """`TP / (TP + FP)` of `y_pred > threshold` (Keras' default threshold 0.5); Keras'
    arguments in Keras' order."""

    def result(self) -> jax.Array:
        return self._ratio(self.true_positives[...], self.false_positives[...])


class Recall(_AtThresholds):
    """`TP / (TP + FN)` of `y_pred > threshold` (Keras' default threshold 0.5); Keras'
    arguments in Keras' order."""

    def result(self) -> jax.Array:
        return self._ratio(self.true_positives[...], self.false_negatives[...])


class AUC(_Confusion):
    """Area under the ROC (or PR) curve over `num_thresholds` thresholds: Keras' `metrics.AUC`.

    Keras' defaults: 200 thresholds evenly spaced in (0, 1) plus the endpoints -1e-7 and
    1 + 1e-7, `curve="ROC"`, `summation_method="interpolation"`; `from_logits=True` applies a
    sigmoid first. An approximation of the exact AUC that improves with `num_thresholds`.
    """

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = "auc",
        dtype: Any = None,
        thresholds: Sequence[float] | None = None,
        multi_label: bool = False,
        num_labels: int | None = None,
        label_weights: Any = None,
        from_logits: bool = False,
    ) -> None:
        if multi_label or label_weights is not None:
            raise ValueError(
                f"Expected mirrored.metrics.AUC without multi_label or label_weights (one "
                f"curve over all the outputs); found multi_label={multi_label!r}, "
                f"label_weights={label_weights!r}. Fix: pass keras.metrics.AUC("
                "multi_label=True, ...) to the Trainer, which keeps Keras' state mirrored, or "
                "one mirrored AUC per label."
            )
        del num_labels  # Keras uses it only with multi_label
        if thresholds is not None:  # Keras: the given ones between the two endpoints
            inner = _check_thresholds(thresholds, "AUC")
            num_thresholds = len(inner) + 2
        elif (
            isinstance(num_thresholds, bool)
            or not isinstance(num_thresholds, int | np.integer)
            or num_thresholds <= 1
        ):
            raise ValueError(
                f"Expected num_thresholds to be an int > 1; found {num_thresholds!r}. Fix: "
                "e.g. num_thresholds=200 (Keras' default)."
            )
        curve, summation_method = curve.upper(), summation_method.lower()
        if curve not in ("ROC", "PR") or summation_method not in (
            "interpolation",
            "minoring",
            "majoring",
        ):
            raise ValueError(
                f"Expected curve 'ROC' or 'PR' and summation_method 'interpolation', "
                f"'minoring' or 'majoring'; found {curve!r}, {summation_method!r}. Fix: use "
                "one of those (Keras' names)."
            )
        num_thresholds = int(num_thresholds)
        if thresholds is None:
            inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        super().__init__([-_EPSILON, *inner, 1.0 + _EPSILON], name or "auc", dtype or jnp.float32)
        self.num_thresholds = num_thresholds
        self.curve = curve
        self.summation_method = summation_method
        self.from_logits = from_logits

    def _predictions(self, y_pred: Any) -> Any:
        # Keras clips into [0, 1] for evenly spaced thresholds (AUC's): a score above 1 counts
        # as 1, not as above the last threshold.
        return jnp.clip(super()._predictions(y_pred), 0.0, 1.0)

    def result(self) -> jax.Array:
        tp, fp = self.true_positives[...], self.false_positives[...]
        tn, fn = self.true_negatives[...], self.false_negatives[...]
        if self.curve == "PR" and self.summation_method == "interpolation":
            return self._interpolate_pr(tp, fp, fn)
        recall = _div_no_nan(tp, tp + fn)
        if self.curve == "ROC":
            x, y = _div_no_nan(fp, fp + tn), recall
        else:
            x, y = recall, _div_no_nan(tp, tp + fp)
        if self.summation_method == "interpolation":
            heights = (y[:-1] + y[1:]) / 2.0
        elif self.summation_method == "minoring":
            heights = jnp.minimum(y[:-1], y[1:])
        else:
            heights = jnp.maximum(y[:-1], y[1:])
        return jnp.sum((x[:-1] - x[1:]) * heights)

    @staticmethod
    def _interpolate_pr(tp: Any, fp: Any, fn: Any) -> jax.Array:
        """Keras' closed form of Davis & Goadrich's interpolated PR area."""
        dtp = tp[:-1] - tp[1:]
        p = tp + fp
        dp = p[:-1] - p[1:]
        slope = _div_no_nan(dtp, jnp.maximum(dp, 0))
        intercept = tp[1:] - slope * p[1:]
        ratio = jnp.where(
            (p[:-1] > 0) & (p[1:] > 0), _div_no_nan(p[:-1], jnp.maximum(p[1:], 0)), 1.0
        )
        return jnp.sum(
            _div_no_nan(slope * (dtp + intercept * jnp.log(ratio)), jnp.maximum(tp[1:] + fn[1:], 0))
        )


# -- Keras' names ---------------------------------------------------------------------------------

_NAMED: dict[str, Callable[[], Metric]] = {
    "mean_squared_error": MeanSquaredError,
    "mse": lambda: MeanSquaredError(name="mse"),
    "mean_absolute_error": MeanAbsoluteError,
    "mae": lambda: MeanAbsoluteError(name="mae"),
    "binary_accuracy": BinaryAccuracy,
    "categorical_accuracy": CategoricalAccuracy,
    "sparse_categorical_accuracy": SparseCategoricalAccuracy,
    "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
    "precision": Precision,
    "recall": Recall,
    "auc": AUC,
}


def get(name: str) -> Metric:
    """A metric from its Keras string name (`"accuracy"` needs the loss: use the Trainer)."""
    if name not in _NAMED:
        raise ValueError(
            f"Expected a metric name from {sorted(_NAMED)}; found {name!r}. Fix: use one of "
            "those, or a mirrored.metrics.Metric instance."
        )
    return _NAMED[name]()
