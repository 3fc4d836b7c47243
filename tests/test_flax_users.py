"""A Flax user's code as written (issue 19): decorated steps and Flax metrics under run."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import params_of

RNG = np.random.default_rng(0)
X = RNG.normal(size=(21, 4)).astype(np.float32)  # batches of 8, 8 and a ragged 5
Y = RNG.integers(0, 3, 21).astype(np.int32)


def plain_step(model, optimizer, metrics, x, y):
    def loss_fn(model):
        logits = model(x)
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return mirrored.compute_average_loss(per_example), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=y)  # Flax's tutorial, inside the step
    optimizer.update(model, grads)


DECORATED = {
    "undecorated": plain_step,
    "nnx.jit": nnx.jit(plain_step),
    "jax.jit": jax.jit(plain_step),
    "partial(nnx.jit, donate_argnums)": functools.partial(nnx.jit, donate_argnums=(0, 1))(
        plain_step
    ),
}


def _train(step):
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.3), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    batches = [(X[i : i + 8], Y[i : i + 8]) for i in range(0, 21, 8)]
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(model, optimizer, metrics, x, y))
    return params_of(model), {k: float(v) for k, v in metrics.compute().items()}


@pytest.fixture(scope="module")
def reference():
    return _train(plain_step)


@pytest.mark.parametrize("name", [n for n in DECORATED if n != "undecorated"])
def test_a_decorated_step_runs_as_the_undecorated_one(name, reference):
    params, metrics = _train(DECORATED[name])
    for key in reference[0]:
        np.testing.assert_array_equal(params[key], reference[0][key])
    assert metrics == reference[1]
    assert 0 <= metrics["accuracy"] <= 1


def test_evaluate_predict_and_fits_validation_call_keras_hooks():
    calls = []

    class Recorder(mirrored.callbacks.Callback):
        def on_test_begin(self, logs=None):
            calls.append("test_begin")

        def on_test_end(self, logs=None):
            calls.append("test_end")

        def on_test_batch_begin(self, batch, logs=None):
            calls.append(("test_batch_begin", batch))

        def on_test_batch_end(self, batch, logs=None):
            calls.append(("test_batch_end", batch, round(logs["loss"], 4) > 0))

        def on_predict_begin(self, logs=None):
            calls.append("predict_begin")

        def on_predict_batch_end(self, batch, logs=None):
            calls.append(("predict_batch", batch, tuple(logs["outputs"].shape)))

        def on_predict_end(self, logs=None):
            calls.append("predict_end")

    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(model, optax.sgd(0.1), "sparse_categorical_crossentropy")
    trainer.evaluate(X, Y, batch_size=16, callbacks=[Recorder()])
    trainer.predict(X, batch_size=16, callbacks=[Recorder()])
    test_run = [
        "test_begin",
        ("test_batch_begin", 0),
        ("test_batch_end", 0, True),
        ("test_batch_begin", 1),
        ("test_batch_end", 1, True),
        "test_end",
    ]
    assert calls == [
        *test_run,
        "predict_begin",
        ("predict_batch", 0, (16, 3)),
        ("predict_batch", 1, (5, 3)),  # the ragged tail: its real rows only
        "predict_end",
    ]
    calls.clear()  # fit's validation: one test run per epoch, after its training batches
    trainer.fit(X, Y, batch_size=16, epochs=2, validation_data=(X, Y), callbacks=[Recorder()])
    assert calls == test_run * 2


def test_doctor_step_imports_its_sibling_and_checks_a_dict_batch(tmp_path, monkeypatch):
    from mirrored._cli import doctor as _doctor

    project = tmp_path / "project"
    project.mkdir()
    (project / "my_model.py").write_text(
        "from flax import nnx\n\n"
        "class Net(nnx.Module):\n"
        "    def __init__(self):\n"
        "        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))\n\n"
        "    def __call__(self, batch):\n"
        "        return self.dense(batch['image'])\n"
    )
    (project / "my_step.py").write_text(
        "import numpy as np, optax\n"
        "from flax import nnx\n"
        "import mirrored\n"
        "from my_model import Net  # a module beside this file\n\n"
        "def step(model, optimizer, batch):\n"
        "    def loss_fn(model):\n"
        "        per_example = optax.softmax_cross_entropy_with_integer_labels(\n"
        "            model(batch), batch['label'])\n"
        "        return mirrored.compute_average_loss(per_example)\n"
        "    optimizer.update(model, nnx.grad(loss_fn)(model))\n\n"
        "def make():\n"
        "    strategy = mirrored.MirroredStrategy()\n"
        "    with strategy.scope():\n"
        "        model = Net()\n"
        "        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)\n"
        "    rng = np.random.default_rng(0)\n"
        "    data = {'image': rng.normal(size=(32, 4)).astype(np.float32),\n"
        "            'label': rng.integers(0, 3, 32).astype(np.int32)}\n"
        "    (batch,) = list(strategy.experimental_distribute_dataset([data]))\n"
        "    return strategy, step, (model, optimizer, batch)\n"
    )
    monkeypatch.chdir(tmp_path)  # not the file's folder
    strategy, step, args = _doctor.user_step(f"{project}/my_step.py:make")
    report = mirrored.verify(strategy, step, args, steps=1)
    assert report.ok, report.to_json()
    for name in ("Single-device equivalence", "Replicas in sync"):
        assert report[name].status == "PASS", name
    assert report["Input"].status == "INFO"  # 32 global on 8 replicas: a hint, not a warning
    assert str(project) not in __import__("sys").path


class CallTimeDropout(nnx.Module):
    """Flax's tutorial style: Dropout without its own stream, rngs given at call time."""

    def __init__(self):
        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, rngs=None):
        return self.dense(self.dropout(x, rngs=rngs))


def _fit_with_rngs(seed, replicas=8):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        model = CallTimeDropout()
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.3),
            "sparse_categorical_crossentropy",
            from_logits=True,
            rngs=nnx.Rngs(dropout=seed),
        )
    trainer.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return trainer, params_of(model)


def test_call_time_rngs_in_fit_differ_per_replica_repeat_from_the_seed_and_stay_out_of_eval():
    trainer, first = _fit_with_rngs(1)
    _, again = _fit_with_rngs(1)
    _, other = _fit_with_rngs(2)
    for key in first:
        np.testing.assert_array_equal(first[key], again[key])  # reproducible from the seed
    assert any(not np.array_equal(first[k], other[k]) for k in first)  # the seed matters
    assert int(trainer.rngs.dropout.count[...]) == 6  # one draw per step: 3 steps × 2 epochs
    # evaluate and predict: eval mode, no rngs, deterministic
    a, b = trainer.evaluate(X, Y), trainer.evaluate(X, Y)
    assert a == b
    np.testing.assert_allclose(trainer.predict(X), np.asarray(trainer.model(X)), atol=1e-6)


def test_rngs_must_be_nnx_rngs():
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope(), pytest.raises(TypeError, match="Expected rngs to be an nnx.Rngs"):
        mirrored.Trainer(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), optax.sgd(0.1), "mse", rngs=0)


class _Recurrent(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 6, rngs=rngs)
        self.lstm = nnx.RNN(nnx.LSTMCell(6, 5, rngs=rngs))
        self.gru = nnx.RNN(nnx.GRUCell(5, 4, rngs=rngs), reverse=True, keep_order=True)
        self.out = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, tokens):
        return self.out(self.gru(self.lstm(self.embed(tokens)))[:, -1])


def test_flax_recurrent_layers_train_on_8_replicas_as_on_one_device(devices):
    """nnx.RNN's zero carry is the same on every replica and its scan's output carry is not:
    JAX refused the step ("carry input and carry output must have equal types")."""
    tokens = RNG.integers(0, 20, size=(21, 6)).astype(np.int32)
    batches = [(tokens[i : i + 8], Y[i : i + 8]) for i in range(0, 21, 8)]

    def step(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    model = _Recurrent(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    jitted = nnx.jit(step)
    for x, y in batches:  # one device: compute_average_loss outside run divides by the batch
        jitted(model, optimizer, x, y)
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        ours = _Recurrent(nnx.Rngs(0))
        ours_optimizer = nnx.Optimizer(ours, optax.sgd(0.5), wrt=nnx.Param)
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(ours, ours_optimizer, x, y))
    expected, got = params_of(model), params_of(ours)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, atol=1e-6, err_msg=name)
