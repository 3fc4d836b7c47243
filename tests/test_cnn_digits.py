"""The CNN example (issue 13): BatchNorm and Dropout on 8 replicas, in a custom loop and in
`fit`, synchronized BatchNorm equal to one device, checkpoints that resume exactly."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import assert_bit_identical_on_devices
from mirrored._cli import doctor as _doctor

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cnn_digits.py"
_spec = importlib.util.spec_from_file_location("cnn_digits", EXAMPLE)
assert _spec is not None and _spec.loader is not None
cnn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cnn)


@pytest.fixture(scope="module")
def strategy():
    return mirrored.MirroredStrategy(jax.devices())


@pytest.fixture(scope="module")
def data():
    return cnn.load_data()


def _params(model):
    return {
        path: np.asarray(v.get_raw_value())
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
    }


def test_the_script_trains_to_high_test_accuracy_with_a_custom_loop(capsys):
    accuracy = cnn.main(["--epochs", "5"])
    out = capsys.readouterr().out
    assert "replicas: 8" in out and "epoch 5/5" in out
    assert f"test accuracy: {accuracy:.4f}" in out
    assert accuracy > 0.95


def test_fit_trains_to_high_test_accuracy(strategy, data):
    assert cnn.train_fit(strategy, 5, data=data) > 0.95


def test_sync_batchnorm_on_8_replicas_equals_one_device_ragged_batch_included(strategy, data):
    x, y = data[0][:165], data[1][:165]  # batches of 64, 64 and a ragged 37
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 165, 64)]
    with strategy.scope():
        model = cnn.CNN(sync_bn=True, dropout=0.0, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(cnn.train_step, args=(model, optimizer, xb, yb))

    reference = cnn.CNN(sync_bn=False, dropout=0.0, rngs=nnx.Rngs(0))  # one device, no strategy
    ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def reference_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for xb, yb in batches:
        reference_step(reference, ref_optimizer, jnp.asarray(xb), jnp.asarray(yb))
    ours, theirs = _params(model), _params(reference)
    assert ours.keys() == theirs.keys()
    assert max(float(np.max(np.abs(ours[k] - theirs[k]))) for k in ours) <= 1e-5
    assert_bit_identical_on_devices(model)


def test_a_checkpoint_written_mid_training_resumes_to_identical_parameters(
    strategy, data, tmp_path, capsys
):
    small = (data[0][:200], data[1][:200], None, None)  # 4 batches, the last one ragged
    uninterrupted, _ = cnn.train_custom(strategy, 3, data=small)
    cnn.train_custom(strategy, 2, checkpoint_dir=tmp_path, data=small)  # "crashes" after 2
    assert mirrored.latest_checkpoint(tmp_path) == str(tmp_path / "2")
    assert mirrored.checkpoint_extras(tmp_path) == {"epoch": 2}
    resumed, _ = cnn.train_custom(strategy, 3, checkpoint_dir=tmp_path, data=small)
    assert "resumed after epoch 2" in capsys.readouterr().out
    ours, theirs = _params(resumed), _params(uninterrupted)
    for key in theirs:  # Dropout's random keys and counts were restored too: bit-identical
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=str(key))
    np.testing.assert_array_equal(
        jax.random.key_data(resumed.dropout.rngs.key[...]),
        jax.random.key_data(uninterrupted.dropout.rngs.key[...]),
    )


def test_doctor_step_of_the_cnn_passes_verify():
    """What `mirrored doctor --step examples/cnn_digits.py:doctor_step` runs: BatchNorm per
    replica and Dropout on raise no false alarm."""
    strategy, step, args = _doctor.user_step(f"{EXAMPLE}:doctor_step")
    report = mirrored.verify(strategy, step, args, steps=2)
    assert report.ok, report.to_json()
    assert report["Single-device equivalence"].status == "PASS"
    assert report["Replicas in sync"].status == "PASS"
