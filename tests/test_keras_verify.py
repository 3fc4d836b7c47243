"""Proof of distribution for Keras (issue 20): `mirrored.verify` and `mirrored doctor --step`
on a Keras custom step (state captured by closure) and on a compiled model's `fit` step."""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import mirrored
import mirrored.keras
from _helpers import subprocess_env

RNG = np.random.default_rng(0)
X = RNG.normal(size=(200, 20)).astype("float32")
Y = RNG.integers(0, 10, 200).astype("int32")


def _model(*, dropout=0.0, norm=False):
    keras.utils.set_random_seed(1)
    layers = [keras.layers.Dense(32, activation="relu")]  # no input shape: built by a call
    if norm:
        layers.append(keras.layers.BatchNormalization())
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def _custom_step(strategy, *, hand_mean=False, dropout=0.0, norm=False):
    """The seeds' step: model, optimizer and loss captured by closure, created in the scope."""
    with strategy.scope():
        model = _model(dropout=dropout, norm=norm)
        optimizer = keras.optimizers.SGD(0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(inputs, labels):
        def compute_loss():
            logits = model(inputs, training=True)
            if hand_mean:  # averaged over the replica's own rows: N× gradients
                return keras.ops.mean(
                    keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
                )
            return loss_fn(labels, logits)

        loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    (batch,) = strategy.experimental_distribute_dataset([(X[:64], Y[:64])])
    return model, optimizer, train_step, batch


def _statuses(report):
    return {c.name: c.status for c in report.checks}


def test_a_keras_custom_step_passes_every_check_and_leaves_the_model_untouched(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model, optimizer, step, batch = _custom_step(strategy, dropout=0.3, norm=True)
    assert not model.built  # the check builds it, mirrored, as the first step would
    report = mirrored.verify(strategy, step, batch, expected_replicas=8, scaling=True)
    assert report.ok, report.to_json()
    statuses = _statuses(report)
    # Plain BatchNormalization on 8 rows per replica: said, as a warning (issue 33, item 8).
    assert statuses.pop("BatchNorm batch size") == "WARN"
    assert set(statuses.values()) <= {"PASS", "INFO"}, statuses
    assert report["Collectives"].data["all_reduce_ops"] >= 1
    assert model.built and int(optimizer.iterations.value) == 0
    before = [w.copy() for w in model.get_weights()]
    report = mirrored.verify(strategy, step, batch)  # the checks ran on copies
    assert report.ok
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    # The step still trains for real afterwards, with its dropout on.
    strategy.run(step, args=batch)
    assert int(optimizer.iterations.value) == 1
    assert not np.array_equal(before[0], model.get_weights()[0])


def test_a_per_replica_mean_loss_in_a_keras_step_is_named_as_8x_gradients(devices):
    strategy = mirrored.MirroredStrategy(devices)
    _, _, step, batch = _custom_step(strategy, hand_mean=True)
    check = mirrored.verify(strategy, step, batch)["Single-device equivalence"]
    assert check.status == "FAIL"
    assert check.summary == "updates are 8.0× too large compared with one device"
    assert "compute_average_loss" in check.explanation


def test_keras_state_created_outside_the_scope_fails_the_devices_check(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model = _model()
    model.build((None, 20))  # on one device
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    (batch,) = strategy.experimental_distribute_dataset([(X[:64], Y[:64])])
    report = mirrored.verify(strategy, lambda x, y: loss_fn(y, model(x)), batch)
    check = report["Devices"]
    assert check.status == "FAIL" and not report.ok
    assert "created outside strategy.scope()" in check.explanation
    assert "dense" in check.explanation  # the variable is named


@pytest.mark.parametrize("replicas", [8, 1])
def test_a_compiled_keras_models_fit_step_is_verified(devices, replicas):
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        model = _model(dropout=0.2)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    report = mirrored.verify(strategy, model, (X, Y), batch_size=64)
    assert report.ok, report.to_json()
    assert _statuses(report)["Single-device equivalence"] == "PASS"
    if replicas > 1:
        # The loss tracker's and the accuracy's sums travel with the gradients (none waits
        # for them), not in an all-reduce of their own after them; the dropout layer's
        # advanced seed state (uint32) is the second.
        assert report["Collectives"].data["all_reduce_ops"] == 2
    assert report["Input"].data["steps_per_epoch"] == 4  # 200 at 64: 3 full + 8
    assert report["Input"].data["last_batch"] == 8
    assert int(model.optimizer.iterations.value) == 0  # fit has not started
    model.fit(X, Y, batch_size=64, epochs=1, verbose=0)  # and fit still runs afterwards
    assert int(model.optimizer.iterations.value) == 4


def test_verify_of_a_keras_model_built_outside_the_scope_fails_with_tensorflows_error(devices):
    model = _model()
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.build((None, 20))
    report = mirrored.verify(mirrored.MirroredStrategy(devices), model, (X, Y))
    assert report["Devices"].status == "FAIL"
    assert "was not created in the distribution strategy scope" in report["Devices"].explanation


def test_batch_size_is_only_for_a_keras_model(devices):
    strategy = mirrored.MirroredStrategy(devices)
    _, _, step, batch = _custom_step(strategy)
    with pytest.raises(TypeError, match="batch_size only with a compiled Keras model"):
        mirrored.verify(strategy, step, batch, batch_size=64)
    with pytest.raises(TypeError, match="expected a compiled Keras model"):
        mirrored.verify(strategy, _model(), (X, Y))


def test_doctor_checks_a_keras_step_file_and_a_keras_fit_file(tmp_path):
    (tmp_path / "keras_steps.py").write_text(
        "import os\n"
        "os.environ.setdefault('KERAS_BACKEND', 'jax')\n"
        "import keras, numpy as np, mirrored, mirrored.keras\n"
        "rng = np.random.default_rng(0)\n"
        "x = rng.normal(size=(100, 6)).astype('float32')\n"
        "y = rng.integers(0, 3, 100).astype('int32')\n"
        "def build(strategy):\n"
        "    with strategy.scope():\n"
        "        model = keras.Sequential([keras.layers.Dense(8, activation='relu'),\n"
        "                                  keras.layers.Dense(3)])\n"
        "        model.compile(optimizer=keras.optimizers.SGD(0.1),\n"
        "            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
        "    return model\n"
        "def fit():\n"
        "    strategy = mirrored.MirroredStrategy()\n"
        "    return strategy, build(strategy), (x, y)\n"
        "def step():\n"
        "    strategy = mirrored.MirroredStrategy()\n"
        "    model = build(strategy)\n"
        "    def train_step(inputs, labels):\n"
        "        def compute_loss():\n"
        "            per_example = keras.losses.sparse_categorical_crossentropy(\n"
        "                labels, model(inputs, training=True), from_logits=True)\n"
        "            return keras.ops.mean(per_example)  # per replica: wrong\n"
        "        loss, grads = mirrored.keras.value_and_grad(compute_loss,\n"
        "                                                    model.trainable_variables)\n"
        "        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))\n"
        "        return loss\n"
        "    (batch,) = strategy.experimental_distribute_dataset([(x[:32], y[:32])])\n"
        "    return strategy, train_step, batch\n"
    )
    env = subprocess_env()

    def doctor(*args):
        command = [sys.executable, "-m", "mirrored.cli", "doctor", "--devices", "4"]
        return subprocess.run(
            ["timeout", "-k", "10", "240", *command, "--no-scaling", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path.parent,  # not the file's folder
            env=env,
            check=False,
        )

    fit = doctor("--step", f"{tmp_path}/keras_steps.py:fit", "--batch-size", "50", "--json")
    assert fit.returncode == 0, fit.stdout + fit.stderr
    checks = {c["name"]: c for c in json.loads(fit.stdout)["checks"]}
    assert checks["Single-device equivalence"]["status"] == "PASS"
    assert checks["Input"]["data"] == {
        "global_batch": 50,
        "per_replica_batch": 13,
        "replicas": 4,
        "dataset_size": 100,
        "steps_per_epoch": 2,
        "last_batch": None,
    }
    wrong = doctor("--step", f"{tmp_path}/keras_steps.py:step")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert "4.0× too large" in wrong.stdout
