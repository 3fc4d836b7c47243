"""The transformer language model of examples/transformer_lm.py: it learns, 8 replicas train it
exactly as 1 device does (ragged batch included), and the script runs end to end."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import assert_bit_identical_on_devices, params_of, subprocess_env
from mirrored._cli import doctor as _doctor

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    """examples/ is not a package: load the script as a module, as a user's copy would be."""
    spec = importlib.util.spec_from_file_location(
        "transformer_lm", ROOT / "examples/transformer_lm.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lm = _load_example()

# Measured: 2.30 nats/char after 100 steps; the held-out text's unigram entropy is 3.13.
TRAIN_STEPS = 100
BOUND = 2.6


@pytest.fixture(scope="module")
def data():
    return lm.char_dataset(lm.load_text())


def _unigram_entropy(tokens):
    """Independent of the example's helper: any model that ignores context pays at least this."""
    p = np.bincount(tokens) / len(tokens)
    return float(-np.sum(p[p > 0] * np.log(p[p > 0])))


def test_the_example_trains_below_the_bound_end_to_end(data):
    """The script as a user starts it: 8 replicas, dropout on, held-out loss with dropout off."""
    _, held_out, _ = data
    entropy = _unigram_entropy(held_out)
    assert entropy == pytest.approx(lm.unigram_entropy(held_out))
    assert entropy > BOUND + 0.4  # the bound is clearly below what no context can reach
    script = ["examples/transformer_lm.py", "--steps", str(TRAIN_STEPS)]
    result = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, *script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "replicas: 8" in result.stdout
    assert f"unigram baseline {entropy:.4f}" in result.stdout
    loss = float(re.search(r"^final loss: ([0-9.]+)$", result.stdout, re.M).group(1))
    assert loss < BOUND, result.stdout


def _plain_sgd(vocab, x, y):
    """The reference, without mirrored: nnx.jit SGD on each global batch's mean loss."""
    model = lm.TransformerLM(vocab, dropout=0.0, rngs=nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda model: lm.per_sequence_loss(model, x, y).mean())(model)
        optimizer.update(model, grads)

    for i in range(0, len(x), 16):
        step(model, optimizer, x[i : i + 16], y[i : i + 16])
    return params_of(model)


def test_eight_replicas_equal_plain_sgd_on_one_device_with_a_ragged_batch(data):
    train, _, vocab = data
    # 77 windows at global batch 16: four full batches, then 13 rows (not divisible by 8).
    x, y = lm.windows(train[: 77 * lm.SEQ_LEN + 1])
    assert len(x) == 77
    expected = _plain_sgd(len(vocab), x, y)
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = lm.TransformerLM(len(vocab), dropout=0.0, rngs=nnx.Rngs(1))
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    start = params_of(model)
    for xb, yb in strategy.experimental_distribute_dataset((x, y), batch_size=16):
        strategy.run(lm.train_step, args=(model, optimizer, xb, yb))
    got = params_of(model)
    assert_bit_identical_on_devices(model)
    assert max(np.max(np.abs(expected[k] - start[k])) for k in start) > 1e-2  # SGD moved them
    difference = max(np.max(np.abs(expected[k] - got[k])) for k in start)
    assert difference <= 1e-5, difference


def test_doctor_step_of_the_transformer_passes_verify():
    """What `mirrored doctor --step examples/transformer_lm.py:doctor_step` runs: Dropout and
    attention dropout on raise no false alarm (verify compares with them off)."""
    strategy, step, args = _doctor.user_step(f"{ROOT}/examples/transformer_lm.py:doctor_step")
    report = mirrored.verify(strategy, step, args, steps=1)
    assert report.ok, report.to_json()
    assert report["Single-device equivalence"].status == "PASS"
    assert report["Replicas in sync"].status == "PASS"
