"""Flax's MNIST tutorial as written, under mirrored (issue 19): examples/flax_mnist_tutorial.py."""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import assert_bit_identical_on_devices
from mirrored._nnx import batch_norm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_mnist_tutorial.py"
_spec = importlib.util.spec_from_file_location("flax_mnist_tutorial", EXAMPLE)
assert _spec is not None and _spec.loader is not None
tutorial = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tutorial)


def test_the_tutorial_trains_to_high_test_accuracy(capsys):
    history = tutorial.main(["--train-steps", "150", "--eval-every", "75"])  # 97.8%
    out = capsys.readouterr().out
    assert "replicas: 8" in out and "[test] step: 149" in out
    assert history["test_accuracy"][-1] > 0.95
    assert all(0 < a <= 1 for a in history["train_accuracy"])


def _plain_five_steps(batches):
    """The reference, without mirrored: the tutorial's step under nnx.jit on each global batch
    (mean loss, BatchNorm on the batch's statistics, dropout off), metrics in NumPy, computed in
    float64 (the model's float32 initial values, cast): the numbers float32 approximates. Plain
    Flax on one device in float32 is itself 1.7e-4 away from them after 5 steps (BatchNorm's
    variance as E[x²] − E[x]² cancels on these activations); 8 replicas are 2e-7 away."""
    with jax.enable_x64(True):
        model = tutorial.CNN(rngs=nnx.Rngs(0))
        as_float64 = lambda x: np.asarray(x, np.float64) if x.dtype == np.float32 else x  # noqa: E731
        nnx.update(model, jax.tree.map(as_float64, nnx.state(model)))
        optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        train_model = nnx.view(model, deterministic=True, use_running_average=False)

        @nnx.jit
        def step(model, optimizer, images, labels):
            def loss_fn(model):
                logits = model(images)
                per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
                return per_example.mean(), (logits, per_example)

            (_, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
            optimizer.update(model, grads)
            return aux

        logits, losses = zip(
            *(
                step(train_model, optimizer, b["image"].astype(np.float64), b["label"])
                for b in batches
            ),
            strict=True,
        )
        labels = np.concatenate([b["label"] for b in batches])
        accuracy = float(np.mean(np.concatenate(logits).argmax(-1) == labels))
        metrics = {"accuracy": accuracy, "loss": float(np.mean(np.concatenate(losses)))}
        return _state(model, nnx.Param), _state(model, nnx.BatchStat), metrics


def _five_steps(strategy, batches):
    with strategy.scope():
        model = tutorial.CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        rngs = nnx.Rngs(0)
    # Dropout off and BatchNorm on global statistics: one device's numbers are defined.
    train_model = nnx.view(model, deterministic=True, use_running_average=False)
    with batch_norm.synchronized_batch_norm():
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(tutorial.train_step, args=(train_model, optimizer, metrics, rngs, batch))
    return model, {k: float(v) for k, v in metrics.compute().items()}


def _state(model, kind):
    flat = nnx.to_flat_state(nnx.state(model, kind))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def test_eight_replicas_equal_plain_nnx_over_five_tutorial_steps_statistics_and_metrics_included():
    train, _ = tutorial.load_dataset()
    batches = tutorial.batches(train, 32, steps=5)
    their_params, their_stats, their_metrics = _plain_five_steps(batches)
    ours, our_metrics = _five_steps(mirrored.MirroredStrategy(jax.devices()), batches)
    # BatchNorm's moving mean and variance too
    for kind, b in ((nnx.Param, their_params), (nnx.BatchStat, their_stats)):
        a = _state(ours, kind)
        assert set(a) == set(b) and a, kind
        assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-5, kind
    for name in ("accuracy", "loss"):
        assert our_metrics[name] == pytest.approx(their_metrics[name], abs=1e-5)
    assert_bit_identical_on_devices(ours)


def test_trainer_evaluate_matches_the_tutorials_eval_view():
    """`Trainer` switches the model to eval mode for `evaluate` (`model.eval()`): the same
    numbers as the tutorial's `nnx.view(model, deterministic=True, use_running_average=True)`."""
    train, test = tutorial.load_dataset()
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = tutorial.CNN(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.adamw(0.005, 0.9),
            "sparse_categorical_crossentropy",
            from_logits=True,
            metrics=["accuracy"],
            rngs=nnx.Rngs(0),
        )
    trainer.fit(train["image"][:128], train["label"][:128], batch_size=32, epochs=1, verbose=0)
    images, labels = test["image"][:100], test["label"][:100]  # 100 = 3 × 32 + 4: ragged
    logs = trainer.evaluate(images, labels, batch_size=32)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)
    logits = np.asarray(eval_model(images))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    assert logs["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert logs["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == labels)), abs=1e-6)
