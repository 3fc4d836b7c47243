"""Trainer with mirrored.metrics, and the fit pitfalls Keras leaves silent (issue 14)."""

import logging

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn import metrics as sk

import mirrored

RNG = np.random.default_rng(0)
X = RNG.normal(size=(77, 4)).astype(np.float32)  # 77 examples: ragged at batch 16 on 8
Y = (X[:, 0] + 0.5 * RNG.normal(size=77) > 0).astype(np.float32)[:, None]


class Logistic(nnx.Module):
    def __init__(self, outputs=1, probabilities=True):
        self.dense = nnx.Linear(4, outputs, rngs=nnx.Rngs(0))
        self.probabilities = probabilities

    def __call__(self, x):
        z = self.dense(x)
        if not self.probabilities:
            return z
        return jax.nn.sigmoid(z) if z.shape[-1] == 1 else jax.nn.softmax(z)


@pytest.fixture(scope="module")
def strategy():
    return mirrored.MirroredStrategy(jax.devices())


def test_stateful_and_mean_metrics_in_fit_and_evaluate_equal_sklearn(strategy):
    with strategy.scope():
        model = Logistic()
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.1),
            "binary_crossentropy",
            metrics=[
                "auc",
                mirrored.metrics.Precision(name="p"),
                mirrored.metrics.BinaryAccuracy(name="acc"),  # a mean: exact running sums
            ],
            weighted_metrics=[mirrored.metrics.Recall()],
        )
    weights = RNG.uniform(0.5, 2.0, 77).astype(np.float32)
    history = trainer.fit(X, Y, batch_size=16, epochs=2, verbose=0, validation_data=(X, Y))
    assert set(history.history) >= {"auc", "p", "acc", "recall", "val_auc", "val_p"}
    results = trainer.evaluate(X, Y, batch_size=16, sample_weight=weights)
    p = trainer.predict(X)[:, 0]
    assert results["auc"] == pytest.approx(sk.roc_auc_score(Y[:, 0], p), abs=5e-3)
    assert results["p"] == pytest.approx(sk.precision_score(Y[:, 0], p > 0.5), abs=1e-6)
    assert results["acc"] == pytest.approx(np.mean((p > 0.5) == Y[:, 0]), abs=1e-6)
    expected_recall = sk.recall_score(Y[:, 0], p > 0.5, sample_weight=weights)
    assert results["recall"] == pytest.approx(expected_recall, abs=1e-6)
    # Validation ran on the same data with the same end-of-epoch model: the same numbers.
    assert history.history["val_p"][-1] == pytest.approx(results["p"], abs=1e-6)


def test_a_logits_model_with_keras_default_from_logits_warns_once(strategy, caplog):
    y = RNG.integers(0, 3, 77).astype(np.int32)
    with strategy.scope():
        model = Logistic(outputs=3, probabilities=False)
        trainer = mirrored.Trainer(model, optax.sgd(0.1), "sparse_categorical_crossentropy")
    with caplog.at_level(logging.WARNING, logger="mirrored"):
        trainer.fit(X, y, batch_size=16, epochs=2, verbose=0)
    warnings = [r for r in caplog.records if "from_logits=True" in r.getMessage()]
    assert len(warnings) == 1 and "look like logits" in warnings[0].getMessage()


def test_the_first_batch_is_predicted_once_per_input_structure_and_labels_always_checked(
    strategy, caplog
):
    """The logits look costs a predict and a wait: once per trainer and input structure (a
    new batch size is the same structure); the labels of every fit are still checked."""
    y = RNG.integers(0, 3, 77).astype(np.int32)
    with strategy.scope():
        model = Logistic(outputs=3, probabilities=False)
        trainer = mirrored.Trainer(model, optax.sgd(0.1), "sparse_categorical_crossentropy")
    host_rows, calls = trainer._host_rows, []  # once per predict of the first batch
    trainer._host_rows = lambda out: calls.append(1) or host_rows(out)
    with caplog.at_level(logging.WARNING, logger="mirrored"):
        trainer.fit(X, y, batch_size=16, verbose=0)
        trainer.fit(X, y, batch_size=32, verbose=0)
    assert len(calls) == 1
    assert len([r for r in caplog.records if "from_logits=True" in r.getMessage()]) == 1
    bad = y.copy()
    bad[70] = 3
    before = np.asarray(model.dense.kernel[...])
    with pytest.raises(ValueError, match=r"labels in \[0, 3\).*found label 3"):
        trainer.fit(X, bad, batch_size=16, verbose=0)
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(model.dense.kernel[...]), before)


def test_a_probability_model_does_not_warn(strategy, caplog):
    y = RNG.integers(0, 3, 77).astype(np.int32)
    with strategy.scope():
        model = Logistic(outputs=3)
        trainer = mirrored.Trainer(model, optax.sgd(0.1), "sparse_categorical_crossentropy")
    with caplog.at_level(logging.WARNING, logger="mirrored"):
        trainer.fit(X, y, batch_size=16, verbose=0)
    assert not [r for r in caplog.records if "from_logits" in r.getMessage()]


def test_sparse_labels_outside_the_class_range_raise_with_the_value(strategy):
    y = RNG.integers(0, 3, 77).astype(np.int32)
    y[60] = 7  # not in the first batch: the whole label array is checked
    with strategy.scope():
        model = Logistic(outputs=3)
        trainer = mirrored.Trainer(model, optax.sgd(0.1), "sparse_categorical_crossentropy")
    before = np.asarray(model.dense.kernel[...])
    with pytest.raises(ValueError, match=r"labels in \[0, 3\).*found label 7"):
        trainer.fit(X, y, batch_size=16, verbose=0)
    np.testing.assert_array_equal(np.asarray(model.dense.kernel[...]), before)  # no step ran


def test_crossentropies_of_probabilities_and_their_label_forms_are_kerass():
    """Keras divides each row of probabilities by its sum before clipping (a row that does not
    sum to 1, with a value below epsilon: 15.42, where clipping first gave 13.82), and casts
    float class indices to int; the names match keras.losses on them, and "AUC" is a name."""
    import keras

    probs = np.array([[2e-8, 0.1, 0.0], [0.2, 0.5, 0.3], [0.0, 1.0, 0.0]], np.float32)
    labels = np.array([0, 2, 1])
    one_hot = np.eye(3, dtype=np.float32)[labels]
    for ours, theirs, y in (
        (
            mirrored.losses.SparseCategoricalCrossentropy(),
            keras.losses.sparse_categorical_crossentropy,
            labels,
        ),
        (
            mirrored.losses.SparseCategoricalCrossentropy(),
            keras.losses.sparse_categorical_crossentropy,
            labels.astype(np.float32),
        ),
        (mirrored.losses.CategoricalCrossentropy(), keras.losses.categorical_crossentropy, one_hot),
    ):
        np.testing.assert_allclose(
            np.asarray(ours(y, probs)), np.asarray(theirs(y, probs)), rtol=1e-6
        )
    assert mirrored._train.objectives.get_metric("AUC", None).name == "auc"
    with pytest.raises(ValueError, match="'auc'.*'precision'.*'recall'"):
        mirrored._train.objectives.get_metric("f1", None)
