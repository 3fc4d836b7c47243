"""Keras 3 models under mirrored (issue 20): `model.fit` and TensorFlow's custom loop, with
`tf.keras` → `keras`, equal to plain Keras on one device; ragged last batches exact.

The plain Keras references are computed in a subprocess that never imports mirrored
(_keras_reference.py): mirrored.keras patches Keras process-wide, so a reference computed here
would share any bug of the patches."""

import importlib.util
import itertools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import mirrored
import mirrored.keras
from _helpers import keras_reference as _keras_reference
from _helpers import subprocess_env
from _keras_models import (
    BATCHES,
    FIT,
    SAMPLE_WEIGHTS,
    TOKENS,
    TWO_OUTPUT_LABELS,
    HalveAtBatch3,
    X,
    Y,
    adam_model,
    compile_loss_only,
    compile_sgd,
    compiled,
    penalized,
    recurrent,
    sequential,
    two_outputs,
)
from mirrored.keras import _fit

assert keras.backend.backend() == "jax"

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Every plain Keras reference of this module, from one process that never imported mirrored."""
    results = _keras_reference(tmp_path_factory.mktemp("keras") / "plain.json")
    assert not results["mirrored_imported"] and not results["patched"]
    return results


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True)
    )


def _spans_all_devices(model, devices):
    return all(
        v.value.sharding.device_set == set(devices) and v.value.sharding.is_fully_replicated
        for v in model.variables
    )


def _fit_mirrored(build, devices, y=Y):
    """`build()`'s model, created in the scope of a strategy over `devices`, fit for 2 epochs
    as the references are: (model, its history)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = build()
    history = model.fit(X, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    return model, history.history


def _assert_history(ours, expected, names=None):
    for name in names or expected:
        assert ours[name] == pytest.approx(expected[name], abs=1e-5), name


@pytest.mark.parametrize("replicas", [8, 1])
def test_fit_evaluate_predict_on_n_replicas_equal_plain_keras_ragged_batch_included(
    plain, replicas, devices
):
    expected = plain["fit"]
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        model = compiled()
    assert _spans_all_devices(model, devices[:replicas])
    ours = model.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(ours, expected["history"], ("loss", "accuracy"))
    evaluation = model.evaluate(X, Y, batch_size=64, verbose=0)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)
    predicted = model.predict(X, batch_size=64, verbose=0)
    assert predicted.shape == (525, 10)
    np.testing.assert_allclose(predicted, expected["predict"], atol=1e-5)
    assert _spans_all_devices(model, devices[:replicas])  # the optimizer's too, after fit
    assert all(
        v.value.sharding.device_set == set(devices[:replicas]) for v in model.optimizer.variables
    )


def test_steps_per_execution_trains_and_evaluates_as_one_device(plain, devices):
    """Keras' JAX loop calls the step K times per execution; the ragged batch ends a group."""
    expected = plain["fit"]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():  # 9 batches an epoch: groups of 4, 4 and 1
        model = compile_sgd(sequential(), steps_per_execution=4)
    ours = model.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(ours, expected["history"], ("loss", "accuracy"))
    evaluation = model.evaluate(X, Y, batch_size=64, verbose=0)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)


@pytest.fixture
def executions(monkeypatch):
    """The K-step programs run (`strategy.run_steps`' call): how many steps each."""
    from mirrored._run.runner import Runner

    ran = []
    call_steps = Runner.call_steps

    def counted(self, fn, args, kwargs, batches):
        ran.append(len(batches))
        return call_steps(self, fn, args, kwargs, batches)

    monkeypatch.setattr(Runner, "call_steps", counted)
    return ran


@pytest.mark.parametrize("replicas", [8, 1])
def test_steps_per_execution_runs_k_steps_in_one_program_with_one_steps_numbers(
    replicas, devices, executions
):
    """Keras' K calls of the step per execution run as one program of K steps (9 batches an
    epoch: 4 + 4 + the ragged one alone): Dropout draws, BatchNormalization's statistics,
    sample weights, metrics and evaluate as one step per program; the batches stacked on
    the host and placed once."""
    strategy = mirrored.MirroredStrategy(devices[:replicas])

    def trained(steps_per_execution):
        with strategy.scope():
            model = compile_sgd(
                sequential(dropout=0.3, norm="local"), steps_per_execution=steps_per_execution
            )
        options = {"sample_weight": SAMPLE_WEIGHTS, "epochs": 2, "batch_size": 64}
        history = model.fit(X, Y, shuffle=False, verbose=0, **options).history
        evaluation = model.evaluate(X, Y, batch_size=64, verbose=0)
        return model, history, evaluation

    fused, fused_history, fused_evaluation = trained(4)
    assert executions == [4, 4, 4, 4, 4, 4]  # two epochs, then evaluate's two
    one, one_history, one_evaluation = trained(1)
    assert len(executions) == 6
    assert fused_history == one_history
    assert fused_evaluation == one_evaluation
    for a, b in zip(fused.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fused.optimizer.iterations.numpy() == 18


def test_steps_per_execution_over_batches_of_changing_shapes_runs_them_one_by_one(
    devices, executions
):
    """A generator whose batches change length (sequences bucketed by length): an execution
    of batches of two shapes runs them one step at a time, as Keras does; one of a single
    shape (NumPy or not) runs as one program. The numbers of one step per program."""
    keras.utils.set_random_seed(2)
    rng = np.random.default_rng(4)
    lengths = [5, 5, 5, 7, 7, 7, 7, 7, 3, 3]
    data = [
        (rng.normal(size=(16, t, 4)).astype("float32"), rng.integers(0, 3, 16)) for t in lengths
    ]
    strategy = mirrored.MirroredStrategy(devices)

    def trained(steps_per_execution):
        with strategy.scope():
            keras.utils.set_random_seed(2)
            model = keras.Sequential(
                [
                    keras.Input((None, 4)),
                    keras.layers.Dense(8, activation="relu"),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(3),
                ]
            )
            compile_sgd(model, steps_per_execution=steps_per_execution)
        model.fit((b for b in data), steps_per_epoch=len(data), shuffle=False, verbose=0)
        return model

    fused = trained(4)
    assert executions == [4, 2]  # [5, 5, 5, 7]: one by one; [7, 7, 7, 7]; [3, 3]
    for a, b in zip(fused.get_weights(), trained(1).get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_steps_per_execution_over_the_chunk_bytes_runs_one_step_at_a_time(
    devices, executions, monkeypatch
):
    """K batches over `chunks.CHUNK_BYTES` together are not stacked (host memory, and device
    memory with an execution prefetched): one step a program, the same numbers."""
    from mirrored._data import chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1)
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        bounded = compile_sgd(sequential(), steps_per_execution=4)
        one = compile_sgd(sequential())
    assert bounded.fit(X, Y, **FIT).history == one.fit(X, Y, **FIT).history
    assert executions == []
    for a, b in zip(bounded.get_weights(), one.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_non_finite_step_under_check_numerics_keeps_the_weights_from_before_it(
    devices, steps_per_execution
):
    """Infinity in batch 6 (of an execution of batches 4-7 at K = 4): NonFiniteError naming
    step 6, and a model that reads as the 6 batches before it trained it (its variables were
    given to the failed program: before, every read of them raised 'NoneType' object is not
    callable)."""
    bad = X.copy()
    bad[6 * 64 + 3, 2] = np.inf
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compile_sgd(sequential(), steps_per_execution=steps_per_execution)
        reference = compile_sgd(sequential())
    mirrored.debug.enable_check_numerics()
    try:
        with pytest.raises(mirrored.debug.NonFiniteError, match="at step 6 of"):
            model.fit(bad, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    finally:
        mirrored.debug.disable_check_numerics()
    reference.fit(X[: 6 * 64], Y[: 6 * 64], batch_size=64, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert model.optimizer.iterations.numpy() == 6


def test_a_compute_loss_override_counts_what_it_adds_once_as_on_one_device(plain, devices, caplog):
    """What the override adds by hand (the penalty, the constant) is the same on every
    replica: counted N times it would train with 8x its gradient, with no error."""
    expected = plain["penalized"]
    model, history = _fit_mirrored(penalized, devices)
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(history, expected["history"], ("loss", "accuracy"))
    evaluation = model.evaluate(X, Y, batch_size=64, verbose=0)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)
    assert "did not scale" not in caplog.text  # the N× warning: the whole loss was scaled


def test_an_overridden_train_step_is_refused_not_silently_skipped(devices):
    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            raise AssertionError("mirrored's step runs instead of this one")

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = OwnStep([keras.Input((20,)), keras.layers.Dense(10)])
        model.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    before = model.get_weights()
    with pytest.raises(NotImplementedError, match="OwnStep.train_step.*compute_loss"):
        model.fit(X, Y, batch_size=64, epochs=1, verbose=0)
    assert _max_diff(model.get_weights(), before) == 0


@pytest.mark.parametrize("kind", ["recurrent", "per_token"])
def test_recurrent_layers_and_masked_per_token_losses_train_as_one_device(plain, kind, devices):
    """Recurrent layers failed inside fit (a scan carry that starts the same on every replica
    and ends different); a per-token loss with a mask failed to broadcast the row mask."""
    expected = plain[kind]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model, labels = recurrent(kind)
        compile_loss_only(model)
    history = model.fit(TOKENS, labels, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(history.history, expected["history"], ("loss",))
    evaluation = model.evaluate(TOKENS, labels, verbose=0)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)


def test_two_outputs_and_regularizers_log_and_train_as_one_device_ragged_batch_included(
    plain, devices
):
    """Each output's loss in the logs (Keras' per-output trackers), weight and activity
    regularization in the gradients: all as plain Keras on one device."""
    expected = plain["two_outputs"]
    model, history = _fit_mirrored(two_outputs, devices, TWO_OUTPUT_LABELS)
    assert set(history) == {"loss", "cls_loss", "reg_loss", "cls_accuracy", "reg_mae"}
    assert set(expected["history"]) == set(history)
    _assert_history(history, expected["history"])
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    evaluate = {"batch_size": 64, "verbose": 0, "return_dict": True}
    evaluation = model.evaluate(X, TWO_OUTPUT_LABELS, **evaluate)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)
    regularizer = model.layers[1].get_config()["activity_regularizer"]
    assert regularizer["class_name"] == "L1"  # saved as the layer's own


def test_a_loss_tracker_that_is_not_keras_own_mean_logs_the_same_loss(plain, devices):
    class Tracker(keras.metrics.Mean):  # its own update_state: given the global loss
        pass

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled()
        model._loss_tracker = Tracker(name="loss")
    ours = model.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0).history
    assert ours["loss"] == pytest.approx(plain["fit"]["history"]["loss"][:1], abs=1e-5)


def test_sample_weights_and_keras_callbacks_in_fit(plain, tmp_path, devices):
    expected = plain["sample_weights"]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled()
    seen = []
    callbacks = [
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True),
        keras.callbacks.EarlyStopping(monitor="loss", patience=5),
        keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch)),
    ]
    history = model.fit(
        X,
        Y,
        sample_weight=SAMPLE_WEIGHTS,
        batch_size=64,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    _assert_history(history.history, expected["history"], ("loss",))
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    assert seen == list(range(9)) * 2
    restored = sequential()
    restored.load_weights(str(tmp_path / "m.weights.h5"))
    assert _max_diff(restored.get_weights(), model.get_weights()) == 0


def test_weights_set_by_a_callback_mid_epoch_are_the_next_steps_weights(
    plain, devices, monkeypatch
):
    """Steps after the first take the arrays the last step returned straight to the compiled
    program; a callback's `set_weights` hands Keras' loop new arrays, which take the full path."""
    expected = plain["halve_at_batch_3"]
    full_steps = []
    full = _fit._Step._full
    monkeypatch.setattr(
        _fit._Step, "_full", lambda self, *a: full_steps.append(self.kind) or full(self, *a)
    )
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled()
    history = model.fit(
        X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[HalveAtBatch3()]
    )
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(history.history, expected["history"], ("loss",))
    # The full path: the first step, the step after each set_weights and the second epoch's
    # first (Keras re-reads the variables its callback set); the other 14 of 18 went direct.
    assert full_steps == ["train"] * 4


def test_keras_per_step_state_dict_skips_the_tracker_and_other_attributes_are_tracked(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled()
    model.fit(X[:64], Y[:64], batch_size=64, epochs=1, verbose=0)
    state = {"trainable_variables": [v.value for v in model.trainable_variables]}
    model._jax_state = state  # what Keras' epoch loop assigns after every step
    assert model._jax_state is state  # plain Keras stores a TrackedDict copy
    model._jax_state = None
    model.extra = [keras.layers.Dense(3)]  # anything else: Keras' tracker as before
    assert type(model.extra).__name__ == "TrackedList"
    del model.extra


def test_a_model_built_outside_the_scope_is_refused_not_trained_on_one_device(devices):
    model = compiled()  # built and compiled on one device
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope(), pytest.raises(ValueError, match="was not created in the distribution"):
        model.fit(X, Y, batch_size=64, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="not created in the distribution strategy scope"):  # noqa: SIM117
        with strategy.scope():
            model.compile(optimizer="sgd", loss="mse")


def test_keras_default_from_logits_on_a_logits_model_warns_when_fit_starts(devices, caplog):
    from mirrored.keras import _fit

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = sequential()  # Dense(10): logits
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with caplog.at_level(logging.WARNING, logger="mirrored"), strategy.scope():
        model.make_train_function()  # what fit calls first
    assert "from_logits=False (Keras' default)" in caplog.text
    assert re.search(r"last layer 'dense(_\d+)?' has no activation", caplog.text)
    assert _fit.logits_trap(compiled()) is None  # from_logits=True
    softmax = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10, activation="softmax")])
    softmax.compile(loss=keras.losses.SparseCategoricalCrossentropy())
    assert _fit.logits_trap(softmax) is None
    binary = keras.Sequential([keras.Input((20,)), keras.layers.Dense(1)])
    binary.compile(loss=keras.losses.BinaryCrossentropy())
    assert "BinaryCrossentropy has from_logits=False" in _fit.logits_trap(binary)
    binary.compile(loss="mse")
    assert _fit.logits_trap(binary) is None


def test_a_model_created_in_the_scope_trains_mirrored_when_compiled_outside_it(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = sequential(input_shape=False)  # no variables yet
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model.fit(X[:128], Y[:128], batch_size=64, epochs=1, verbose=0)
    assert _spans_all_devices(model, devices)


def _custom_loop(strategy, *, loss_reduction=None, hand_mean=False, steps=None):
    with strategy.scope():
        model = sequential(input_shape=False)
        optimizer = keras.optimizers.SGD(0.1)
        kwargs = {} if loss_reduction is None else {"reduction": loss_reduction}
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)

    def train_step(inputs, labels):
        def compute_loss():
            logits = model(inputs, training=True)
            if hand_mean:
                return keras.ops.mean(
                    keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                )
            return loss_fn(labels, logits)

        loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    losses, kernels = [], []
    dataset = strategy.experimental_distribute_dataset(BATCHES[-5:])
    if steps is not None:  # strategy.run_steps: K steps a program
        iterator = iter(dataset)
        while (out := strategy.run_steps(train_step, iterator, steps=steps)) is not None:
            losses += np.asarray(strategy.reduce("SUM", out, axis=None)).tolist()
            kernels.append(np.asarray(model.layers[0].kernel.value).copy())
        return model, losses, kernels
    for inputs, labels in dataset:
        per_replica = strategy.run(train_step, args=(inputs, labels))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        kernels.append(np.asarray(model.layers[0].kernel.value).copy())
    return model, losses, kernels


def test_the_seeds_custom_loop_equals_train_on_batch_with_the_model_captured(plain, devices):
    expected = plain["train_on_batch"]  # plain Keras' train_on_batch, the last batch ragged (13)
    model, losses, kernels = _custom_loop(mirrored.MirroredStrategy(devices))
    assert losses == pytest.approx(expected["losses"], abs=1e-5)  # reduce("SUM"): the loss
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    # Read fresh every step, never a constant: the weights move at every step.
    assert all(np.max(np.abs(a - b)) > 1e-4 for a, b in itertools.pairwise(kernels))
    assert _spans_all_devices(model, devices)


def test_run_steps_runs_the_seeds_custom_loop_k_steps_a_program(plain, devices):
    """TensorFlow's `for _ in tf.range(K): strategy.run(step, args=(next(it),))` inside a
    tf.function: `strategy.run_steps` over a step that captures a Keras model (built by its
    first call, inside the program), optimizer and loss: train_on_batch's numbers, steps of
    2, 2 and the ragged one."""
    expected = plain["train_on_batch"]
    model, losses, kernels = _custom_loop(mirrored.MirroredStrategy(devices), steps=2)
    assert losses == pytest.approx(expected["losses"], abs=1e-5)
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    assert len(kernels) == 3 and _spans_all_devices(model, devices)


@pytest.mark.parametrize("replicas", [8, 1])
def test_run_steps_of_a_keras_step_carries_dropout_optimizer_and_metrics_as_run_does(
    replicas, devices
):
    """Dropout draws, Adam's slots (made at its first apply, inside the program), a Keras
    metric and the ragged last batch of in-memory arrays: run_steps with K = 4 gives what
    strategy.run per batch gives, to the bit."""
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    dataset = strategy.experimental_distribute_dataset((X, Y), batch_size=64)

    def trained(steps):
        with strategy.scope():
            model = sequential(dropout=0.3)
            optimizer = keras.optimizers.Adam(0.01)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            accuracy = keras.metrics.SparseCategoricalAccuracy()

        def train_step(inputs, labels):
            def compute_loss():
                return loss_fn(labels, model(inputs, training=True))

            loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            accuracy.update_state(labels, model(inputs, training=False))
            return loss

        losses = []
        for epoch in (1, 2):
            iterator = dataset.epoch_iterator(epoch)
            if steps is None:
                for inputs, labels in iterator:
                    out = strategy.run(train_step, args=(inputs, labels))
                    losses.append(float(strategy.reduce("SUM", out, axis=None)))
                continue
            while (out := strategy.run_steps(train_step, iterator, steps=steps)) is not None:
                losses += np.asarray(strategy.reduce("SUM", out, axis=None)).tolist()
        return losses, model.get_weights(), float(accuracy.result()), optimizer.iterations

    per_step, stepped = trained(None), trained(4)
    assert stepped[0] == per_step[0] and len(per_step[0]) == 18
    for a, b in zip(stepped[1], per_step[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert stepped[2] == per_step[2]
    assert int(stepped[3].numpy()) == int(per_step[3].numpy()) == 18


def test_an_explicit_sum_reduction_is_left_as_written_with_padding_masked(plain, devices):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    expected = plain["sum_reduction"]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = sequential(input_shape=False)
    (batch,) = strategy.experimental_distribute_dataset([BATCHES[-1]])  # 13 rows on 8 replicas
    per_replica = strategy.run(lambda x, y: loss_fn(y, model(x)), args=batch)
    assert float(strategy.reduce("SUM", per_replica, axis=None)) == pytest.approx(expected, 1e-5)


def test_a_hand_written_per_replica_mean_warns_of_the_n_times_gradient(devices, caplog):
    with caplog.at_level(logging.WARNING, logger="mirrored.loss"):
        _custom_loop(mirrored.MirroredStrategy(devices), hand_mean=True)
    assert "SUMMED over the 8 replicas" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mirrored.loss"):
        _custom_loop(mirrored.MirroredStrategy(devices))
    assert "SUMMED" not in caplog.text
    # reduction="sum" is each replica's own sum: divided by the replica's batch (the classic
    # trap) it trains with 8x the gradient; it was taken as scaled, silently (a review)
    with caplog.at_level(logging.WARNING, logger="mirrored.loss"):
        _custom_loop(mirrored.MirroredStrategy(devices), loss_reduction="sum")
    assert "SUMMED over the 8 replicas" in caplog.text


def test_compute_average_loss_takes_keras_tensors(devices):
    strategy = mirrored.MirroredStrategy(devices)
    (x,) = strategy.experimental_distribute_dataset([X[:13]])
    per_replica = strategy.run(
        lambda x: mirrored.compute_average_loss(keras.ops.sum(keras.ops.square(x), axis=1)),
        args=(x,),
    )
    expected = float(np.mean(np.sum(X[:13] ** 2, axis=1)))
    assert float(strategy.reduce("SUM", per_replica, axis=None)) == pytest.approx(expected, 1e-5)


def test_dropout_draws_other_masks_on_each_replica_and_each_step(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        keras.utils.set_random_seed(3)
        dropout = keras.layers.Dropout(0.5)
    ones = np.ones((8, 64), "float32")
    (x,) = strategy.experimental_distribute_dataset([ones])
    first = np.asarray(strategy.gather(strategy.run(lambda x: dropout(x, training=True), (x,)), 0))
    second = np.asarray(strategy.gather(strategy.run(lambda x: dropout(x, training=True), (x,)), 0))
    assert len({row.tobytes() for row in first}) == 8  # one mask per replica
    assert not np.array_equal(first, second)  # and new ones each step
    assert set(np.unique(first)) <= {0.0, 2.0}


def test_synchronized_batch_norm_on_8_replicas_equals_one_device_with_moving_statistics(
    plain, devices
):
    expected = plain["batch_norm"]["weights"]  # BatchNormalization(momentum=0.8), one epoch
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled(norm="sync")
    model.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(model.get_weights(), expected) <= 1e-5  # moving statistics included
    with strategy.scope():
        local = compiled(norm="plain")  # TensorFlow's default: per-replica statistics
    local.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(local.get_weights(), expected) > 1e-4
    assert _spans_all_devices(local, devices)


def test_import_mirrored_does_not_import_keras_and_another_backend_is_a_clear_error():
    env = {**os.environ, "KERAS_BACKEND": "numpy"}
    code = "import sys, mirrored; assert 'keras' not in sys.modules; print('lazy')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "lazy" in out.stdout, out.stderr
    code = "import keras, mirrored.keras"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "KERAS_BACKEND=jax" in out.stderr and "'numpy' backend" in out.stderr


def test_mirrored_keras_patches_change_nothing_outside_a_strategy(plain, tmp_path):
    """A Keras model used outside every strategy (regularizers, BatchNormalization, seeded
    Dropout, Adam and SGD, a masked GRU; fit, evaluate, predict, the *_on_batch calls, a loss
    called by hand, apply_gradients) gives bit for bit the same weights and logs in a process
    that imported mirrored and mirrored.keras as in one that never imported mirrored."""
    patched = _keras_reference(tmp_path / "patched.json", "--with-mirrored")
    assert patched["mirrored_imported"] and patched["patched"]
    assert patched["mirrored_file"] == mirrored.__file__
    expected = plain["outside"]
    assert set(patched["outside"]) == set(expected)
    for name, value in expected.items():
        assert patched["outside"][name] == value, name  # floats from float32: exact equality


def _example(name):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_keras_custom_loop_example_trains(capsys):
    accuracy = _example("keras_custom_loop").main(["--epochs", "4"])
    out = capsys.readouterr().out
    assert "Number of devices: 8" in out and "Epoch 4, loss:" in out
    assert accuracy > 0.85


def test_the_keras_fit_example_trains_saves_and_restores_outside_the_strategy(tmp_path, capsys):
    history, accuracy = _example("keras_fit").main(
        ["--epochs", "4", "--checkpoint-dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert "same predictions: True" in out
    assert accuracy > 0.85 and history["val_accuracy"][-1] > 0.8
    assert (tmp_path / "ckpt.weights.h5").exists() and (tmp_path / "model.keras").exists()


def test_save_checkpoint_of_a_keras_model_resumes_step_exactly_on_another_replica_count(
    plain, tmp_path, devices
):
    eight = mirrored.MirroredStrategy(devices)
    with eight.scope():
        first = adam_model()
    first.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    mirrored.save_checkpoint(tmp_path / "ckpt", first, first.optimizer, step=1)
    two = mirrored.MirroredStrategy(devices[:2])
    with two.scope():
        resumed = adam_model()
    assert mirrored.restore_checkpoint(tmp_path / "ckpt", resumed, resumed.optimizer) == 1
    assert int(resumed.optimizer.iterations.value) == 9
    assert _spans_all_devices(resumed, devices[:2])
    resumed.fit(X, Y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(resumed.get_weights(), plain["adam"]["weights_after_2"]) <= 1e-5
    # Keras' own weights file restores onto another replica count as well.
    first.save_weights(tmp_path / "m.weights.h5")
    with two.scope():
        loaded = adam_model()
        loaded.optimizer.build(loaded.trainable_variables)  # Keras loads into built slots only
    loaded.load_weights(tmp_path / "m.weights.h5")
    assert _max_diff(loaded.get_weights(), first.get_weights()) == 0
    assert _spans_all_devices(loaded, devices[:2])


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _mixed_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10, dtype="float32"),
        ]
    )


def test_mixed_float16_skips_the_step_on_every_replica_when_one_overflows(mixed_float16, devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = _mixed_model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)  # compile wraps it
    model.fit(X[:128], Y[:128], batch_size=64, epochs=1, verbose=0)
    before, scale = model.get_weights(), float(model.optimizer.dynamic_scale.value)
    poisoned = X[:64].copy()
    poisoned[0] = 1e30  # replica 0's rows only
    model.fit(poisoned, Y[:64], batch_size=64, epochs=1, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    assert float(model.optimizer.dynamic_scale.value) == scale / 2
    assert _spans_all_devices(model, devices)

    # The custom loop: the loss scaled by hand, as with TensorFlow's LossScaleOptimizer.
    with strategy.scope():
        loop_model = _mixed_model()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(inputs, labels):
        def compute_loss():
            return optimizer.scale_loss(loss_fn(labels, loop_model(inputs, training=True)))

        _, grads = mirrored.keras.value_and_grad(compute_loss, loop_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, loop_model.trainable_variables, strict=True))

    (clean,) = strategy.experimental_distribute_dataset([(X[:64], Y[:64])])
    strategy.run(step, args=clean)
    before, scale = loop_model.get_weights(), float(optimizer.dynamic_scale.value)
    (bad,) = strategy.experimental_distribute_dataset([(poisoned, Y[:64])])
    strategy.run(step, args=bad)
    assert all(np.array_equal(a, b) for a, b in zip(before, loop_model.get_weights(), strict=True))
    assert float(optimizer.dynamic_scale.value) == scale / 2


@pytest.mark.slow
def test_multi_worker_fit_and_custom_loop_equal_one_process_with_as_many_devices(tmp_path, devices):
    """2 processes × 2 devices (`mirrored launch`) against this process on 4 devices."""
    here = Path(__file__).resolve().parent
    env = subprocess_env()
    command = ["timeout", "-k", "10", "240", sys.executable, "-m", "mirrored.cli", "launch"]
    command += ["-n", "2", "--devices-per-process", "2", "--grace", "3"]
    command += [str(here / "_mw_keras_script.py"), str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=here, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[rank 1] [keras] replicas 4 processes 2" in result.stdout
    two = dict(np.load(tmp_path / "result.npz"))
    # Unseeded Keras initializers on each process (issue 33, 13): one model on both.
    ranks = [dict(np.load(tmp_path / f"unseeded.{r}.npz")) for r in (0, 1)]
    for name in ranks[0]:
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)

    sys.path.insert(0, str(here))
    try:
        worker = importlib.import_module("_mw_keras_script")
    finally:
        sys.path.remove(str(here))
    worker.strategy = mirrored.MirroredStrategy(devices[:4])  # one process, 4 devices
    worker.main(str(tmp_path / "one"))
    one = dict(np.load(tmp_path / "one" / "result.npz"))
    assert set(one) == set(two)
    for name in two:
        np.testing.assert_allclose(two[name], one[name], atol=1e-5, err_msg=name)
    np.testing.assert_allclose(two["fit_k4_loss"], two["loss"], rtol=1e-6)  # K steps a program
    for name in [n for n in two if n.startswith("fit/")]:
        np.testing.assert_allclose(two[name.replace("fit/", "fit_k4/")], two[name], atol=1e-6)


def test_backup_and_restore_resumes_an_interrupted_fit_exactly(plain, tmp_path, devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        straight = adam_model()
    expected = straight.fit(X, Y, batch_size=64, epochs=3, shuffle=False, verbose=0).history
    _assert_history(expected, plain["adam"]["history"])  # uninterrupted: as plain Keras
    assert _max_diff(straight.get_weights(), plain["adam"]["weights"]) <= 1e-5

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("preempted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    with strategy.scope():
        crashed = adam_model()
    with pytest.raises(RuntimeError, match="preempted"):
        crashed.fit(
            X, Y, batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[backup, Crash()]
        )
    with strategy.scope():
        resumed = adam_model()
    history = resumed.fit(
        X,
        Y,
        batch_size=64,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path))],
    )
    assert history.epoch == [2]  # epochs 0 and 1 are not redone
    assert history.history["loss"] == pytest.approx(expected["loss"][2:], abs=1e-6)
    assert _max_diff(resumed.get_weights(), straight.get_weights()) <= 1e-6


def test_fit_with_batches_placed_ahead_as_on_accelerators_gives_the_same_numbers(
    plain, devices, monkeypatch
):
    monkeypatch.setattr(_fit.jax, "default_backend", lambda: "gpu")  # the look-ahead path
    expected = plain["fit"]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = compiled()
    ours = model.fit(X, Y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    assert _max_diff(model.get_weights(), expected["weights"]) <= 1e-5
    _assert_history(ours, expected["history"], ("loss",))
    evaluation = model.evaluate(X, Y, batch_size=64, verbose=0)
    assert evaluation == pytest.approx(expected["evaluate"], abs=1e-5)


def test_compile_run_eagerly_runs_the_step_op_by_op_with_the_same_numbers(devices, capsys):
    """Keras' `compile(run_eagerly=True)` under the scope: mirrored's step runs eagerly (as
    `mirrored.config.run_functions_eagerly`), so a print in the model shows each replica."""

    class Printing(keras.layers.Layer):
        def call(self, x):
            print("activations:", x[:, 0])
            return x

    strategy = mirrored.MirroredStrategy(devices)
    results = []
    for run_eagerly in (False, True):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((20,)), keras.layers.Dense(16), Printing(), keras.layers.Dense(10)]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                run_eagerly=run_eagerly,
            )
        history = model.fit(X[:77], Y[:77], batch_size=64, epochs=1, shuffle=False, verbose=0)
        capsys.readouterr()
        predicted = model.predict(X[:32], batch_size=32, verbose=0)
        results.append((model.get_weights(), history.history["loss"], predicted))
        results[-1] += (capsys.readouterr().out,)
    (compiled, loss, p1, traced), (eager, eager_loss, p2, printed) = results
    assert _max_diff(eager, compiled) <= 1e-6
    assert eager_loss == pytest.approx(loss, abs=1e-6)
    np.testing.assert_allclose(p2, p1, atol=1e-5)
    # predict (outside any gradient, where values are JAX's differentiation tracers):
    assert "at mesh coordinates (replica,) = (7,)" in printed  # every replica's values
    assert "mesh coordinates" not in traced  # compiled: a tracer, at trace time only
    assert not mirrored.config.functions_run_eagerly()


# A step reading the model and optimizer as module globals, as TensorFlow's tutorial writes it.
_step_model: keras.Model | None = None
_step_optimizer: keras.optimizers.Optimizer | None = None


def _global_step(x, y):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss, grads = mirrored.keras.value_and_grad(
        lambda: loss_fn(y, _step_model(x, training=True)), _step_model.trainable_variables
    )
    _step_optimizer.apply_gradients(zip(grads, _step_model.trainable_variables, strict=True))
    return loss


def test_a_step_reading_globals_follows_them_when_they_name_new_objects(devices):
    """Creating the model and optimizer again under the same global names (a notebook cell run
    twice, a sweep) makes the same step train the new ones: the same losses as the first time
    (before: the step kept training the first model, silently)."""
    global _step_model, _step_optimizer
    strategy = mirrored.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype(np.float32), rng.integers(0, 4, 32)
    ((xb, yb),) = strategy.experimental_distribute_dataset([(x, y)])
    runs = []
    for _ in range(2):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            _step_model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
            _step_optimizer = keras.optimizers.SGD(0.1)
        losses = [
            float(strategy.reduce("SUM", strategy.run(_global_step, args=(xb, yb)), None))
            for _ in range(3)
        ]
        runs.append((losses, int(_step_optimizer.iterations.numpy())))
    assert runs[1] == runs[0]
    assert runs[0][1] == 3


def test_a_fresh_models_first_call_on_fewer_rows_than_replicas(devices):
    """predict / evaluate of a model under the scope whose first call has fewer examples than
    replicas (5 on 8) pad them as a ragged batch (they raised that the GLOBAL batch size must
    be at least 8, though the batch size was Keras' 32); later calls are unaffected."""
    strategy = mirrored.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 2, 40)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    direct = np.asarray(model(x))  # the model on the host, one device
    np.testing.assert_allclose(model.predict(x[:5], verbose=0), direct[:5], rtol=1e-6, atol=1e-6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[:5], direct[:5])
    assert model.evaluate(x[:5], y[:5], verbose=0) == pytest.approx(float(loss), rel=1e-5)
    np.testing.assert_allclose(model.predict(x, verbose=0), direct, rtol=1e-6, atol=1e-6)
