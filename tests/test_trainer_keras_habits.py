"""What Keras' fit/evaluate/predict do that a Keras user's callbacks and arguments rely on,
found by a review against Keras 3 on one device: batch logs that keep their batch's values
when a callback holds on to them, a model left in its mode by an evaluate or predict from a
callback, Keras' 0 for a metric of weights that are all 0."""

import numpy as np
import optax
import pytest
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
    import keras

    kept = _Keeps()
    stateful = keras.metrics.RootMeanSquaredError(name="rmse")  # its own state, summed
    metrics = [mirrored.metrics.MeanSquaredError("m"), stateful]
    trainer = _trainer(devices, loss="mse", metrics=metrics)
    trainer.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[kept])
    losses = [logs["loss"] for logs in kept.train]
    assert len(set(losses)) == 4, losses
    logs = trainer.evaluate(X, Y, batch_size=16, verbose=0, callbacks=[kept])
    running = [logs["m"] for logs in kept.test]
    assert len(set(running)) == 4, running
    rmse = [logs["rmse"] for logs in kept.test]
    assert len(set(rmse)) == 4 and rmse[-1] == logs["rmse"], rmse
    assert rmse[0] == pytest.approx(np.sqrt(running[0]), rel=1e-5)  # batch 1 alone
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


def test_keras_names_mirrored_does_not_define_resolve_as_compile_does(devices):
    """`loss="huber"`, `metrics=["mape", "r2_score"]` were refused; Keras' compile resolves
    them (a loss function per example, metric objects named by the string)."""
    import keras

    trainer = _trainer(devices, loss="huber", metrics=["mape", "r2_score"])
    logs = trainer.evaluate(X, Y, batch_size=16, verbose=0)
    assert set(logs) == {"loss", "mape", "r2_score"}
    outputs = np.asarray(trainer.predict(X, verbose=0))
    huber = np.mean(
        [
            float(keras.losses.huber(Y[i : i + 16], outputs[i : i + 16]).mean())
            for i in range(0, 64, 16)
        ]
    )
    mape, r2 = keras.metrics.MeanAbsolutePercentageError(), keras.metrics.R2Score()
    for start in range(0, 64, 16):
        mape.update_state(Y[start : start + 16], outputs[start : start + 16])
        r2.update_state(Y[start : start + 16], outputs[start : start + 16])
    assert logs["loss"] == pytest.approx(huber, rel=1e-5)
    assert logs["mape"] == pytest.approx(float(mape.result()), rel=1e-5)
    assert logs["r2_score"] == pytest.approx(float(r2.result()), rel=1e-5)


def test_keras_arguments_of_evaluate_predict_and_fits_validation(devices):
    """`evaluate(steps=, return_dict=False)`, `predict(steps=)`, `fit(validation_freq=,
    validation_steps=, validation_batch_size=)`, `validation_data` as a list or with a None
    weight: Keras' arguments, which raised TypeError (or a misleading error) before."""
    trainer = _trainer(devices, loss="mse", metrics=["mae"])
    whole = trainer.evaluate(X, Y, batch_size=16, verbose=0)
    first = trainer.evaluate(X[:32], Y[:32], batch_size=16, verbose=0)
    assert trainer.evaluate(X, Y, batch_size=16, steps=2, verbose=0) == first
    assert trainer.evaluate(X, Y, batch_size=16, verbose=0, return_dict=False) == [
        whole["loss"],
        whole["mae"],
    ]
    assert trainer.predict(X, batch_size=16, steps=3, verbose=0).shape == (48, 3)
    options = {"batch_size": 16, "epochs": 4, "shuffle": False, "verbose": 0}
    every = trainer.fit(X, Y, validation_data=[X[:24], Y[:24]], validation_freq=2, **options)
    assert len(every.history["loss"]) == 4 and len(every.history["val_loss"]) == 2
    listed = trainer.fit(X, Y, validation_data=(X, Y, None), validation_freq=[1, 4], **options)
    assert len(listed.history["val_loss"]) == 2
    held = trainer.fit(
        X,
        Y,
        validation_data=(X, Y),
        validation_steps=1,
        validation_batch_size=8,
        **{**options, "epochs": 1},
    )
    expected = trainer.evaluate(X[:8], Y[:8], verbose=0)["loss"]
    assert held.history["val_loss"] == [pytest.approx(expected, rel=1e-6)]
    with pytest.raises(ValueError, match="validation_data's x to fit the model"):
        trainer.fit(X, Y, validation_data=(X[:, :3], Y), **options)
    with pytest.raises(ValueError, match="validation_freq"):
        trainer.fit(X, Y, validation_data=(X, Y), validation_freq=0, **options)


def test_keras_callback_arguments_verbose_and_threshold(devices, tmp_path, capsys):
    """`EarlyStopping(verbose=1)` and `ModelCheckpoint(verbose=1, initial_value_threshold=)`
    raised TypeError; now Keras' messages and rule (save only once the threshold is beaten);
    `save_freq=N` on ModelCheckpoint and a per-class monitor are clear errors; evaluate is
    quiet by default."""
    trainer = _trainer(devices, loss="mse")
    options = {"batch_size": 16, "shuffle": False, "verbose": 0}
    stop = mirrored.callbacks.EarlyStopping(
        "loss", patience=0, min_delta=100.0, verbose=1, restore_best_weights=True
    )
    trainer.fit(X, Y, epochs=5, callbacks=[stop], **options)
    printed = capsys.readouterr().out
    assert "Epoch 2: early stopping" in printed
    assert "Restoring model weights from the end of the best epoch: 1." in printed
    never = mirrored.callbacks.ModelCheckpoint(
        str(tmp_path / "never"), "loss", save_best_only=True, verbose=1, initial_value_threshold=0.0
    )
    saved = mirrored.callbacks.ModelCheckpoint(str(tmp_path / "saved"), "loss", verbose=1)
    trainer.fit(X, Y, epochs=1, callbacks=[never, saved], **options)
    printed = capsys.readouterr().out
    assert "Epoch 1: loss did not improve from 0.00000" in printed
    assert f"Epoch 1: saving model to {tmp_path / 'saved'}" in printed
    assert mirrored.latest_checkpoint(str(tmp_path / "never")) is None
    assert mirrored.latest_checkpoint(str(tmp_path / "saved")) is not None
    with pytest.raises(ValueError, match="BackupAndRestore"):
        mirrored.callbacks.ModelCheckpoint(str(tmp_path / "c"), save_freq=10)
    trainer.evaluate(X, Y)
    assert capsys.readouterr().out == ""


def test_a_keras_pydataset_is_shuffled_by_batch_and_told_each_epoch_ends(devices):
    """Keras' fit shuffles a PyDataset's batch order each epoch (shuffle=True, the default)
    and calls its on_epoch_end(); the order was kept and on_epoch_end never called."""
    import keras

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()
            self.seen, self.ends = [], 0

        def __len__(self):
            return 8

        def __getitem__(self, index):
            self.seen.append(index)
            rows = slice(8 * index, 8 * index + 8)
            return X[rows], Y[rows]

        def on_epoch_end(self):
            self.ends += 1

    trainer = _trainer(devices, loss="mse")
    kept = Batches()
    trainer.fit(kept, epochs=2, shuffle=False, verbose=0)
    assert kept.seen == list(range(8)) * 2 and kept.ends == 2
    shuffled = Batches()
    trainer.fit(shuffled, epochs=2, verbose=0)
    first, second = shuffled.seen[:8], shuffled.seen[8:]
    assert sorted(first) == sorted(second) == list(range(8))
    assert first != list(range(8)) and first != second and shuffled.ends == 2


def test_the_keras_model_methods_a_callback_reads(devices, tmp_path):
    """`self.model` in a callback is the Trainer: Keras' `get_weights`, `set_weights`,
    `save_weights`, `load_weights`, `metrics_names` and `history` (AttributeError before)."""
    trainer = _trainer(devices, _Dropped, loss="mse", metrics=["mae"])
    before = trainer.get_weights()
    assert [w.shape for w in before] == [(3,), (4, 3)]  # bias, kernel: no RNG state
    history = trainer.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert trainer.history is history
    assert trainer.metrics_names == ["loss", "mae"]
    trained = trainer.get_weights()
    trainer.save_weights(str(tmp_path / "weights"))
    trainer.set_weights(before)
    assert all(np.array_equal(a, b) for a, b in zip(trainer.get_weights(), before, strict=True))
    assert trainer.predict(X[:8], verbose=0).shape == (8, 3)  # still placed mirrored
    trainer.load_weights(str(tmp_path / "weights"))
    assert all(np.array_equal(a, b) for a, b in zip(trainer.get_weights(), trained, strict=True))
    with pytest.raises(ValueError, match="Nothing was changed"):
        trainer.set_weights(before[:1])


def test_jax_arrays_as_x_and_y_train_as_numpy_arrays_do(devices):
    """Keras on JAX takes jnp arrays as fit's x and y; they crashed the shuffled gather (its
    out= buffer): the same numbers as NumPy's, fit, evaluate and predict."""
    import jax.numpy as jnp

    runs = []
    for x, y in [(X, Y), (jnp.asarray(X), jnp.asarray(Y))]:
        trainer = _trainer(devices, loss="mse", steps_per_execution=1)
        history = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0).history
        runs.append((history, trainer.evaluate(x, y), trainer.predict(x, batch_size=16)))
    assert runs[0][:2] == runs[1][:2]
    np.testing.assert_array_equal(runs[0][2], runs[1][2])
