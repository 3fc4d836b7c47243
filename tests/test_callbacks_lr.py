"""The learning rate (`Trainer.learning_rate`, LearningRateScheduler, ReduceLROnPlateau), the
other Keras callbacks (LambdaCallback, TerminateOnNaN), what callbacks see, and TensorBoard."""

import io
import math
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console

import mirrored
from mirrored.callbacks import (
    Callback,
    History,
    LambdaCallback,
    LearningRateScheduler,
    ProgbarLogger,
    ReduceLROnPlateau,
    TensorBoard,
    TerminateOnNaN,
)


def data(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    return x, (x @ rng.normal(size=(3, 2))).astype(np.float32)


def injected_sgd(rate=0.1):
    return optax.inject_hyperparams(optax.sgd)(learning_rate=rate)


def make(devices, tx, loss="mse", **options):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(model, tx, loss, **options)
    return strategy, model, trainer


def numpy_sgd(kernel, bias, x, y, rates):
    """Full-batch SGD on Keras' mse, one step per rate, in float64."""
    kernel, bias = kernel.astype(np.float64), bias.astype(np.float64)
    for rate in rates:
        error = x @ kernel + bias - y
        grad = 2 * error / error.size  # d/dpred of mean over examples and outputs
        kernel, bias = kernel - rate * x.T @ grad, bias - rate * grad.sum(axis=0)
    return kernel, bias


# -- Trainer.learning_rate --------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"global_clipnorm": 1.0}, {"gradient_accumulation_steps": 2}, {"policy": "mixed_float16"}],
    ids=["plain", "clipnorm", "accumulation", "loss_scale"],
)
def test_learning_rate_is_found_inside_the_trainers_wrappers(devices, options):
    _, _, trainer = make(devices[:2], injected_sgd(0.1), **options)
    assert trainer.learning_rate == pytest.approx(0.1)
    trainer.learning_rate = 0.25
    assert trainer.learning_rate == pytest.approx(0.25)


def test_setting_the_rate_reuses_the_compiled_step(devices):
    traces = []

    def mse(y_true, y_pred):
        traces.append(1)  # runs once per trace of a step, never per executed step
        return jnp.mean((y_pred - y_true) ** 2, axis=-1)

    x, y = data(16)
    strategy, model, trainer = make(devices, injected_sgd(0.1), loss=mse)
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    traced, programs = len(traces), len(strategy._runner._programs)
    assert traced >= 1
    before = trainer.optimizer.opt_state.hyperparams["learning_rate"].get_value()
    trainer.learning_rate = 0.0
    after = trainer.optimizer.opt_state.hyperparams["learning_rate"].get_value()
    assert (after.dtype, after.sharding) == (before.dtype, before.sharding)
    kernel = np.asarray(model.kernel[...])
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    # The new rate reached the compiled step (rate 0: nothing moves) without a new trace.
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)
    assert (len(traces), len(strategy._runner._programs)) == (traced, programs)


def test_a_rate_outside_the_state_raises_with_the_fix(devices):
    _, _, trainer = make(devices[:2], optax.adam(1e-3))
    fix = r"optax\.inject_hyperparams\(optax\.adam\)\(learning_rate=1e-3\)"
    with pytest.raises(ValueError, match=fix):
        trainer.learning_rate  # noqa: B018
    with pytest.raises(ValueError, match=fix):
        trainer.learning_rate = 1e-4
    _, _, scheduled = make(devices[:2], optax.adam(optax.linear_schedule(1e-3, 0.0, 10)))
    with pytest.raises(ValueError, match="For a schedule"):
        scheduled.learning_rate  # noqa: B018
    _, _, good = make(devices[:2], injected_sgd())
    with pytest.raises(ValueError, match="finite real number; found nan"):
        good.learning_rate = float("nan")
    with pytest.raises(ValueError, match="finite real number; found 'fast'"):
        good.learning_rate = "fast"


def test_an_injected_schedule_is_readable_but_not_settable(devices):
    x, y = data(16)
    schedule = optax.linear_schedule(0.4, 0.0, 4)  # 0.4, 0.3, 0.2, ...
    _, model, trainer = make(devices[:2], optax.inject_hyperparams(optax.sgd)(schedule))
    assert trainer.learning_rate == pytest.approx(0.4)  # the first step's, before training
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # steps at 0.4, 0.3
    assert trainer.learning_rate == pytest.approx(0.3)  # the rate the last step used
    with pytest.raises(TypeError, match="a schedule computes every step"):
        trainer.learning_rate = 0.1
    kernel = np.asarray(model.kernel[...])
    with pytest.raises(TypeError, match="a schedule computes every step"):
        trainer.fit(x, y, callbacks=[LearningRateScheduler(lambda epoch: 0.1)], verbose=0)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), kernel)  # before any step


# -- LearningRateScheduler --------------------------------------------------------------------


def test_scheduler_sets_each_epochs_rate_and_sgd_steps_by_it(devices):
    x, y = data(16)
    _, model, trainer = make(devices, injected_sgd(0.5))
    kernel, bias = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
    rates, seen = [0.1, 0.02, 0.3], []

    def schedule(epoch, lr):
        seen.append(lr)
        return rates[epoch]

    history = trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        shuffle=False,
        callbacks=[LearningRateScheduler(schedule)],
        verbose=0,
    )
    np.testing.assert_allclose(seen, [0.5, 0.1, 0.02], rtol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"], rates, rtol=1e-6)
    expected_kernel, expected_bias = numpy_sgd(kernel, bias, x, y, rates)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), expected_kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), expected_bias, rtol=1e-5, atol=1e-6)


def test_scheduler_takes_a_one_argument_schedule_and_refuses_non_numbers(devices, capsys):
    x, y = data(16)
    _, _, trainer = make(devices[:2], injected_sgd())
    one_arg = LearningRateScheduler(lambda epoch: 0.1 * (epoch + 1), verbose=1)
    history = trainer.fit(x, y, batch_size=8, epochs=2, callbacks=[one_arg], verbose=0)
    np.testing.assert_allclose(history.history["learning_rate"], [0.1, 0.2], rtol=1e-6)
    assert "Epoch 2: LearningRateScheduler setting learning rate to 0.2" in capsys.readouterr().out
    with pytest.raises(ValueError, match="found None from the schedule at epoch 0"):
        trainer.fit(x, y, callbacks=[LearningRateScheduler(lambda epoch, lr: None)], verbose=0)
    with pytest.raises(TypeError, match=r"schedule\(epoch, lr\) or schedule\(epoch\)"):
        LearningRateScheduler(lambda: 0.1)


# -- ReduceLROnPlateau --------------------------------------------------------------------------


def drive(trainer, callback, values, monitor="val_loss"):
    """Keras' loop around one callback: the rate logged each epoch, and the rate after it."""
    callback.set_trainer(trainer, {})
    callback.on_train_begin({})
    logged, after = [], []
    for epoch, value in enumerate(values):
        logs = {monitor: value}
        callback.on_epoch_end(epoch, logs)
        logged.append(logs["learning_rate"])
        after.append(trainer.learning_rate)
    return logged, after


def test_reduce_on_plateau_follows_keras_patience_cooldown_and_min_lr(devices):
    _, _, trainer = make(devices[:2], injected_sgd(0.1))
    callback = ReduceLROnPlateau(factor=0.5, patience=2, cooldown=2, min_delta=0.01, min_lr=0.02)
    values = [1.0, 0.995, 0.99, 0.99, 0.99, 0.99, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    logged, after = drive(trainer, callback, values)
    # Traced by hand through keras/src/callbacks/reduce_lr_on_plateau.py: 0.995 and 0.99 are
    # not below best - min_delta = 0.99; the cooldown epochs after a reduction do not count
    # (cooldown=2: one epoch without counting, then counting resumes); at min_lr it stays.
    assert after == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025, 0.025, 0.02, 0.02, 0.02, 0.02, 0.02]
    )
    assert logged == pytest.approx([0.1, *after[:-1]])  # the rate each epoch used
    assert (callback.best, callback.wait, callback.cooldown_counter) == (0.5, 3, 0)


def test_reduce_on_plateau_in_max_mode_and_in_fit(devices):
    _, _, trainer = make(devices[:2], injected_sgd(0.1))
    _, after = drive(
        trainer,
        ReduceLROnPlateau("val_accuracy", factor=0.5, patience=1),
        [0.5, 0.5, 0.6],
        "val_accuracy",
    )
    assert after == pytest.approx([0.1, 0.05, 0.05])  # "acc": higher is better
    x, y = data(16)
    _, _, trainer = make(devices, injected_sgd(0.1))
    never_better = ReduceLROnPlateau(factor=0.5, patience=1, min_delta=1e9)
    history = trainer.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        validation_data=data(8, 1),
        callbacks=[never_better],
        verbose=0,
    )
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.1, 0.05])
    assert trainer.learning_rate == pytest.approx(0.025)
    with pytest.raises(ValueError, match="factor < 1.0"):
        ReduceLROnPlateau(factor=1.0)
    with pytest.raises(ValueError, match="mode 'auto', 'min' or 'max'"):
        ReduceLROnPlateau(mode="lowest")


def test_auto_mode_follows_each_metrics_direction_as_keras_3(devices, tmp_path, caplog):
    """mode="auto" maximises AUC, precision and recall (Keras 3's metric directions; before:
    "acc" in the name or minimise, so EarlyStopping on val_auc stopped at its first rise and
    restored the worse weights), minimises the loss and errors; a metric function of your
    own without a direction follows the name ("acc": higher) with a warning, or its
    `direction` attribute."""

    def dice(y_true, y_pred):  # no direction: "acc" not in its name, so lower is better
        return jnp.mean((y_true - y_pred) ** 2, axis=-1)

    def overlap(y_true, y_pred):
        return -jnp.mean((y_true - y_pred) ** 2, axis=-1)

    overlap.direction = "up"
    _, _, trainer = make(
        devices[:2],
        injected_sgd(0.1),
        metrics=["auc", "precision", "recall", "accuracy", "mae", dice, overlap],
        weighted_metrics=["auc"],
    )
    expected = {
        "val_auc": np.greater,
        "val_precision": np.greater,
        "recall": np.greater,
        "val_accuracy": np.greater,
        "val_weighted_auc": np.greater,
        "val_loss": np.less,
        "val_mae": np.less,
        "val_overlap": np.greater,
    }
    for monitor, better in expected.items():
        for callback in (
            mirrored.callbacks.EarlyStopping(monitor),
            mirrored.callbacks.ModelCheckpoint(str(tmp_path / "c"), monitor=monitor),
        ):
            callback.set_trainer(trainer, {})
            callback.on_train_begin({})
            assert callback._better is better, (monitor, callback)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mirrored"):
        stopping = mirrored.callbacks.EarlyStopping("val_dice", mode="auto")
        stopping.set_trainer(trainer, {})
        stopping.on_train_begin({})
    assert stopping._better is np.less
    assert "cannot tell whether 'val_dice' should rise or fall" in caplog.text
    assert "mode='max'" in caplog.text
    # ReduceLROnPlateau on a rising val_auc keeps the rate; on val_loss it would halve it.
    _, after = drive(
        trainer, ReduceLROnPlateau("val_auc", factor=0.5, patience=1), [0.7, 0.8, 0.9], "val_auc"
    )
    assert after == pytest.approx([0.1, 0.1, 0.1])
    # EarlyStopping on a rising val_precision runs on; explicit modes still win.
    stopping = mirrored.callbacks.EarlyStopping("val_precision", patience=1)
    stopping.set_trainer(trainer, {})
    stopping.on_train_begin({})
    for epoch, value in enumerate([0.5, 0.6, 0.7, 0.8]):
        stopping.on_epoch_end(epoch, {"val_precision": value})
    assert not trainer.stop_training
    forced = mirrored.callbacks.EarlyStopping("val_auc", mode="min")
    forced.set_trainer(trainer, {})
    forced.on_train_begin({})
    assert forced._better is np.less


# -- what callbacks see -------------------------------------------------------------------------


def test_lambda_callback_hooks_are_called_as_in_keras(devices):
    x, y = data(16)
    _, _, trainer = make(devices[:2], injected_sgd())
    events = []
    record = LambdaCallback(
        on_train_begin=lambda logs: events.append(("train_begin", dict(logs))),
        on_epoch_begin=lambda epoch, logs: events.append(("epoch_begin", epoch)),
        on_train_batch_begin=lambda batch, logs: events.append(("batch_begin", batch)),
        on_train_batch_end=lambda batch, logs: events.append(("batch_end", batch, "loss" in logs)),
        on_epoch_end=lambda epoch, logs: events.append(("epoch_end", epoch, sorted(logs))),
        on_train_end=lambda logs: events.append(("train_end", sorted(logs))),
        on_test_begin=lambda logs: events.append(("test_begin",)),
    )
    trainer.fit(
        x, y, batch_size=8, epochs=2, validation_data=data(8, 1), callbacks=[record], verbose=0
    )
    epoch = [("batch_begin", 0), ("batch_end", 0, True), ("batch_begin", 1), ("batch_end", 1, True)]
    keys = ["loss", "val_loss"]
    assert events == [
        ("train_begin", {}),
        ("epoch_begin", 0),
        *epoch,
        ("test_begin",),
        ("epoch_end", 0, keys),
        ("epoch_begin", 1),
        *epoch,
        ("test_begin",),
        ("epoch_end", 1, keys),
        ("train_end", keys),
    ]
    with pytest.raises(TypeError, match="found 'on_epoch_finish'"):
        LambdaCallback(on_epoch_finish=print)


def test_keras_older_batch_hook_names_are_called(devices):
    class Old(Callback):
        batches = 0

        def on_batch_end(self, batch, logs=None):
            self.batches += 1

    x, y = data(16)
    _, _, trainer = make(devices[:2], injected_sgd())
    old = Old()
    trainer.fit(x, y, batch_size=4, epochs=1, callbacks=[old], verbose=0)
    assert old.batches == 4


@pytest.mark.parametrize(("replicas", "per_execution"), [(1, 1), (8, 4)])
def test_terminate_on_nan_stops_before_the_bad_update(devices, capsys, replicas, per_execution):
    """Batch 1 of 4 holds NaN: training stops there with the model trained on batch 0 only
    (Keras applies the NaN update first: a documented difference), whatever the replica count
    and however many steps one execution runs."""
    x, y = data(32)
    x[8:16] = np.nan  # batch 1 of 4 at batch_size 8
    _, model, trainer = make(devices[:replicas], injected_sgd(), steps_per_execution=per_execution)
    kernel, bias = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
    seen = []
    batches = LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    history = trainer.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        callbacks=[TerminateOnNaN(), batches],
        verbose=0,
    )
    assert seen == ([0, 1] if per_execution == 1 else [3]) and history.epoch == [0]
    assert math.isnan(history.history["loss"][0])
    assert "Batch 1: Invalid loss, terminating training" in capsys.readouterr().out
    want = numpy_sgd(kernel, bias, x[:8], y[:8], [0.1])
    np.testing.assert_allclose(np.asarray(model.kernel[...]), want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), want[1], rtol=1e-5, atol=1e-6)
    # Training again goes on from there: nothing of the failed step is left behind.
    history = trainer.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_terminate_on_nan_raises_and_stops_at_a_non_finite_gradient(devices, capsys):
    """A finite loss with a NaN gradient (sqrt at 0) stops training too, the update not
    applied; raise_error=True says what and where, and changes nothing either."""
    x, y = data(32)
    y[8:16] = 0.0  # batch 1: sqrt(0) has a finite value and an infinite slope

    def loss(y_true, y_pred):
        return jnp.mean(jnp.sqrt(y_pred - y_pred + jnp.abs(y_true)), axis=-1)

    _, model, trainer = make(devices, injected_sgd(), loss)
    kernel = np.asarray(model.kernel[...])  # batch 0's gradients are 0: nothing moves
    history = trainer.fit(
        x, y, batch_size=8, shuffle=False, callbacks=[TerminateOnNaN()], verbose=0
    )
    assert "Batch 1: Invalid gradients (bias), terminating training" in capsys.readouterr().out
    assert np.isfinite(history.history["loss"][0])
    assert np.array_equal(np.asarray(model.kernel[...]), kernel)
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(x, y, batch_size=8, shuffle=False, callbacks=[TerminateOnNaN(True)], verbose=0)
    message = str(raised.value)
    assert "non-finite values in the gradients (bias) at batch 1 of epoch 1" in message, message
    assert "was not applied" in message and "Fix:" in message
    assert np.array_equal(np.asarray(model.kernel[...]), kernel)


def test_keys_a_callback_adds_reach_the_history(devices):
    class Doubled(Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["double_loss"] = 2 * logs["loss"]

    x, y = data(16)
    _, _, trainer = make(devices[:2], injected_sgd())
    history = trainer.fit(x, y, batch_size=8, epochs=2, callbacks=[Doubled()], verbose=0)
    assert history.history["double_loss"] == pytest.approx(2 * np.asarray(history.history["loss"]))
    mine = History()  # Keras: a History among the callbacks is the one returned
    assert trainer.fit(x, y, batch_size=8, callbacks=[mine], verbose=0) is mine
    with pytest.raises(
        TypeError, match="Expected callbacks to be mirrored.callbacks.Callback instances"
    ):
        trainer.fit(x, y, callbacks=[object()], verbose=0)


def test_evaluate_verbose_shows_progress(devices, capsys):
    x, y = data(16)
    _, _, trainer = make(devices[:2], injected_sgd())
    logs = trainer.evaluate(x, y, batch_size=4, verbose=1)
    (line,) = capsys.readouterr().out.splitlines()  # off a terminal: one line
    assert line.startswith("evaluate") and f"loss {logs['loss']:.4f}" in line
    bar = ProgbarLogger()
    bar.console = Console(file=io.StringIO(), force_terminal=True, width=120)
    trainer.evaluate(x, y, batch_size=4, callbacks=[bar], verbose=1)
    assert "4/4" in bar.console.file.getvalue()  # the live bar, all steps done
    trainer.evaluate(x, y, batch_size=4)
    trainer.fit(x, y, batch_size=8, epochs=1, validation_data=(x, y), verbose=1)
    out = capsys.readouterr().out
    assert "evaluate" not in out and "val_loss" in out  # validation inside fit is silent


# -- TensorBoard ----------------------------------------------------------------------------------


def read(directory):
    from tensorboard.backend.event_processing import event_accumulator as ea

    accumulator = ea.EventAccumulator(str(directory), size_guidance={ea.HISTOGRAMS: 0})  # all
    accumulator.Reload()
    return accumulator


def test_tensorboard_scalars_histograms_and_batch_logs(devices, tmp_path):
    x, y = data(16)
    _, model, trainer = make(devices, injected_sgd(0.1))
    halve = LearningRateScheduler(lambda epoch, lr: 0.1 / 2**epoch)
    board = TensorBoard(tmp_path / "tb", histogram_freq=2, update_freq="batch")
    history = trainer.fit(
        x, y, batch_size=8, epochs=3, shuffle=False, callbacks=[board, halve], verbose=0
    )
    assert not (tmp_path / "tb" / "validation").exists()  # no validation data, no directory
    train = read(tmp_path / "tb" / "train")
    epoch_loss = train.Scalars("epoch_loss")
    assert [e.step for e in epoch_loss] == [0, 1, 2]
    np.testing.assert_allclose([e.value for e in epoch_loss], history.history["loss"], rtol=1e-6)
    rates = [e.value for e in train.Scalars("epoch_learning_rate")]
    np.testing.assert_allclose(rates, [0.1, 0.05, 0.025], rtol=1e-6)
    assert [e.step for e in train.Scalars("batch_loss")] == [1, 2, 3, 4, 5, 6]
    kernel = train.Histograms("kernel/histogram")
    assert [e.step for e in kernel] == [0, 2]
    final = np.asarray(model.kernel[...])
    last = kernel[-1].histogram_value
    assert (last.num, last.min, last.max) == (
        6,
        pytest.approx(final.min()),
        pytest.approx(final.max()),
    )
    assert [e.step for e in train.Histograms("bias/histogram")] == [0, 2]


def test_tensorboard_update_freq_counts_batches_and_options_are_checked(devices, tmp_path):
    x, y = data(16)
    _, _, trainer = make(devices[:2], optax.sgd(0.1))  # rate not readable: not logged
    board = TensorBoard(tmp_path / "tb", update_freq=3)
    trainer.fit(
        x, y, batch_size=4, epochs=2, validation_data=data(8, 1), callbacks=[board], verbose=0
    )
    train = read(tmp_path / "tb" / "train")
    assert [e.step for e in train.Scalars("batch_loss")] == [3, 6]
    assert "epoch_learning_rate" not in train.Tags()["scalars"]
    assert read(tmp_path / "tb" / "validation").Tags()["scalars"] == ["epoch_loss"]
    for bad in ({"update_freq": 0}, {"update_freq": "step"}, {"histogram_freq": -1}):
        with pytest.raises(ValueError, match="Expected"):
            TensorBoard(tmp_path, **bad)


def test_importing_mirrored_imports_no_library_a_program_may_not_use():
    """Each is imported when used (issue 15: `import mirrored` within 0.3 s of jax + flax)."""
    lazy = ["orbax", "tensorboardX", "grain", "matplotlib", "sklearn", "typer", "keras"]
    code = (
        "import sys, mirrored\n"
        f"loaded = [m for m in {lazy!r} if m in sys.modules]\n"
        "assert not loaded, f'imported: {loaded}'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
