"""Keras' metric names and classes give Keras' numbers (issue 33, item 3): `"auc"`, `"precision"`
and `"recall"` under a `from_logits=True` loss score the sigmoid of the logits, `AUC` clips scores
into [0, 1], and top-k accuracy counts a tie at the k-th score as in the top k.

The references are plain Keras in a process where mirrored is never imported, and scikit-learn.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn import metrics as sk

import mirrored
from _helpers import subprocess_env

RNG = np.random.default_rng(7)
LOGITS = (2.0 * RNG.normal(size=(77, 1))).astype(np.float32)  # 77 rows: ragged at batch 16
LABELS = (LOGITS[:, 0] + RNG.normal(size=77) > 0.3).astype(np.float32)[:, None]
SCORES = np.linspace(-0.6, 1.7, 77, dtype=np.float32)[:, None]  # outside [0, 1] both sides
CLASSES = RNG.integers(0, 10, size=(77,)).astype(np.int32)
TIED = RNG.integers(0, 3, size=(77, 10)).astype(np.float32)  # scores with many ties

KERAS = """
import json, os, sys
os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np
data = {k: np.asarray(v, np.float32) for k, v in json.loads(sys.stdin.read()).items()}
probabilities = 1.0 / (1.0 + np.exp(-data["logits"].astype(np.float64)))
def result(metric, y, p):
    metric.update_state(y, p)
    return float(metric.result())
print(json.dumps({
    "auc_logits": result(keras.metrics.AUC(from_logits=True), data["labels"], data["logits"]),
    "auc_probabilities": result(keras.metrics.AUC(), data["labels"], probabilities),
    "precision": result(keras.metrics.Precision(), data["labels"], probabilities),
    "recall": result(keras.metrics.Recall(), data["labels"], probabilities),
    "auc_out_of_range": result(keras.metrics.AUC(), data["labels"], data["scores"]),
    "top_k": [
        result(keras.metrics.SparseTopKCategoricalAccuracy(k=k), data["classes"], data["tied"])
        for k in (1, 2, 5)
    ],
}))
"""


@pytest.fixture(scope="module")
def keras_results():
    data = {
        "logits": LOGITS.tolist(),
        "labels": LABELS.tolist(),
        "scores": SCORES.tolist(),
        "classes": CLASSES.tolist(),
        "tied": TIED.tolist(),
    }
    done = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-c", KERAS],
        input=json.dumps(data),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class Identity(nnx.Module):
    """A model whose outputs are its inputs: the metric sees the test's scores exactly."""

    def __init__(self):
        self.unused = nnx.Param(jax.numpy.zeros(()))

    def __call__(self, x):
        return x


@pytest.mark.parametrize("replicas", [1, 2, 8])
def test_metric_names_under_a_logits_loss_score_probabilities(replicas, keras_results):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        trainer = mirrored.Trainer(
            Identity(),
            optax.sgd(0.0),  # only evaluate runs
            loss="binary_crossentropy",
            from_logits=True,
            metrics=["auc", "precision", "recall"],
        )
    results = trainer.evaluate(LOGITS, LABELS, batch_size=16, verbose=0)
    # Was 0.18-0.3 for a 0.8 AUC: the logits bucketed as if they were probabilities.
    assert results["auc"] == pytest.approx(keras_results["auc_logits"], abs=1e-6)
    assert results["auc"] == pytest.approx(keras_results["auc_probabilities"], abs=1e-6)
    assert results["auc"] == pytest.approx(sk.roc_auc_score(LABELS, LOGITS), abs=5e-3)
    predicted = (LOGITS > 0).astype(np.float32)
    assert results["precision"] == pytest.approx(keras_results["precision"], abs=1e-6)
    assert results["precision"] == pytest.approx(sk.precision_score(LABELS, predicted))
    assert results["recall"] == pytest.approx(keras_results["recall"], abs=1e-6)
    assert results["recall"] == pytest.approx(sk.recall_score(LABELS, predicted))


def test_auc_clips_scores_outside_zero_one_as_keras(keras_results):
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        auc = mirrored.metrics.AUC()

    def step(auc, y, p):
        auc.update_state(y, p)

    for start in range(0, 77, 16):  # the last batch ragged: 13 rows on 8 replicas
        batch = next(
            iter(
                strategy.experimental_distribute_dataset(
                    (LABELS[start : start + 16], SCORES[start : start + 16]), batch_size=16
                )
            )
        )
        strategy.run(step, args=(auc, *batch))
    assert float(auc.result()) == pytest.approx(keras_results["auc_out_of_range"], abs=1e-6)


@pytest.mark.parametrize("replicas", [1, 8])
def test_top_k_counts_a_tie_at_the_kth_score_as_keras(replicas, keras_results):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        metrics = [mirrored.metrics.SparseTopKCategoricalAccuracy(k=k) for k in (1, 2, 5)]

    def step(metrics, y, p):
        for metric in metrics:
            metric.update_state(y, p)

    for y, p in strategy.experimental_distribute_dataset((CLASSES, TIED), batch_size=16):
        strategy.run(step, args=(metrics, y, p))
    ours = [float(m.result()) for m in metrics]
    # Was 0.120 / 0.253 / 0.773 on such data: ties broken by position, as lax.top_k does.
    assert ours == pytest.approx(keras_results["top_k"], abs=1e-6)
    rank = 1 + (TIED[np.arange(77), CLASSES][:, None] < TIED).sum(axis=1)  # NumPy's count
    assert ours == pytest.approx([np.mean(rank <= k) for k in (1, 2, 5)], abs=1e-6)


def _keras_arguments_cases():
    import keras

    probabilities = RNG.dirichlet(np.ones(4), 77).astype(np.float32)
    one_hot = np.eye(4, dtype=np.float32)[RNG.integers(0, 4, 77)]
    binary = (1.0 / (1.0 + np.exp(-LOGITS))).astype(np.float32)
    m, k = mirrored.metrics, keras.metrics
    return [  # (ours, Keras', labels, predictions)
        (m.Precision(top_k=2), k.Precision(top_k=2), one_hot, probabilities),
        (m.Recall(class_id=1), k.Recall(class_id=1), one_hot, probabilities),
        (m.Precision(0.3, 1, 2), k.Precision(0.3, 1, 2), one_hot, probabilities),
        (m.Recall([0.2, 0.6], top_k=3), k.Recall([0.2, 0.6], top_k=3), one_hot, probabilities),
        (m.AUC(np.int64(50)), k.AUC(np.int64(50)), LABELS, binary),
        (m.AUC(thresholds=[0.2, 0.5, 0.8]), k.AUC(thresholds=[0.2, 0.5, 0.8]), LABELS, binary),
    ]


def test_precision_recall_and_auc_take_keras_arguments_in_keras_order(devices):
    """`top_k`, `class_id`, `thresholds` positional as Keras orders them (Precision(0.3, 1, 2)
    used to take 1 as its name), AUC's explicit `thresholds` and a NumPy `num_thresholds`:
    inside `strategy.run` on 8 replicas, batches of 16 (a ragged 13 last), weighted, the
    numbers of Keras' metric updated with the same batches on the host."""
    strategy = mirrored.MirroredStrategy(devices)
    weights = RNG.uniform(0.2, 2.0, 77).astype(np.float32)
    for ours, theirs, labels, predictions in _keras_arguments_cases():
        with strategy.scope():
            ours = type(ours)(**_arguments(ours))
        dataset = strategy.experimental_distribute_dataset(
            (labels, predictions, weights), batch_size=16
        )
        for y, p, w in dataset:
            strategy.run(lambda metric, y, p, w: metric.update_state(y, p, w), args=(ours, y, p, w))
        for start in range(0, 77, 16):
            rows = slice(start, start + 16)
            theirs.update_state(labels[rows], predictions[rows], sample_weight=weights[rows])
        np.testing.assert_allclose(
            np.asarray(ours.result()), np.asarray(theirs.result()), rtol=2e-5, atol=1e-6
        )


def _arguments(metric):
    """The arguments `metric` was built with (to build it again inside the scope)."""
    if isinstance(metric, mirrored.metrics.AUC):
        inner = metric.thresholds[1:-1]
        evenly = np.allclose(inner, np.linspace(0, 1, metric.num_thresholds)[1:-1])
        return {"num_thresholds": metric.num_thresholds} if evenly else {"thresholds": inner}
    thresholds = None if metric.thresholds[0] in (0.5, -1e10) else list(metric.thresholds)
    if thresholds is not None and metric._scalar:
        thresholds = thresholds[0]
    return {"thresholds": thresholds, "top_k": metric.top_k, "class_id": metric.class_id}


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: mirrored.metrics.Precision(thresholds=1.5), ["thresholds in [0, 1]", "1.5"]),
        (lambda: mirrored.metrics.Recall(top_k=0), ["top_k", "int >= 1"]),
        (lambda: mirrored.metrics.Precision(class_id=-1), ["class_id", "int >= 0"]),
        (lambda: mirrored.metrics.AUC(multi_label=True), ["multi_label", "keras.metrics.AUC"]),
        (lambda: mirrored.metrics.AUC(num_thresholds=1), ["num_thresholds", "int > 1"]),
    ],
)
def test_keras_arguments_out_of_range_are_clear_errors(make, words):
    with pytest.raises(ValueError) as error:
        make()
    for word in words:
        assert word in str(error.value)
