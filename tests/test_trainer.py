"""Trainer.fit / evaluate / predict: exact across replicas, resumable, with clear errors."""

import os
import subprocess
import sys
from pathlib import Path

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import (
    SmallMLP,
    max_relative_difference,
    params_of,
    subprocess_env,
    train_single_device,
)
from mirrored._train import tensorboard as _tensorboard

HERE = Path(__file__).resolve().parent


def data(rows=100, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(rows, 12)).astype(np.float32),
        rng.integers(0, 5, rows).astype(np.int32),
    )


def make_trainer(devices, tx=None, metrics=("accuracy",)):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            tx or optax.sgd(0.5),
            "sparse_categorical_crossentropy",
            list(metrics),
            from_logits=True,
        )
    return strategy, model, trainer


def test_fit_on_8_replicas_equals_single_device_training(devices):
    x, y = data(100)  # batches of 32, 32, 32 and a ragged 4
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)] * 2
    expected = train_single_device(batches, lambda: optax.sgd(0.5))
    _, model, trainer = make_trainer(devices)
    history = trainer.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    got = params_of(model)
    for name, value in expected.items():
        assert max_relative_difference(got[name], value) <= 1e-5, name
    assert len(history.history["loss"]) == 2


def test_evaluate_is_exact_across_replica_counts(devices):
    x, y = data(77)  # 77 examples: ragged on 8 replicas and at batch 16
    _, model, trainer = make_trainer(devices)
    _, _, single = make_trainer(devices[:1])
    # Copy through the host: run() donates state buffers, so the models must not share them.
    copy = jax.tree.map(lambda a: jax.device_put(np.asarray(a), devices[0]), nnx.state(model))
    nnx.update(single.model, copy)
    single.strategy._runner.check_mirrored(single.model, "single")
    eight = trainer.evaluate(x, y, batch_size=16)
    one = single.evaluate(x, y, batch_size=16)
    logits = np.asarray(model(x))
    expected_loss = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    assert eight["accuracy"] == one["accuracy"] == np.mean(logits.argmax(-1) == y)
    np.testing.assert_allclose([eight["loss"], one["loss"]], expected_loss, rtol=1e-6)


class _TwoOutputs(nnx.Module):
    """SmallMLP's logits and a second output (their energy), as a dict."""

    def __init__(self, rngs):
        self.net = SmallMLP(rngs=rngs)

    def __call__(self, x):
        logits = self.net(x)
        return {"logits": logits, "energy": jnp.sum(logits**2, axis=-1)}


def _on_logits(y_true, y_pred):
    return optax.softmax_cross_entropy_with_integer_labels(y_pred["logits"], y_true)


@pytest.mark.parametrize("replicas", [8, 1])
def test_a_model_of_several_outputs_trains_with_a_loss_that_picks_one(devices, replicas):
    """A model returning a dict, with a loss function and a metric that pick its logits,
    gives the numbers of the same model returning the logits alone (ragged batch); Keras'
    names on such a model are a clear error naming the fix (was "'dict' object has no
    attribute 'shape'")."""
    x, y = data(37)
    strategy = mirrored.MirroredStrategy(devices[:replicas])

    def picked_accuracy(y_true, y_pred):
        return (jnp.argmax(y_pred["logits"], -1) == y_true).astype(jnp.float32)

    def picked_accuracy_of_one(y_true, y_pred):  # the same name in the logs: picked_...
        return (jnp.argmax(y_pred, -1) == y_true).astype(jnp.float32)

    picked_accuracy_of_one.__name__ = "picked_accuracy"

    def fitted(make, loss, metric):
        with strategy.scope():
            trainer = mirrored.Trainer(make(nnx.Rngs(0)), optax.sgd(0.1), loss, [metric])
        history = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history
        return history, trainer.evaluate(x, y, batch_size=16), params_of(trainer.model)

    two = fitted(_TwoOutputs, _on_logits, picked_accuracy)
    one = fitted(
        lambda r: SmallMLP(rngs=r),
        lambda t, p: _on_logits(t, {"logits": p}),
        picked_accuracy_of_one,
    )
    assert two[0] == one[0] and two[1] == one[1]
    for name in one[2]:
        np.testing.assert_array_equal(two[2]["net/" + name], one[2][name])
    with strategy.scope():
        named = mirrored.Trainer(
            _TwoOutputs(nnx.Rngs(0)), optax.sgd(0.1), "sparse_categorical_crossentropy"
        )
    before = params_of(named.model)
    with pytest.raises(ValueError, match=r"one array; found a dict of \['energy', 'logits'\]"):
        named.fit(x, y, batch_size=16, verbose=0)
    assert all(np.array_equal(before[k], params_of(named.model)[k]) for k in before)


def test_batch_size_is_for_arrays_and_a_source_of_batches_keeps_its_own(devices):
    """fit(x, y, batch_size=16, validation_data=<a generator or a list of (x, y) batches>),
    and evaluate / fit of such a source with batch_size=, use the source's batches, as Keras
    (before: an error after the first epoch had trained)."""
    x, y = data(64)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]

    def trainer():
        with mirrored.MirroredStrategy(devices).scope():
            return mirrored.Trainer(
                SmallMLP(rngs=nnx.Rngs(0)),
                optax.sgd(0.1),
                "sparse_categorical_crossentropy",
                from_logits=True,
            )

    histories = []
    for validation in (batches, iter(batches), None):
        fitted = trainer()
        kwargs = {"validation_data": validation} if validation is not None else {}
        histories.append(fitted.fit(x, y, batch_size=16, verbose=0, shuffle=False, **kwargs))
    assert histories[0].history == histories[1].history
    assert histories[0].history["loss"] == histories[2].history["loss"]
    expected = histories[0].history["val_loss"][-1]
    reference = trainer()
    reference.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    assert reference.evaluate(iter(batches), batch_size=16)["loss"] == pytest.approx(expected)
    assert reference.evaluate(batches, batch_size=16)["loss"] == pytest.approx(expected)
    generated = trainer().fit((b for b in batches), batch_size=16, verbose=0).history
    assert generated == trainer().fit(batches, verbose=0).history


def test_steps_per_epoch_reads_on_through_a_source_of_unknown_length(devices, caplog):
    """Keras' generator pattern: steps_per_epoch=3 over an endless generator trains on
    batches 0..8 in three epochs, as over a list of them (before: the generator was refused
    after the first epoch, and a Grain IterDataset trained on batches 0..2 three times); a
    finite generator that runs out interrupts training with Keras' warning."""
    x, y = data(16 * 9)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 16 * 9, 16)]

    def endless():
        while True:
            yield from batches

    def trained(source, epochs=3):
        with mirrored.MirroredStrategy(devices).scope():
            trainer = mirrored.Trainer(
                SmallMLP(rngs=nnx.Rngs(0)),
                optax.sgd(0.1),
                "sparse_categorical_crossentropy",
                from_logits=True,
            )
        history = trainer.fit(source, steps_per_epoch=3, epochs=epochs, verbose=0).history
        return history, params_of(trainer.model)

    listed = trained(batches)
    for source in (endless(), grain.MapDataset.source(batches).to_iter_dataset()):
        ours = trained(source)
        assert ours[0] == listed[0]
        assert all(np.array_equal(ours[1][k], listed[1][k]) for k in listed[1])
    with caplog.at_level("WARNING", logger="mirrored"):
        short = trained(iter(batches[:4]))
    assert len(short[0]["loss"]) == 2  # 3 steps, then 1: the generator is spent
    assert "ran out after 1 of 3 steps in epoch 2; interrupting training" in caplog.text


def test_metrics_none_is_kerass_default(devices):
    """compile(metrics=None) is Keras' default: no metrics (it was refused, "Fix: [None]")."""
    x, y = data(16)
    with mirrored.MirroredStrategy(devices).scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            None,
            weighted_metrics=None,
            from_logits=True,
        )
    assert list(trainer.fit(x, y, batch_size=8, verbose=0).history) == ["loss"]


def test_predict_keeps_input_order_without_padding(devices):
    x, _ = data(50)  # 50 rows over 8 replicas, batch 16: ragged and padded
    _, model, trainer = make_trainer(devices)
    predictions = trainer.predict(x, batch_size=16)
    assert predictions.shape == (50, 5)
    np.testing.assert_allclose(predictions, model(x), rtol=1e-5, atol=1e-6)


def test_history_validation_and_metrics(devices):
    x, y = data(200)
    _, _, trainer = make_trainer(devices, optax.adam(1e-2))
    history = trainer.fit(x, y, batch_size=32, epochs=3, validation_split=0.25, verbose=0)
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.epoch == [0, 1, 2]


def test_checkpoint_saved_on_8_restores_on_2(devices, tmp_path):
    x, y = data(64)
    _, _, trainer = make_trainer(devices, optax.adam(1e-2))
    trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[mirrored.callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="loss")],
    )
    before = trainer.evaluate(x, y)
    _, restored_model, restored = make_trainer(devices[:2], optax.adam(1e-2))
    assert restored.evaluate(x, y) != before
    step = mirrored.restore_checkpoint(tmp_path / "ckpt", restored_model, restored.optimizer)
    assert step == 2
    after = restored.evaluate(x, y)
    np.testing.assert_allclose(after["loss"], before["loss"], rtol=1e-6)
    assert after["accuracy"] == before["accuracy"]
    kernel = restored_model.out.kernel.get_value()
    assert kernel.sharding.device_set == set(devices[:2]) and kernel.sharding.is_fully_replicated


def test_an_unfinished_save_leaves_the_previous_checkpoint_usable(devices, tmp_path):
    _, model, _ = make_trainer(devices)
    mirrored.save_checkpoint(tmp_path, model, step=1)
    # What a crash mid-save leaves: Orbax's temporary directory, never renamed into place.
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "2.orbax-checkpoint-tmp-1234" / "partial").write_bytes(b"\0" * 10)
    _, fresh, _ = make_trainer(devices)
    assert mirrored.restore_checkpoint(tmp_path, fresh) == 1


def test_backup_and_restore_resumes_from_the_chiefs_choice_not_its_own_listing(
    devices, tmp_path, monkeypatch
):
    # A process's own listing of the backup can be stale (a network file system), or taken
    # before the chief deleted a finished fit's backup: every process takes the chief's
    # choice (in a job of several, through jax.distributed's key-value store; the 2-process
    # resume is tests/test_multiworker.py's).
    from mirrored._core import coordination

    x, y = data(64)
    _, _, trainer = make_trainer(devices[:2])
    keep = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    trainer.fit(x, y, batch_size=32, epochs=1, callbacks=[keep], verbose=0)
    seen = os.path.basename(mirrored.latest_checkpoint(tmp_path))  # 2 batch saves, 1 epoch's
    asked = []
    monkeypatch.setattr(coordination, "chiefs", lambda mine, *_, **__: (asked.append(mine), "")[1])
    backup = mirrored.callbacks.BackupAndRestore(tmp_path)
    history = trainer.fit(x, y, batch_size=32, epochs=2, callbacks=[backup], verbose=0)
    assert asked == [seen] == ["3"]  # this process saw step 3; the chief saw none: no resume
    assert len(history.history["loss"]) == 2  # resumed, it would have run epoch 2 alone


@pytest.mark.slow
def test_backup_and_restore_after_sigkill_matches_an_uninterrupted_fit(tmp_path):
    env = subprocess_env()

    def run(backup, out, *extra):
        cmd = ["timeout", "-k", "10", "240", sys.executable, str(HERE / "_fit_script.py")]
        return subprocess.run(
            [*cmd, str(backup), str(out), *extra],
            capture_output=True,
            text=True,
            env=env,
            cwd=HERE,
            check=False,
        )

    clean = run(tmp_path / "clean_backup", tmp_path / "clean.npz")
    assert clean.returncode == 0, clean.stderr
    killed = run(tmp_path / "backup", tmp_path / "killed.npz", "--kill-at", "11")  # epoch 2
    assert killed.returncode == -9, killed.stderr
    assert any((tmp_path / "backup").iterdir())  # a backup survived the crash
    resumed = run(tmp_path / "backup", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr
    expected, got = np.load(tmp_path / "clean.npz"), np.load(tmp_path / "resumed.npz")
    assert set(expected.files) == set(got.files)
    for name in expected.files:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not (tmp_path / "backup").exists()  # deleted after the completed fit


def test_callbacks(devices, tmp_path):
    x, y = data(64)
    _, _, trainer = make_trainer(devices, optax.sgd(0.0))  # lr 0: val_loss never improves
    callbacks = [
        mirrored.callbacks.EarlyStopping(monitor="val_loss", patience=1),
        mirrored.callbacks.CSVLogger(tmp_path / "log.csv"),
        mirrored.callbacks.TensorBoard(tmp_path / "tb"),
        mirrored.callbacks.ModelCheckpoint(tmp_path / "best", save_best_only=True),
    ]
    history = trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=10,
        validation_data=data(32, 1),
        callbacks=callbacks,
        verbose=0,
    )
    # Keras: best at epoch 0; epoch 1 does not improve, wait 1 >= patience 1 stops there.
    assert len(history.epoch) == 2
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert rows[0] == "epoch,accuracy,loss,val_accuracy,val_loss" and len(rows) == 3
    (event_file,) = (tmp_path / "tb" / "train").iterdir()
    scalars = _tensorboard.read_scalars(event_file)
    assert [(s, t) for s, t, _ in scalars if t == "epoch_loss"] == [
        (0, "epoch_loss"),
        (1, "epoch_loss"),
    ]
    np.testing.assert_allclose(
        [v for _, t, v in scalars if t == "epoch_loss"], history.history["loss"], rtol=1e-6
    )
    (val_file,) = (tmp_path / "tb" / "validation").iterdir()
    assert {t for _, t, _ in _tensorboard.read_scalars(val_file)} == {
        "epoch_loss",
        "epoch_accuracy",
    }
    assert os.listdir(tmp_path / "best") == ["1"]  # saved once, at the only improvement


def test_tensorboard_reads_our_event_files(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional and not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = _tensorboard.EventWriter(tmp_path)
    writer.scalar("epoch_loss", 0.5, 3)
    writer.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    (event,) = accumulator.Scalars("epoch_loss")
    assert (event.step, event.value) == (3, 0.5)


def test_progress_prints_one_line_per_epoch_off_a_terminal(devices, capsys):
    x, y = data(64)
    _, _, trainer = make_trainer(devices)
    trainer.fit(x, y, batch_size=16, epochs=2, verbose=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2 and "loss" in lines[0] and "accuracy" in lines[0]
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""


# -- bad input -------------------------------------------------------------------------------------


def test_unknown_loss_lists_the_valid_ones(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="'binary_crossentropy'.*found 'cross_entropy'"):
            mirrored.Trainer(model, optax.sgd(0.1), "cross_entropy")
        with pytest.raises(ValueError, match="found 'f1'"):
            mirrored.Trainer(model, optax.sgd(0.1), "mse", ["f1"])


def test_labels_that_do_not_fit_the_loss(devices):
    x, y = data(32)
    _, _, trainer = make_trainer(devices)
    one_hot = np.eye(5, dtype=np.float32)[y]
    with pytest.raises(
        ValueError, match="class-index labels of shape \\(4,\\).*'categorical_crossentropy'"
    ):
        trainer.fit(x, one_hot, batch_size=32, verbose=0)


@pytest.mark.parametrize("split", [-0.1, 1.0, 1.5])
def test_validation_split_outside_range(devices, split):
    x, y = data(32)
    _, _, trainer = make_trainer(devices)
    with pytest.raises(ValueError, match=r"validation_split in \[0, 1\)"):
        trainer.fit(x, y, validation_split=split, verbose=0)


def test_fit_outside_the_scope_is_fine_but_state_from_outside_is_not(devices):
    x, y = data(32)
    _, _, trainer = make_trainer(devices)
    trainer.fit(x, y, batch_size=16, verbose=0)  # not inside strategy.scope(): fine
    strategy = mirrored.MirroredStrategy(devices)
    outside = SmallMLP(rngs=nnx.Rngs(0))
    with strategy.scope(), pytest.raises(ValueError, match=r"the model\.hidden\.bias .*outside"):
        mirrored.Trainer(outside, optax.sgd(0.1), "mse")


@pytest.mark.parametrize("replicas", [1, 8])
def test_steps_per_epoch_continues_through_the_data_as_keras(devices, replicas, caplog):
    """Keras' EpochIterator: with steps_per_epoch, epochs continue through the data; an epoch
    that reaches the end of a pass stops there, and the next starts a new pass (issue 33, 4).
    20 rows at batch 8 are batches [0, 1], [2] (4 rows, ragged), [0, 1], [2]; mirrored
    restarted at batch 0 every epoch and never saw the last 4 rows."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(20, 4)).astype(np.float32)
    y = rng.normal(size=(20, 1)).astype(np.float32)
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        w, b = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
        trainer = mirrored.Trainer(model, optax.sgd(0.1), loss="mse")
    with caplog.at_level("WARNING", logger="mirrored"):
        trainer.fit(x, y, batch_size=8, epochs=4, steps_per_epoch=2, shuffle=False, verbose=0)

    # Plain JAX: SGD on the batch mean of the squared error, batches in Keras' order.
    def loss(params, xb, yb):
        return jax.numpy.mean((xb @ params[0] + params[1] - yb) ** 2)

    params = (w, b)
    for i in [0, 1, 2, 0, 1, 2]:
        xb, yb = x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8]
        grads = jax.grad(loss)(params, xb, yb)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), params[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), params[1], rtol=1e-5, atol=1e-6)
    short = [
        r.getMessage() for r in caplog.records if "ran out after 1 of 2 steps" in r.getMessage()
    ]
    assert len(short) == 2  # epochs 2 and 4 end with their pass, as Keras warns
