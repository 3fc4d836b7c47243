"""Several steps per dispatch (issue 15): `strategy.run_steps` runs K steps of a distributed
iterator in one program, equal to K calls of `strategy.run`, ragged last batch included."""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import (
    SmallMLP,
    adam_trainer,
    assert_bit_identical_on_devices,
    global_batches,
    params_of,
)
from _helpers import train_step as mlp_step  # any classifier's step: the CNN's too

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_mnist_tutorial.py"
_spec = importlib.util.spec_from_file_location("flax_mnist_tutorial_steps", EXAMPLE)
assert _spec is not None and _spec.loader is not None
tutorial = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tutorial)

BATCHES = global_batches(7, 64)
BATCHES[-1] = (BATCHES[-1][0][:13], BATCHES[-1][1][:13])  # ragged: 13 rows on 8 replicas


def _max_diff(a, b):
    pa, pb = params_of(a), params_of(b)
    return max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)


def _state(strategy, make_tx):
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_tx(), wrt=nnx.Param)


@pytest.mark.parametrize("replicas", [8, 1])
@pytest.mark.parametrize("make_tx", [lambda: optax.sgd(0.1), lambda: optax.adam(0.01)])
def test_k_steps_in_one_program_equal_k_runs_ragged_last_batch_included(replicas, make_tx):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    dataset = strategy.experimental_distribute_dataset(BATCHES)
    model, optimizer = _state(strategy, make_tx)
    expected = [
        float(strategy.reduce("SUM", strategy.run(mlp_step, args=(model, optimizer, *b)), None))
        for b in dataset
    ]
    ours, our_optimizer = _state(strategy, make_tx)
    iterator = iter(dataset)
    losses = []
    while (
        out := strategy.run_steps(mlp_step, iterator, steps=3, args=(ours, our_optimizer))
    ) is not None:
        losses.append(np.asarray(strategy.reduce("SUM", out, axis=None)))
    assert [len(x) for x in losses] == [3, 3, 1]  # 7 batches: the last call runs the one left
    np.testing.assert_allclose(np.concatenate(losses), expected, rtol=0, atol=1e-6)
    assert _max_diff(ours, model) <= 1e-6
    assert int(our_optimizer.step[...]) == 7
    assert_bit_identical_on_devices(ours)


@pytest.mark.parametrize("replicas", [8, 1])
def test_run_steps_over_in_memory_arrays_gathers_k_batches_at_once_with_the_same_numbers(
    replicas,
):
    """`iter(dataset)` of shuffled in-memory arrays hands run_steps K batches gathered at once
    (fit's input path): the losses and model of one strategy.run per batch, bit for bit, the
    ragged last batch included, also when the loop mixes next(), run_steps and another K."""
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    x = np.concatenate([b[0] for b in BATCHES])  # 397 rows: 6 batches of 64 and 13 left
    y = np.concatenate([b[1] for b in BATCHES])
    dataset = strategy.experimental_distribute_dataset((x, y), batch_size=64, shuffle=True, seed=3)

    def sgd():
        return optax.sgd(0.1)

    model, optimizer = _state(strategy, sgd)
    reference = list(dataset)  # epoch 1: the batches every loop below must see
    expected = [
        float(strategy.reduce("SUM", strategy.run(mlp_step, args=(model, optimizer, *b)), None))
        for b in reference
    ]

    def loop(plan):
        """Epoch 1 again, read as `plan` says: an int K is run_steps(K), 0 is next()."""
        dataset._epoch = 0
        ours, our_optimizer = _state(strategy, sgd)
        iterator, losses, kinds = iter(dataset), [], []
        for k in plan:
            if k == 0:
                batch = next(iterator)
                out = strategy.run(mlp_step, args=(ours, our_optimizer, *batch))
                losses.append(float(strategy.reduce("SUM", out, None)))
                continue
            out = strategy.run_steps(mlp_step, iterator, steps=k, args=(ours, our_optimizer))
            if out is None:
                losses.append(None)
                continue
            kinds.append(iterator._steps)
            losses.extend(np.asarray(strategy.reduce("SUM", out, None)).tolist())
        with pytest.raises(StopIteration):
            next(iterator)
        return losses, ours, kinds

    for plan in ([3, 3, 3, 3], [0, 2, 0, 2, 5, 4]):
        losses, ours, kinds = loop(plan)
        assert losses[: len(expected)] == expected
        assert losses[len(expected) :] == [None]  # the epoch's end, said once
        assert kinds == [k for k in plan if k][: len(kinds)]  # K batches at once each time
        mine, theirs = params_of(ours), params_of(model)
        for name in theirs:
            np.testing.assert_array_equal(mine[name], theirs[name])


def test_the_flax_tutorial_step_dropout_batchnorm_and_metrics_inside_equal_k_runs():
    """`@nnx.jit` step, Dropout drawing per replica and per step, BatchNorm's moving
    statistics and `nnx.MultiMetric` updated inside: K steps in one program = K runs."""
    strategy = mirrored.MirroredStrategy()
    train, _ = tutorial.load_dataset()
    batches = tutorial.batches(train, 32, steps=4)

    def state():
        with strategy.scope():
            model = tutorial.CNN(rngs=nnx.Rngs(0))
            # SGD: Adam turns the last bits of rounding (another fusion) into lr-sized steps.
            optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
            metrics = nnx.MultiMetric(
                accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
            )
            rngs = nnx.Rngs(0)
        view = nnx.view(model, deterministic=False, use_running_average=False)
        return model, (view, optimizer, metrics, rngs)

    reference, args = state()
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(tutorial.train_step, args=(*args, batch))
    expected = args[2].compute()
    ours, our_args = state()
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    # The step returns nothing: () when steps ran, None once the iterator is exhausted.
    assert strategy.run_steps(tutorial.train_step, iterator, steps=4, args=our_args) == ()
    assert strategy.run_steps(tutorial.train_step, iterator, steps=4, args=our_args) is None
    assert _max_diff(ours, reference) <= 1e-6
    moving = nnx.state(ours, nnx.BatchStat)
    for a, b in zip(
        jax.tree.leaves(moving), jax.tree.leaves(nnx.state(reference, nnx.BatchStat)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for name, value in our_args[2].compute().items():
        assert float(value) == pytest.approx(float(expected[name]), abs=1e-6)


class _TinyCNN(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.out = nnx.Linear(4 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.conv(x)).reshape(x.shape[0], -1))


@pytest.mark.parametrize("replicas", [8, 1])
def test_a_convolution_steps_run_one_program_each_on_cpu_with_run_steps_numbers(replicas, caplog):
    """XLA:CPU runs convolutions slower inside one program of K steps (issue 39: 0.74x at one
    device, unrolled): such steps run as K calls of one step's program, said once in the log,
    with the outputs and state of K runs, bit for bit, ragged last batch included."""
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n))
        for n in (16, 16, 16, 11)
    ]
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    dataset = strategy.experimental_distribute_dataset(batches)

    def state():
        with strategy.scope():
            model = _TinyCNN(nnx.Rngs(0))
            return model, nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)

    model, optimizer = state()
    expected = [
        float(strategy.reduce("SUM", strategy.run(mlp_step, args=(model, optimizer, *b)), None))
        for b in dataset
    ]
    ours, our_optimizer = state()
    iterator = iter(dataset)
    with caplog.at_level("INFO", logger="mirrored"):
        losses = [
            np.asarray(strategy.reduce("SUM", out, axis=None))
            for out in iter(
                lambda: strategy.run_steps(mlp_step, iterator, steps=3, args=(ours, our_optimizer)),
                None,
            )
        ]
    assert [len(x) for x in losses] == [3, 1]
    assert np.concatenate(losses).tolist() == expected
    mine, theirs = params_of(ours), params_of(model)
    for name in theirs:
        np.testing.assert_array_equal(mine[name], theirs[name])
    assert int(our_optimizer.step[...]) == 4
    said = [r.getMessage() for r in caplog.records if "calls of one step" in r.getMessage()]
    assert len(said) == 2  # once per program: 3 steps, then the 1 left
    assert "train_step" in said[0] and "3 steps run as 3 calls" in said[0]


def test_only_convolutions_xla_cpu_runs_slowly_in_a_loop_are_named():
    """The rule measured by benchmarks/loop_ops.py: channels-last forward convolutions (plain,
    strided, depthwise) run as fast inside a loop; their gradients and channels-first ones do
    not."""
    from mirrored._run.loop_shape import slow_convolutions

    x, w = np.ones((2, 6, 6, 4), np.float32), np.ones((3, 3, 1, 4), np.float32)

    def conv(x, w, strides=(1, 1), groups=4, dims=("NHWC", "HWIO", "NHWC")):
        return jax.lax.conv_general_dilated(
            x, w, strides, "SAME", dimension_numbers=dims, feature_group_count=groups
        )

    def text(f, *args):
        return jax.jit(f).lower(*args).as_text()

    full = np.ones((3, 3, 4, 4), np.float32)
    assert slow_convolutions(text(conv, x, w)) == []
    assert slow_convolutions(text(lambda x, w: conv(x, w, (2, 2), 1), x, full)) == []
    assert slow_convolutions(text(lambda x: x.sum(), x)) == []
    unreadable = text(conv, x, w).replace("dim_numbers = ", "dimension_numbers = ")
    assert slow_convolutions(unreadable) == ["(dimension numbers not read)"]
    gradient = slow_convolutions(text(jax.grad(lambda w: conv(x, w, groups=1).sum()), full))
    assert gradient == ["[f, 0, 1, b]x[i, 0, 1, o]->[0, 1, b, f]"]
    assert slow_convolutions(text(jax.grad(lambda x: conv(x, full, groups=1).sum()), x))
    channels_first = ("NCHW", "OIHW", "NCHW")
    nchw, oihw = x.transpose(0, 3, 1, 2), full.transpose(3, 2, 0, 1)
    assert slow_convolutions(
        text(lambda x, w: conv(x, w, groups=1, dims=channels_first), nchw, oihw)
    )


def _cnn_eval_step(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


@pytest.mark.parametrize("replicas", [8, 1])
def test_a_forward_convolution_runs_its_steps_in_one_program_on_cpu(replicas, caplog):
    """An evaluation step of a channels-last CNN (no gradient) keeps the K-step program: the
    same per-example losses as one strategy.run per step, ragged batch included, and no note
    in the log."""
    rng = np.random.default_rng(1)
    batches = [
        (rng.normal(size=(n, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, n))
        for n in (16, 16, 11)
    ]
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    dataset = strategy.experimental_distribute_dataset(batches)
    with strategy.scope():
        model = _TinyCNN(nnx.Rngs(0))
    expected = np.concatenate(
        [strategy.gather(strategy.run(_cnn_eval_step, args=(model, *b)), 0) for b in dataset]
    )
    with caplog.at_level("INFO", logger="mirrored"):
        out = strategy.run_steps(_cnn_eval_step, iter(dataset), steps=3, args=(model,))
    assert not [r for r in caplog.records if "calls of one step" in r.getMessage()]
    ours = np.asarray(strategy.gather(out, axis=1))
    assert ours.shape == (3, 16)
    real = np.concatenate([ours[0], ours[1], ours[2][:11]])
    np.testing.assert_allclose(real, expected, rtol=1e-6, atol=1e-6)


def test_run_steps_errors_say_what_to_do(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    dataset = strategy.experimental_distribute_dataset(BATCHES[:2])
    with pytest.raises(TypeError, match="iterator = iter"):
        strategy.run_steps(mlp_step, dataset, steps=2, args=(model, optimizer))
    with pytest.raises(ValueError, match="positive int"):
        strategy.run_steps(mlp_step, iter(dataset), steps=0, args=(model, optimizer))
    (x, y) = next(iter(dataset))
    with pytest.raises(ValueError, match="PerReplica value in args"):
        strategy.run_steps(lambda m, o, x, y, b: None, iter([(y, x)]), steps=1, args=(model, x))
    exhausted = iter(dataset)
    list(exhausted)
    assert strategy.run_steps(mlp_step, exhausted, steps=2, args=(model, optimizer)) is None


def test_batches_of_different_shapes_in_one_program_are_refused_with_the_fix(devices):
    """Batches padded each to its own length (tf.data's padded_batch) cannot share one K-step
    program of run_steps: a clear error naming the steps' shapes and the fixes, the model
    unchanged (before: jnp.stack's 'All input arrays must have the same shape')."""
    strategy = mirrored.MirroredStrategy(devices)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(16, 12)).astype(np.float32), rng.integers(0, 5, 16)),
        (rng.normal(size=(16, 12)).astype(np.float32), rng.integers(0, 5, 16)),
        (rng.normal(size=(16, 13)).astype(np.float32), rng.integers(0, 5, 16)),
    ]
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    before = params_of(model)
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    with pytest.raises(ValueError, match=r"step 0's \(16, 12\) float32 and step 2's \(16, 13\)"):
        strategy.run_steps(mlp_step, iterator, steps=3, args=(model, optimizer))
    after = params_of(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


class _Pool(nnx.Module):
    """Mean over a sequence of any length, then a linear layer."""

    def __init__(self, rngs):
        self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x.mean(axis=1))


@pytest.mark.parametrize("replicas", [8, 1])
def test_the_trainer_runs_batches_of_different_shapes_one_program_each(replicas):
    """Trainer(steps_per_execution=K) on batches padded each to its own length (tf.data's
    padded_batch), as Keras' fit: a chunk whose batches differ in shape runs one program per
    batch, a chunk of one shape one program; the numbers of steps_per_execution=1."""
    rng = np.random.default_rng(0)
    lengths = [5, 5, 5, 7, 5, 9, 6, 6, 6, 8]
    batches = [
        (rng.normal(size=(16, t, 3)).astype(np.float32), rng.integers(0, 2, 16)) for t in lengths
    ]
    batches[-1] = (batches[-1][0][:11], batches[-1][1][:11])  # ragged too
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])

    def trained(k):
        with strategy.scope():
            trainer = mirrored.Trainer(
                _Pool(nnx.Rngs(0)),
                optax.sgd(0.1),
                "sparse_categorical_crossentropy",
                ["accuracy"],
                from_logits=True,
                steps_per_execution=k,
            )
        history = trainer.fit(batches, epochs=2, verbose=0, shuffle=False).history
        return history, trainer.evaluate(batches), params_of(trainer.model)

    one, three = trained(1), trained(3)
    assert one[0].keys() == three[0].keys()
    for name in one[0]:
        assert one[0][name] == pytest.approx(three[0][name], rel=1e-6, abs=1e-7)
    assert one[1] == pytest.approx(three[1], rel=1e-6, abs=1e-7)
    for name in one[2]:
        np.testing.assert_allclose(one[2][name], three[2][name], rtol=1e-6, atol=1e-7)


RNG = np.random.default_rng(1)
X = RNG.normal(size=(525, 12)).astype(np.float32)  # 525 at batch 64: a ragged last batch of 13
Y = RNG.integers(0, 5, 525).astype(np.int32)


class _Hooks(mirrored.callbacks.Callback):
    def __init__(self):
        self.begins, self.ends = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.begins.append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((batch, round(logs["loss"], 6)))


def _fit(replicas, make_tx, k, **fit_kwargs):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            make_tx(),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
            steps_per_execution=k,
        )
    hooks = _Hooks()
    history = trainer.fit(
        X, Y, batch_size=64, epochs=2, verbose=0, callbacks=[hooks], **fit_kwargs
    ).history
    return trainer, history, hooks


@pytest.mark.parametrize("replicas", [8, 1])
@pytest.mark.parametrize("make_tx", [lambda: optax.sgd(0.1), lambda: optax.adam(0.01)])
def test_trainer_steps_per_execution_equals_one_step_per_execution(replicas, make_tx):
    one, expected, _ = _fit(replicas, make_tx, 1, validation_split=0.1)
    four, history, hooks = _fit(replicas, make_tx, 4, validation_split=0.1)
    assert _max_diff(four.model, one.model) <= 1e-6
    for name, values in expected.items():  # loss, accuracy and validation: equal, every epoch
        np.testing.assert_allclose(history[name], values, rtol=0, atol=1e-6)
    # 472 training examples at 64: 8 steps an epoch, the last ragged; hooks every 4 steps.
    assert hooks.begins == [0, 4] * 2
    assert [b for b, _ in hooks.ends] == [3, 7] * 2


def test_steps_per_execution_stops_at_steps_per_epoch_and_rejects_bad_values():
    _, _, hooks = _fit(8, lambda: optax.sgd(0.1), 3, steps_per_epoch=5)
    # 9 batches a pass: epoch 1 is batches 0-4, epoch 2 the rest of the pass, 5-8 (Keras'
    # epochs continue through the data), each cut into executions of at most 3 steps.
    assert hooks.begins == [0, 3] * 2 and [b for b, _ in hooks.ends] == [2, 4, 2, 3]
    with pytest.raises(ValueError, match="steps_per_execution to be a positive int"):
        _fit(8, lambda: optax.sgd(0.1), 0)


@pytest.mark.parametrize(("replicas", "epochs"), [(1, 2), (8, 9)])
def test_arrays_kept_on_the_devices_give_the_host_paths_numbers(monkeypatch, replicas, epochs):
    """steps_per_execution > 1, for more epochs than replicas, gathers batches from arrays
    placed on the devices once (on CPU devices only when MIRRORED_DEVICE_DATA_BYTES asks):
    the same shuffled batches, padding and masks as reading them from the host (sample
    weights included), and only under the size threshold."""
    weights = np.linspace(0.5, 1.5, len(X)).astype(np.float32)
    monkeypatch.delenv("MIRRORED_DEVICE_DATA_BYTES", raising=False)
    default = adam_trainer(
        replicas, steps_per_execution=4
    )  # on CPU devices, by default: from the host
    assert default._resident(X, Y, None, epochs=epochs) is None
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", str(2**30))  # kept, as on accelerators

    def run(k):
        trainer = adam_trainer(replicas, steps_per_execution=k)
        history = trainer.fit(
            X, Y, batch_size=64, epochs=epochs, sample_weight=weights, seed=3, verbose=0
        ).history
        return trainer, history

    resident, history = run(4)
    assert resident._resident(X, Y, None, epochs=epochs) is not None
    # Placed once, the same arrays stay placed, whatever the epochs of the next fit.
    assert resident._resident(X, Y, None, epochs=replicas) is not None
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", "0")  # every batch from the host
    host, expected = run(4)
    assert host._resident(X, Y, None, epochs=epochs) is None
    assert _max_diff(resident.model, host.model) == 0.0
    assert history == expected
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", "lots")
    with pytest.raises(ValueError, match="number of bytes"):
        resident._resident(X, Y, None, epochs=epochs)


def test_arrays_placed_by_one_fit_stay_for_the_next_until_they_change(monkeypatch):
    """Issue 39: a first fit of few epochs reads from the host and remembers the arrays; the
    second fit over them places them, later ones reuse that copy (no transfer); new values at
    the sampled rows, other arrays, or forget_data() place them anew. The numbers are the
    host path's, fit after fit."""
    x, y = X.copy(), Y.copy()
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", str(2**30))  # kept on CPU devices too

    def trainer():
        strategy = mirrored.MirroredStrategy(jax.devices())
        with strategy.scope():
            return mirrored.Trainer(
                SmallMLP(rngs=nnx.Rngs(0)),
                optax.sgd(0.1),
                "sparse_categorical_crossentropy",
                from_logits=True,
                steps_per_execution=4,
            )

    ours = trainer()
    assert ours._resident(x, y, None, epochs=2) is None  # 2 epochs <= 8 replicas: the host
    placed = ours._resident(x, y, None, epochs=2)  # the same arrays again: placed now
    assert placed is not None and ours._resident(x, y, None, epochs=2) is placed
    assert ours._resident(x.copy(), y, None, epochs=2) is None  # another array
    x[0, 0] += 1.0  # a sampled row changed in place: placed anew (second time seen)
    assert ours._resident(x, y, None, epochs=2) is None
    assert ours._resident(x, y, None, epochs=2) is not placed
    ours.forget_data()
    assert ours._resident(x, y, None, epochs=2) is None
    # Three fits, the last two from the devices, equal three fits from the host.
    fresh = trainer()
    histories = [fresh.fit(x, y, batch_size=64, epochs=2, verbose=0).history for _ in range(3)]
    assert fresh._device_data.placed()
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", "0")
    host = trainer()
    expected = [host.fit(x, y, batch_size=64, epochs=2, verbose=0).history for _ in range(3)]
    assert not host._device_data.placed()
    assert histories == expected
    assert _max_diff(fresh.model, host.model) == 0.0


@pytest.mark.parametrize("replicas", [1, 8])
def test_evaluate_predict_and_validation_keep_arrays_on_the_devices_as_fit_does(
    monkeypatch, replicas
):
    """Issue 39 item 3: evaluate, predict and fit's validation keep in-memory arrays on the
    devices as fit does (a first call that reads them at most once per replica reads from the
    host and remembers them, the next places them, later calls reuse that copy), with the
    host path's numbers: the ragged last batch and sample weights included, 1 and 8 replicas.
    All the arrays kept share one budget per device, the least recently used going first."""
    weights = np.linspace(0.5, 1.5, len(X)).astype(np.float32)
    xv, yv = X[:333], Y[:333]  # 333 rows at batch 64: a ragged last batch of 13

    def calls(trainer):
        history = trainer.fit(
            X, Y, batch_size=64, epochs=2, validation_data=(xv, yv), seed=3, verbose=0
        ).history
        out = [history]
        for _ in range(3):
            out.append(trainer.evaluate(X, Y, batch_size=64, sample_weight=weights))
            out.append(trainer.predict(xv, batch_size=64))
        return out

    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", str(2**30))
    kept = adam_trainer(replicas, steps_per_execution=4)
    got = calls(kept)
    shapes = sorted(tuple(len(a) for a in jax.tree.leaves(p)) for p in kept._device_data.placed())
    # validation's (placed in the first fit: its second epoch at the latest), evaluate's and
    # predict's (by their second call); fit's own only with more epochs than replicas.
    expected_shapes = [(333,), (333, 333), (525, 525, 525)] + ([(525, 525)] * (replicas == 1))
    assert shapes == sorted(expected_shapes)
    again = kept._device_data.arrays(kept.strategy, 4, X, Y, weights, uses=1)
    assert any(again is p for p in kept._device_data.placed())  # the same copy, reused
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", "0")  # every batch from the host
    host = adam_trainer(replicas, steps_per_execution=4)
    expected = calls(host)
    assert not host._device_data.placed()
    assert got[0] == expected[0] and got[1::2] == expected[1::2]
    for ours, theirs in zip(got[2::2], expected[2::2], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert _max_diff(kept.model, host.model) == 0.0
    # One budget for all: room for evaluate's arrays (29,400 bytes) or predict's, not both.
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", "30000")
    small = adam_trainer(replicas, steps_per_execution=4)
    for _ in range(2):
        small.evaluate(X, Y, batch_size=64, sample_weight=weights)
    assert [len(p) for p in small._device_data.placed()] == [3]
    from_host, from_devices = (small.predict(xv, batch_size=64) for _ in range(2))
    np.testing.assert_array_equal(from_devices, from_host)
    assert [len(p) for p in small._device_data.placed()] == [1]  # evaluate's went first
    small.forget_data()
    assert not small._device_data.placed()


def test_kept_arrays_are_never_another_arrays_and_validation_leaves_trainings_in_place(
    monkeypatch,
):
    """A fresh array at the id of a freed one, equal at the sampled rows (a loop over edited
    copies), is read anew, never answered with the freed one's copy; fit's validation arrays
    that do not fit beside its training arrays are read from the host, the training arrays
    staying on the devices for the next fit."""
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", str(2**30))
    trainer = adam_trainer(1, steps_per_execution=4)
    host = adam_trainer(1)  # one step per execution: always from the host
    sampled = np.unique(np.linspace(0, len(X) - 1, num=64, dtype=np.int64))
    edited = np.setdiff1d(np.arange(len(X)), sampled)
    for i in range(6):
        copy = X.copy()
        copy[edited] = float(i)  # other values, the same at the sampled rows
        for _ in range(2):  # the second call places it
            np.testing.assert_array_equal(
                trainer.predict(copy, batch_size=64), host.predict(copy, batch_size=64)
            )
        del copy
    train, val = (X[:400], Y[:400]), (X[400:], Y[400:])
    budget = sum(a.nbytes for a in train) + sum(a.nbytes for a in val) - 1
    monkeypatch.setenv("MIRRORED_DEVICE_DATA_BYTES", str(budget))
    fitting = adam_trainer(1, steps_per_execution=4)
    fitting.fit(*train, batch_size=64, epochs=2, validation_data=val, verbose=0)
    (kept,) = fitting._device_data.placed()
    assert [len(a) for a in kept] == [400, 400]
    fitting.fit(*train, batch_size=64, epochs=2, validation_data=val, verbose=0)
    (again,) = fitting._device_data.placed()
    assert again is kept


@pytest.mark.parametrize("processes", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize(("rows", "shuffle"), [(230, True), (190, False)])
def test_chunks_hold_the_batches_rows_padding_and_masks(processes, rows, shuffle):
    """Issue 39 item 2: K batches gathered at once hold exactly `array_batches`' batches (rows,
    order, padding copies, masks, real counts), from batch `skip` on, for each process of two
    (190 rows at 60: process 1 holds only padding in the last batch), in aligned buffers."""
    from mirrored._data.chunks import ALIGNMENT, array_chunks, gather
    from mirrored._data.input import array_batches

    x = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    arrays = {"x": x, "y": np.arange(rows, dtype=np.int32)}
    common = {"batch_size": 60, "shuffle": shuffle, "seed": 3, "epoch": 2, "num_replicas": 8}
    batches = list(array_batches(arrays, drop_remainder=False, processes=processes, **common))
    chunks = list(array_chunks(arrays, steps=2, skip=1, processes=processes, **common))
    assert [len(c.reals) for c in chunks] == [2, 1]  # 4 batches, from the second, 2 at a time
    stepped = [(c, k) for c in chunks for k in range(len(c.reals))]
    for batch, (chunk, k) in zip(batches[1:], stepped, strict=True):
        assert chunk.treedef == batch.treedef and chunk.size == batch.size == 64
        assert chunk.reals[k] == batch.real
        np.testing.assert_array_equal(chunk.mask[k], batch.mask)
        blocks = gather(chunk, 0, 32 if processes[0] == 2 else 64)
        for leaf, expected in zip(blocks, batch.leaves, strict=True):
            np.testing.assert_array_equal(leaf[k], expected)
            assert leaf.ctypes.data % ALIGNMENT == 0
    assert batches[-1].real < 60  # the ragged last batch was among them


def test_a_chunk_buffer_is_reused_only_once_no_array_uses_it(monkeypatch):
    """On CPU an aligned block is placed without a copy: the device array reads the buffer.
    The buffer is refilled for a later chunk only after that device array is gone; K batches
    over `CHUNK_BYTES` are read one batch at a time instead."""
    import gc

    from mirrored._data import chunks

    monkeypatch.setattr(chunks, "_BUFFERS", chunks._Buffers(keep_bytes=2**20))
    host = chunks.aligned_empty((4, 16), np.float32)
    host[:] = 1.0
    placed = jax.device_put(host, jax.devices()[0])
    assert placed.unsafe_buffer_pointer() == host.ctypes.data  # no copy: the same memory
    del host
    gc.collect()
    again = chunks.aligned_empty((4, 16), np.float32)  # a new buffer: the old one is in use
    again[:] = 2.0
    assert float(placed.sum()) == 64.0
    del placed, again
    gc.collect()
    reused = chunks.aligned_empty((4, 16), np.float32)
    assert chunks._BUFFERS._kept == 4 * 16 * 4  # one back in the pool, one handed out again
    del reused

    strategy = mirrored.MirroredStrategy(jax.devices()[:2])
    dataset = strategy.experimental_distribute_dataset((X, Y), batch_size=64)
    assert dataset.epoch_chunks(1, 4) is not None
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4 * 64 * X[0].nbytes)  # labels tip it over
    assert dataset.epoch_chunks(1, 4) is None


@pytest.mark.parametrize("replicas", [8, 1])
def test_fit_gathers_k_batches_at_once_from_the_host_with_the_same_numbers(monkeypatch, replicas):
    """K steps per execution from the host (a first fit of one epoch: nothing kept on the
    devices) gather and place K batches at once, for training, validation and `evaluate`;
    the numbers are those of the K batches
    placed one by one, bit for bit, and of one step per execution, a batch size that the
    replicas do not divide (padded), the ragged last batch, sample weights and validation
    included."""
    from mirrored._data.input import DistributedDataset

    used = []
    chunks = DistributedDataset.epoch_chunks

    def recorded(self, epoch, steps, *, skip=0, whole=False):
        used.append(steps)
        return chunks(self, epoch, steps, skip=skip, whole=whole)

    weights = np.linspace(0.5, 1.5, len(X)).astype(np.float32)
    options = {"batch_size": 60, "sample_weight": weights, "seed": 5, "verbose": 0}
    options["validation_data"] = (X[:40], Y[:40])
    monkeypatch.setattr(DistributedDataset, "epoch_chunks", recorded)
    at_once = adam_trainer(replicas, steps_per_execution=3)
    history = at_once.fit(X, Y, epochs=1, **options).history
    evaluated = at_once.evaluate(X, Y, batch_size=60, sample_weight=weights)
    assert used == [3, 3, 3]  # training, validation, evaluate
    monkeypatch.setattr(DistributedDataset, "epoch_chunks", lambda *a, **k: None)
    one_by_one = adam_trainer(replicas, steps_per_execution=3)
    assert one_by_one.fit(X, Y, epochs=1, **options).history == history
    assert _max_diff(at_once.model, one_by_one.model) == 0.0
    assert one_by_one.evaluate(X, Y, batch_size=60, sample_weight=weights) == evaluated
    stepwise = adam_trainer(replicas, steps_per_execution=1)
    expected = stepwise.fit(X, Y, epochs=1, **options).history
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=0, atol=1e-6)
    assert _max_diff(at_once.model, stepwise.model) <= 1e-6


class _EpochEnds(mirrored.callbacks.Callback):
    def __init__(self, events):
        self.events = events

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("end", epoch))


@pytest.mark.parametrize(("replicas", "k"), [(8, 4), (1, 1)])
def test_the_next_epochs_batches_are_prepared_before_the_epoch_ends(monkeypatch, replicas, k):
    """Issue 39 item 1: from in-memory arrays, epoch e+1's iterator (and its prefetch thread)
    starts before epoch e's logs are read, not after its callbacks; the batches are the same
    (a shuffled fit of 3 epochs equals 3 fits of one epoch each, which read nothing ahead),
    validation data and sample weights included."""
    from mirrored._data.input import DistributedDataset

    events = []
    iterator, chunks = DistributedDataset.epoch_iterator, DistributedDataset.epoch_chunks

    def recorded(self, epoch, *, skip=0):
        events.append(("iter", epoch, self))
        return iterator(self, epoch, skip=skip)

    def recorded_chunks(self, epoch, steps, *, skip=0, whole=False):  # K > 1: K at once
        events.append(("iter", epoch, self))
        return chunks(self, epoch, steps, skip=skip, whole=whole)

    monkeypatch.setattr(DistributedDataset, "epoch_iterator", recorded)
    monkeypatch.setattr(DistributedDataset, "epoch_chunks", recorded_chunks)
    weights = np.linspace(0.5, 1.5, len(X)).astype(np.float32)
    options = {"batch_size": 64, "sample_weight": weights, "seed": 5, "verbose": 0}
    options["validation_data"] = (X[:40], Y[:40])

    ahead = adam_trainer(replicas, steps_per_execution=k)
    history = ahead.fit(X, Y, epochs=3, callbacks=[_EpochEnds(events)], **options).history
    training = events[0][2]  # made first; the validation set's iterators are left out
    assert [e[:2] for e in events if e[0] == "end" or e[2] is training] == [
        ("iter", 1),
        ("iter", 2),
        ("end", 0),
        ("iter", 3),
        ("end", 1),
        ("end", 2),
    ]
    one_by_one = adam_trainer(replicas, steps_per_execution=k)
    expected: dict = {}
    for epoch in range(3):
        step = one_by_one.fit(X, Y, initial_epoch=epoch, epochs=epoch + 1, **options).history
        for name, values in step.items():
            expected.setdefault(name, []).extend(values)
    assert history == expected
    assert _max_diff(ahead.model, one_by_one.model) == 0.0


class _TestHooks(mirrored.callbacks.Callback):
    def __init__(self):
        self.ends = []

    def on_test_batch_end(self, batch, logs=None):
        self.ends.append((batch, round(logs["loss"], 6)))


@pytest.mark.parametrize("replicas", [8, 1])
def test_evaluate_with_steps_per_execution_gives_the_same_numbers(replicas):
    """evaluate runs K steps per program: the same loss and metrics as one step per program
    (ragged last batch and sample weights included), test hooks every K steps."""
    one, _, _ = _fit(replicas, lambda: optax.sgd(0.1), 1)
    three, _, _ = _fit(replicas, lambda: optax.sgd(0.1), 3)
    weights = np.linspace(0.5, 1.5, len(X)).astype(np.float32)
    expected = one.evaluate(X, Y, batch_size=64, sample_weight=weights)
    hooks = _TestHooks()
    logs = three.evaluate(X, Y, batch_size=64, sample_weight=weights, callbacks=[hooks])
    assert logs.keys() == expected.keys()
    for name, value in expected.items():
        assert logs[name] == pytest.approx(value, abs=1e-6)
    assert [b for b, _ in hooks.ends] == [2, 5, 8]  # 525 rows at 64: 9 steps, 3 per program
    assert hooks.ends[-1][1] == pytest.approx(logs["loss"], abs=1e-6)


def test_per_example_outputs_of_run_steps_warn_that_they_keep_a_ragged_batchs_padding(
    caplog,
):
    """run_steps stacks its outputs by step without the batches' masks: a per-example output
    is said once per program (with the fix), a per-replica scalar is not; the padded rows of
    the ragged last batch are indeed there (8 + 8 + 4 rows of 8)."""
    strategy = mirrored.MirroredStrategy(jax.devices()[:8])
    dataset = strategy.experimental_distribute_dataset(
        np.arange(20, dtype=np.float32), batch_size=8
    )

    def doubled(x):
        return x * 2

    def summed(x):
        return mirrored.get_replica_context().all_reduce("SUM", (x * 2).sum())

    with caplog.at_level("WARNING", logger="mirrored"):
        out = strategy.run_steps(doubled, iter(dataset), steps=3)
        strategy.run_steps(doubled, iter(dataset), steps=3)  # the same program: said once
        strategy.run_steps(summed, iter(dataset), steps=3)
    said = [m for r in caplog.records if "without the batches' masks" in (m := r.getMessage())]
    assert len(said) == 1 and "run_steps(doubled, steps=3)" in said[0] and "Fix:" in said[0]
    assert strategy.gather(out, axis=1).shape == (3, 8)  # the third step's 4 padded rows too
    # The Trainer's K-step programs return running sums, whatever their length (here each
    # replica's rows, as many as the sums: no false alarm).
    trainer = adam_trainer(8, steps_per_execution=4)
    width = trainer._width
    x = np.random.default_rng(0).normal(size=(8 * width * 9, 12)).astype(np.float32)
    y = np.arange(len(x)) % 5
    with caplog.at_level("WARNING", logger="mirrored"):
        trainer.fit(x, y, batch_size=8 * width, epochs=1, verbose=0)
        trainer.evaluate(x, y, batch_size=8 * width)
    assert sum("without the batches' masks" in r.getMessage() for r in caplog.records) == 1
