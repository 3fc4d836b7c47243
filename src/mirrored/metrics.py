"""Keras-named stateful metrics, exact inside `strategy.run`, in `Trainer` and across processes.

A metric is an NNX module whose state is running sums (`MetricState`). Create it inside
`strategy.scope()` and pass it to `run` as an argument, like the model. Each replica adds its
own rows, as TensorFlow's SYNC_ON_READ variables do; when the step ends the replicas'
additions are summed, so the state stays mirrored and `result()` is the metric of the whole
global batch, anywhere. Padded rows of a ragged batch are masked out automatically.

Example:
    >>> with strategy.scope():
    ...     accuracy = mirrored.metrics.SparseCategoricalAccuracy()
    >>> def step(model, accuracy, x, y):
    ...     accuracy.update_state(y, model(x))
    >>> strategy.run(step, args=(model, accuracy, xb, yb))
    >>> float(accuracy.result())

Subclass `Metric` for your own: create `MetricState` sums in `__init__` with `add_variable`,
add to them in `update_state` (weights from `self.weights(...)` mask the padding), and
compute `result()` from them.
"""

from mirrored._nnx.metrics import MetricState
from mirrored._train.confusion import AUC, Precision, Recall
from mirrored._train.confusion import get as get  # Trainer's metric names
from mirrored._train.metrics import (
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    Mean,
    MeanAbsoluteError,
    MeanMetricWrapper,
    MeanSquaredError,
    Metric,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    Sum,
)

__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "CategoricalAccuracy",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "MetricState",
    "Precision",
    "Recall",
    "SparseCategoricalAccuracy",
    "SparseTopKCategoricalAccuracy",
    "Sum",
]
