"""Keras loss and metric objects given to the Trainer (`loss=keras.losses.Huber()`,
`metrics=[keras.metrics.AUC()]`), with the numbers Keras gives on one device.

Nothing here imports Keras unless such an object was given (then Keras is imported already).
A loss object is called as Keras calls it, with the sample weights, through mirrored's Keras
adapter (each replica's share of the global batch's loss). A metric object keeps Keras' state
as mirrored running sums that every replica adds its real rows to (Keras' stateless API), or,
for a `MeanMetricWrapper` (the accuracies, `PearsonCorrelation`), is its function per example.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mirrored._core import context as _context
from mirrored._core.global_rows import split_context
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._train import metrics as _metrics


def is_keras(value: Any, base: str) -> bool:
    """Whether `value` is an instance of Keras' class `base` (`Loss`, `Metric`, `R2Score`),
    without importing Keras."""
    return any(
        cls.__name__ == base and cls.__module__.startswith("keras.") for cls in type(value).__mro__
    )


def named(kind: str, name: str) -> Any:
    """Keras' loss (a function) or metric (an object) of a name mirrored does not define
    (`"huber"`, `"r2_score"`), as `compile` resolves it; None without Keras on JAX or for a
    name Keras does not know either."""
    if importlib.util.find_spec("keras") is None or os.environ.get("KERAS_BACKEND") not in (
        None,
        "jax",
    ):
        return None
    import keras  # KERAS_BACKEND unset: `import mirrored` has made it "jax"

    try:
        return getattr(keras, kind).get(name)
    except (ValueError, TypeError):
        return None


def is_keras_loss(value: Any) -> bool:
    return is_keras(value, "Loss")


def is_keras_metric(value: Any) -> bool:
    return is_keras(value, "Metric")


def is_plain_mean_wrapper(metric: Any) -> bool:
    """Whether a Keras metric is a `MeanMetricWrapper` of a function, updated by Keras' own
    `update_state` (a subclass that overrides it is a stateful metric of its own)."""
    wrappers = [c for c in type(metric).__mro__ if c.__name__ == "MeanMetricWrapper"]
    return bool(wrappers) and type(metric).update_state is wrappers[0].__dict__["update_state"]


class KerasLoss:
    """A `keras.losses.Loss` object as the Trainer's loss: Keras' numbers, weights included.

    Called inside a step on a split batch, a Keras loss gives this replica's share of the
    global batch's loss (mirrored's Keras adapter, `mirrored.keras`): masks, `ignore_class`,
    every reduction and a `call` that reduces the batch itself included. Summed over the
    replicas, as the gradients of mirrored parameters are, it is Keras' loss on one device.
    """

    def __init__(self, loss: Any) -> None:
        if "mirrored.keras" not in sys.modules:  # Keras on another backend: no adapter
            raise ValueError(
                f"Expected a Keras loss of Keras' JAX backend; found {loss!r} while Keras "
                "runs on another backend, whose losses JAX cannot trace. Fix: set "
                "KERAS_BACKEND=jax before the first `import keras`, or use mirrored.losses."
            )
        if loss.reduction in (None, "none"):
            raise ValueError(
                f"Expected the loss {loss.name!r} to reduce each batch to one number, as "
                f"Keras' fit needs; found reduction={loss.reduction!r}. Fix: leave reduction "
                "at Keras' default 'sum_over_batch_size' (or 'sum' / 'mean_with_sample_weight')."
            )
        self.keras = loss
        self.name = loss.name
        kwargs = getattr(loss, "_fn_kwargs", {})
        self.from_logits = bool(getattr(loss, "from_logits", kwargs.get("from_logits", False)))
        self.kind = type(loss).__name__  # the logits warning and label checks read it
        self.masks = kwargs.get("ignore_class") is not None

    def terms(self, y_true: Any, y_pred: Any, sample_weight: Any) -> tuple[Any, Any]:
        """(this replica's share, the global batch's loss): Keras' call with the weights."""
        share = self.keras(y_true, y_pred, sample_weight=sample_weight)
        ctx = split_context()
        if ctx is None:
            return share, share
        ctx.mark_replica_aware()  # a "sum" too: Keras' fit trains on the batch's sum
        return share, jax.lax.psum(share, REPLICA_AXIS)

    def __call__(self, y_true: Any, y_pred: Any) -> Any:
        return self.keras(y_true, y_pred)

    def __repr__(self) -> str:
        return f"KerasLoss({self.keras!r})"


class KerasMetric(_metrics.Metric):
    """A stateful `keras.metrics.Metric` (AUC, F1Score, MeanIoU, RootMeanSquaredError, your
    own): its variables as mirrored running sums that every replica adds its real rows to.

    Keras' metrics keep sums (counts, totals, confusion matrices), so the replicas' additions
    sum to the global batch's. The Keras object's own variables are not touched: read the
    result from the Trainer's logs.
    """

    def __init__(self, metric: Any) -> None:
        try:
            parameters = inspect.signature(metric.update_state).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        if "y_pred" not in parameters and "sample_weight" in parameters:
            raise ValueError(
                f"Expected a metric of (y_true, y_pred), as Keras' compile takes; found "
                f"{type(metric).__name__}, whose update_state takes {tuple(parameters)}. "
                "Fix: a metric of labels and predictions (keras.metrics.MeanSquaredError...), "
                "or keras.metrics.MeanMetricWrapper(fn) around a function of them."
            )
        if parameters and "sample_weight" not in parameters:
            raise ValueError(
                f"Expected {type(metric).__name__}.update_state to take sample_weight: the "
                "Trainer weighs a ragged batch's padded rows by 0 through it; found "
                f"update_state{tuple(parameters)}. Fix: add sample_weight=None and weigh each "
                "row's contribution by it."
            )
        super().__init__(metric.name, jnp.float32)
        self._keras = metric
        self.direction = getattr(metric, "_direction", None)
        self._names: tuple[str, ...] = ()
        self._counts: tuple[bool, ...] = ()
        # IoU metrics of sparse labels flatten the labels and the weights alike
        self._flattens = is_keras(metric, "_IoUBase") and getattr(metric, "sparse_y_true", True)
        if _built(metric):
            self._add_states()

    def _add_states(self) -> None:
        self._names = tuple(f"state_{i}" for i in range(len(self._keras.variables)))
        # R2Score adds the labels' size to `num_samples` whatever the weights: a padded
        # batch's padded rows are taken back out of it
        counting = is_keras(self._keras, "R2Score")
        self._counts = tuple(counting and v.name == "num_samples" for v in self._keras.variables)
        for name, variable in zip(self._names, self._keras.variables, strict=True):
            setattr(self, name, self.add_variable(variable.shape, variable.dtype))

    def build(self, y_true: jax.ShapeDtypeStruct, y_pred: jax.ShapeDtypeStruct) -> None:
        """Create Keras' variables for these labels and predictions (F1Score, R2Score and
        AUC(multi_label=True) size them by the data), then the mirrored sums beside them."""
        with jax.ensure_compile_time_eval():
            self._keras.update_state(
                jnp.zeros((1, *y_true.shape[1:]), y_true.dtype),
                jnp.zeros((1, *y_pred.shape[1:]), y_pred.dtype),
            )
            self._keras.reset_state()
        self._add_states()

    @property
    def built(self) -> bool:
        return bool(self._names)

    def build_like(self, saved: list[Any]) -> None:
        """Build for the sums of a checkpoint (a fresh metric resumed by BackupAndRestore):
        the metrics sized by the data size their sums by the outputs' last axis."""
        size = max((np.shape(a)[-1] for a in saved if np.ndim(a)), default=1)
        spec = jax.ShapeDtypeStruct((1, size), jnp.float32)
        self.build(spec, spec)

    def _values(self) -> list[Any]:
        return [getattr(self, name)[...] for name in self._names]

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        _metrics.check_rows(self.name, y_true=y_true, y_pred=y_pred, sample_weight=sample_weight)
        if not self.built:  # sized by the data: built before the step is traced again
            raise MetricNotBuilt(self, _spec(y_true), _spec(y_pred))
        labels = jax.tree.leaves(y_true)[0]
        weight = _real_row_weights(labels, sample_weight)
        if weight is not None and self._flattens and jnp.ndim(weight) < jnp.ndim(labels):
            # The IoU metrics flatten the labels and the weights alike (segmentation maps)
            weight = jnp.broadcast_to(
                weight.reshape(weight.shape + (1,) * (labels.ndim - weight.ndim)), labels.shape
            )
        options = {} if weight is None else {"sample_weight": weight}
        old = self._values()
        new = self._keras.stateless_update_state(old, y_true, y_pred, **options)
        rows = _context.row_mask(labels)
        for name, before, after, counts in zip(self._names, old, new, self._counts, strict=True):
            if counts and rows is not None:  # counts the labels, weighed or not: real rows only
                after = before + (after - before) * jnp.sum(rows) / rows.shape[0]
            getattr(self, name)[...] = after

    def result(self) -> Any:
        """Keras' `result()` on the mirrored sums (a variable it returns read inside them)."""
        from keras.src import backend

        mapping = list(zip(self._keras.variables, self._values(), strict=True))
        with backend.StatelessScope(state_mapping=mapping):
            return jax.tree.map(
                lambda v: jnp.asarray(v.value) if isinstance(v, backend.Variable) else v,
                self._keras.result(),
                is_leaf=lambda v: isinstance(v, backend.Variable),
            )

    def __repr__(self) -> str:
        return f"KerasMetric({self._keras!r})"


def build_from_saved(metrics: dict[str, Any], arrays: dict[str, Any]) -> None:
    """Build each Keras metric sized by the data (not built yet: a fresh one) that has sums
    under its prefix in a checkpoint's `arrays`, for those sums' shapes."""
    for prefix, metric in metrics.items():
        saved = [a for key, a in arrays.items() if key.startswith(prefix + "/")]
        if isinstance(metric, KerasMetric) and saved and not metric.built:
            metric.build_like(saved)


class MetricNotBuilt(Exception):
    """Raised while a step is traced: a Keras metric sized by the data (F1Score) met its first
    batch; `steps.run_chunk` builds it for these shapes and traces the step again."""

    def __init__(self, metric: KerasMetric, y_true: Any, y_pred: Any) -> None:
        super().__init__(f"{metric.name} is built on its first batch")
        self.keras, self.y_true, self.y_pred = metric._keras, y_true, y_pred


def _built(metric: Any) -> bool:
    """Whether a Keras metric has its variables (F1Score, R2Score, AUC(multi_label=True)
    create them on the first batch)."""
    return getattr(metric, "_built", True) is not False and bool(metric.variables)


def _spec(value: Any) -> jax.ShapeDtypeStruct:
    value = jax.tree.leaves(value)[0]
    return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype)


def _real_row_weights(y_true: Any, sample_weight: Any) -> Any:
    """The sample weights with a padded batch's padded rows at 0 (whatever the weights' rank),
    or the 0/1 row mask (int32, which every Keras metric casts to its dtype) without them."""
    mask = _context.row_mask(y_true)
    if mask is None:
        return sample_weight
    if sample_weight is None:  # one weight per row, as Keras' (n,) sample weights
        return mask.astype(jnp.int32)
    weight = jnp.asarray(sample_weight, jnp.float32)
    mask = mask.astype(jnp.float32)
    return weight * mask.reshape(mask.shape + (1,) * max(weight.ndim - 1, 0))
