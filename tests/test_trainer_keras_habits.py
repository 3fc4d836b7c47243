"""What Keras' fit/evaluate/predict do that a Keras user's callbacks and arguments rely on,
found by a review against Keras 3 on one device: batch logs that keep their batch's values
when a callback holds on to them, a model left in its mode by an evaluate or predict from a
callback, Keras' 0 for a metric of weights that are all 0."""

import numpy as np
import optax
from flax import nnx

import mirrored

RNG = np.random.default_rng(3)
X = RNG.normal(size=(64, 4)).astype(np.float32)
Y = RNG.normal(size=(64, 3)).astype(np.float32)


class _Dropped(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.dense(self.dropout(x))


def _trainer(devices, make=None, **options):
    with mirrored.MirroredStrategy(devices).scope():
        model = make() if make else nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        return mirrored.Trainer(model, optax.sgd(0.1), **options)


class _Keeps(mirrored.callbacks.Callback):
    def __init__(self):
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(logs)

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(logs)


def test_batch_logs_kept_by_a_callback_keep_their_batch(devices):
    """They all read the last batch's loss (and a stateful metric its last value) before;
    Keras' logs are a dict of that batch's values, which a callback may copy or change."""
    kept = _Keeps()
    trainer = _trainer(devices, loss="mse", metrics=[mirrored.metrics.MeanSquaredError("m")])
    trainer.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[kept])
    losses = [logs["loss"] for logs in kept.train]
    assert len(set(losses)) == 4, losses
    trainer.evaluate(X, Y, batch_size=16, verbose=0, callbacks=[kept])
    running = [logs["m"] for logs in kept.test]
    assert len(set(running)) == 4, running
    logs = kept.train[0]
    assert isinstance(logs, dict) and logs.copy() == dict(logs)
    logs["seen"] = 1.0
    assert logs["seen"] == 1.0 and "loss" in logs


def test_evaluate_or_predict_from_a_callback_leaves_training_in_train_mode(devices):
    """An evaluate in on_epoch_begin left Dropout off for the rest of fit: the losses were
    those of a model without dropout."""

    def losses(probe):
        trainer = _trainer(devices, _Dropped, loss="mse")

        class Probe(mirrored.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                probe(self.model)

        options = {"batch_size": 16, "epochs": 3, "shuffle": False, "verbose": 0}
        return trainer.fit(X, Y, callbacks=[Probe()], **options).history["loss"]

    plain = losses(lambda trainer: None)
    assert losses(lambda trainer: trainer.evaluate(X[:16], Y[:16], verbose=0)) == plain
    assert losses(lambda trainer: trainer.predict(X[:16], verbose=0)) == plain


def test_a_weighted_metric_of_zero_weights_is_zero_as_in_keras(devices):
    trainer = _trainer(devices, loss="mse", weighted_metrics=["mse"])
    logs = trainer.evaluate(X, Y, sample_weight=np.zeros(64, np.float32), verbose=0)
    assert logs == {"loss": 0.0, "mse": 0.0}
