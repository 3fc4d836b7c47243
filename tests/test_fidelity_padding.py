"""No silent wrong numbers, part 2 (issue 18): harmless padding, Keras' metric strings, loss
scaling for every optimizer, the user's dtypes, accumulation as documented, sequence losses and
re-iterable sources. Each against an independent single-device (NumPy or plain JAX) reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import params_of


@pytest.fixture(scope="module")
def strategies():
    devices = jax.devices()
    return {
        1: mirrored.OneDeviceStrategy(devices[0]),
        2: mirrored.MirroredStrategy(devices[:2]),
        8: mirrored.MirroredStrategy(devices),
    }


class Regressor(nnx.Module):
    """Optionally L2-normalises its input: NaN on a row of zeros."""

    def __init__(self, normalize=False):
        self.normalize = normalize
        self.linear = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        if self.normalize:
            x = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return self.linear(x) + 2.0


def mape(y_true, y_pred):
    """A 1/|y| loss: infinite on a zero label."""
    return jnp.abs((y_true - y_pred) / y_true)[:, 0]


def _data(rows=37, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3)).astype(np.float32) + 1.0
    y = rng.uniform(1.0, 2.0, (rows, 1)).astype(np.float32)
    return x, y


def _reference(x, y, normalize, batch, lr, epochs=1):
    """Plain NNX on one device, batch by batch, the mean loss of each batch."""
    model = Regressor(normalize)
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            return jnp.mean(mape(yb, model(xb)))

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for _ in range(epochs):
        for start in range(0, len(x), batch):
            step(model, optimizer, x[start : start + batch], y[start : start + batch])
    return model


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("normalize", [False, True], ids=["mape", "l2-normalised"])
def test_padding_cannot_poison_fit_or_evaluate(strategies, n, normalize):
    strategy = strategies[n]
    x, y = _data()
    with strategy.scope():
        model = Regressor(normalize)
        trainer = mirrored.Trainer(model, optax.sgd(0.05), mape)
    before = trainer.evaluate(x, y, batch_size=16)["loss"]
    reference = Regressor(normalize)
    assert before == pytest.approx(float(jnp.mean(mape(y, reference(x)))), rel=1e-5)
    history = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    expected = params_of(_reference(x, y, normalize, 16, 0.05, epochs=2))
    for name, value in params_of(model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_padding_cannot_poison_a_custom_loop(strategies, n):
    strategy = strategies[n]
    x, y = _data()

    def step(model, optimizer, xb, yb):
        def loss_fn(model):
            return mirrored.compute_average_loss(mape(yb, model(xb)))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with strategy.scope():
        model = Regressor(normalize=True)
        optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    losses = []
    for xb, yb in strategy.experimental_distribute_dataset((x, y), batch_size=16):
        losses.append(float(strategy.reduce("SUM", strategy.run(step, (model, optimizer, xb, yb)))))
    assert np.isfinite(losses).all()
    expected = params_of(_reference(x, y, True, 16, 0.05))
    for name, value in params_of(model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6)


def test_padded_rows_are_copies_of_real_rows(strategies):
    strategy = strategies[8]
    x = np.arange(1, 11, dtype=np.float32)  # the last batch: 2 real rows of 8
    (_, last) = list(strategy.experimental_distribute_dataset(x, batch_size=8))
    rows = np.asarray(last.global_value)
    assert set(rows.tolist()) <= {9.0, 10.0}  # finite wherever the real rows are
    np.testing.assert_array_equal(np.asarray(last.mask.global_value), [1, 1, 0, 0, 0, 0, 0, 0])
    # A replica the per-replica pipeline ran out for copies another replica's rows.
    two = strategies[2]
    dist = two.distribute_datasets_from_function(
        lambda ctx: [np.array([1.0, 2.0]), np.array([3.0, 4.0]), np.array([5.0])]
    )
    (_, last) = list(dist)
    assert set(np.asarray(last.global_value).tolist()) == {5.0}


# -- Keras' resolution of metric and loss strings ---------------------------------------------


class OneUnit(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jax.nn.sigmoid(self.linear(x))


class ThreeClasses(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 3, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return jax.nn.softmax(self.linear(x))


def _evaluate(strategy, make_model, loss, x, y, metrics=("accuracy",)):
    with strategy.scope():
        trainer = mirrored.Trainer(make_model(), optax.sgd(0.0), loss, list(metrics))
    return trainer, trainer.evaluate(x, y, batch_size=16)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("loss", ["mse", "mae", "custom"])
def test_accuracy_of_one_sigmoid_unit_is_binary(strategies, n, loss):
    x, _ = _data()
    y = (x[:, :1] > 1.0).astype(np.float32)
    loss_fn = (lambda t, p: ((t - p) ** 2)[:, 0]) if loss == "custom" else loss
    _, logs = _evaluate(strategies[n], OneUnit, loss_fn, x, y)
    p = np.asarray(OneUnit()(x))
    assert logs["accuracy"] == pytest.approx(float(np.mean((p > 0.5) == (y > 0.5))), rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_accuracy_with_one_hot_labels_is_categorical(strategies, n):
    x, _ = _data()
    labels = np.arange(len(x)) % 3
    one_hot = np.eye(3, dtype=np.float32)[labels]
    custom = lambda t, p: jnp.sum((t - p) ** 2, axis=-1)  # noqa: E731
    _, logs = _evaluate(strategies[n], ThreeClasses, custom, x, one_hot)
    p = np.asarray(ThreeClasses()(x))
    assert logs["accuracy"] == pytest.approx(float(np.mean(p.argmax(1) == labels)), rel=1e-6)
    _, sparse = _evaluate(strategies[n], ThreeClasses, "sparse_categorical_crossentropy", x, labels)
    assert sparse["accuracy"] == pytest.approx(logs["accuracy"], rel=1e-6)


def test_mismatched_labels_for_accuracy_name_the_shapes(strategies):
    x, _ = _data(16)
    wrong = np.zeros((16, 5), np.float32)  # 5 label columns for 3 outputs
    with pytest.raises(ValueError, match=r"accuracy expected .*found labels of shape \(\d+, 5\)"):
        _evaluate(strategies[2], ThreeClasses, lambda t, p: jnp.sum(p, axis=-1), x, wrong)


@pytest.mark.parametrize("name", ["crossentropy", "ce"])
def test_crossentropy_resolves_from_the_shapes(strategies, name):
    x, _ = _data()
    labels = (np.arange(len(x)) % 3).astype(np.int32)
    strategy = strategies[2]
    for model, y, explicit in [
        (ThreeClasses, labels, "sparse_categorical_crossentropy"),
        (ThreeClasses, np.eye(3, dtype=np.float32)[labels], "categorical_crossentropy"),
        (OneUnit, (labels == 1).astype(np.float32)[:, None], "binary_crossentropy"),
    ]:
        _, resolved = _evaluate(strategy, model, name, x, y)
        _, expected = _evaluate(strategy, model, explicit, x, y)
        assert resolved == pytest.approx(expected, rel=1e-6)


# -- loss scaling for every optimizer; the user's dtypes ----------------------------------------


def test_float16_policy_refuses_an_optimizer_without_loss_scaling(strategies):
    strategy = strategies[2]
    with strategy.scope():
        model = Regressor()
        built = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        with pytest.raises(ValueError, match="needs dynamic loss scaling") as info:
            mirrored.Trainer(model, built, "mse", policy="mixed_float16")
        assert "LossScaleOptimizer" in str(info.value)
        scaled = mirrored.mixed_precision.LossScaleOptimizer(model, optax.sgd(0.1))
        mirrored.Trainer(model, scaled, "mse", policy="mixed_float16")  # scaled: accepted


def test_a_small_loss_still_updates_under_float16(strategies):
    strategy = strategies[2]
    x, y = _data(16)

    def tiny(t, p):
        return 1e-7 * ((t - p) ** 2)[:, 0]

    # A rate that makes the tiny gradients' step visible next to the float32 parameters.
    with strategy.scope():
        model = Regressor()
        trainer = mirrored.Trainer(model, optax.sgd(1e5), tiny, policy="mixed_float16")
    before = params_of(model)
    trainer.fit(x, y, batch_size=16, verbose=0)
    # The reference update, plain JAX in float32: one SGD step on the batch's mean loss.
    grads = nnx.grad(lambda model: jnp.mean(tiny(y, model(x))))(Regressor())
    for name, value in params_of(model).items():
        grad = dict(nnx.to_flat_state(grads))[tuple(name.split("/"))].get_value()
        expected = -1e5 * np.asarray(grad)
        assert np.max(np.abs(expected)) > 0
        # float16 gradients of 1e-7 * loss flush to zero unscaled; never unscaled, they are
        # 32768 times too large.
        np.testing.assert_allclose(value - before[name], expected, rtol=1e-2, err_msg=name)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_a_policy_keeps_the_dtypes_the_user_chose(strategies, policy):
    class Mixed(nnx.Module):
        def __init__(self):
            self.free = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
            self.bf16 = nnx.Linear(3, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
            self.f32 = nnx.Linear(3, 1, dtype=jnp.float32, rngs=nnx.Rngs(2))

        def __call__(self, x):
            return self.f32(self.bf16(self.free(x)))

    with strategies[2].scope():
        model = Mixed()
        mirrored.Trainer(model, optax.sgd(0.1), "mse", policy=policy)
    expected_free = {"float32": None, "mixed_float16": jnp.float16, "mixed_bfloat16": jnp.bfloat16}
    assert model.free.dtype == expected_free[policy]
    assert model.bf16.dtype == jnp.bfloat16 and model.f32.dtype == jnp.float32
    assert model.free.kernel[...].dtype == jnp.float32  # parameters stay float32


# -- accumulation ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_accumulation_is_one_step_on_the_k_times_larger_batch(strategies, n, weighted):
    """Issue 33, item 7: gradient_accumulation_steps=k weighs each micro-batch by its real
    examples, so micro-batches of 16, 16 and a ragged 8 make one SGD step on all 40 rows
    (Keras 3 and optax.MultiSteps average the three means: the 8 rows weighed 2× each)."""
    x, y = _data(40)
    w = np.linspace(0.5, 1.5, 40).astype(np.float32) if weighted else None
    k = 3
    model = Regressor()

    def loss_fn(model):  # Keras: the weighted sum over the examples, divided by their count
        losses = mape(y, model(x))
        return jnp.mean(losses if w is None else losses * w)

    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    optimizer.update(model, nnx.grad(loss_fn)(model))
    with strategies[n].scope():
        mirrored_model = Regressor()
        trainer = mirrored.Trainer(
            mirrored_model, optax.sgd(0.05), mape, gradient_accumulation_steps=k
        )
    trainer.fit(x, y, sample_weight=w, batch_size=16, shuffle=False, verbose=0)
    expected = params_of(model)
    for name, value in params_of(mirrored_model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7)


def _accumulating_trainer(strategy, k=3, **options):
    with strategy.scope():
        model = Regressor()
        trainer = mirrored.Trainer(
            model, optax.sgd(0.05), mape, gradient_accumulation_steps=k, **options
        )
    return model, trainer


def _one_step_on_the_union(x, y, clipnorm=None):
    """Plain NNX on one device: one SGD step on all rows (clipped if asked)."""
    model = Regressor()
    tx = optax.sgd(0.05)
    if clipnorm is not None:
        tx = optax.chain(optax.clip_by_global_norm(clipnorm), tx)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, nnx.grad(lambda m: jnp.mean(mape(y, m(x))))(model))
    return params_of(model)


def _computations(hlo):
    """Optimized HLO text as {computation name: its body}, and the entry computation's name."""
    named, entry, name = {}, None, None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            words = line.split()
            is_entry = words[0] == "ENTRY"
            name = (words[1] if is_entry else words[0]).lstrip("%")
            entry = name if is_entry else entry
            named[name] = ""
        elif name is not None:
            named[name] += line + "\n"
    return named, entry


@pytest.mark.parametrize("n", [2, 8])
def test_accumulation_all_reduces_the_gradients_once_per_update(strategies, n):
    """Issue 33, item 7: each replica sums its own gradients over the k micro-batches; the
    one gradient all-reduce sits in the branch that applies the update, so k - 1 of k steps
    run no collective at all (was: one all-reduce per micro-batch)."""
    strategy = strategies[n]
    x, y = _data(32)
    model, trainer = _accumulating_trainer(strategy)
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    xb, yb = next(iter(strategy.experimental_distribute_dataset([(x[:16], y[:16])])))
    args = (model, trainer.optimizer, trainer._train_totals, trainer._stateful, trainer.rngs)
    hlo = strategy._compiled_text(trainer._train_step, (*args, xb, yb), {})
    named, entry = _computations(hlo)
    reducing = {name for name, text in named.items() if "all-reduce" in text}
    assert reducing, "no all-reduce: the gradients were never combined"
    assert entry not in reducing, "an all-reduce runs on every micro-batch"
    branches = "".join(line for line in named[entry].splitlines() if "conditional(" in line)
    assert all(name in branches for name in reducing), (reducing, branches)
    # The accumulator is per-replica state: a row per replica, split over them.
    rows = jax.tree.leaves(nnx.state(trainer.optimizer))
    assert any(r.shape == (n, 3, 1) and not r.sharding.is_fully_replicated for r in rows)


@pytest.mark.parametrize("n", [1, 8])
def test_accumulation_with_clipping_and_several_steps_per_program(strategies, n):
    """The clipped mean gradient of 16 + 16 + 8 rows, with the three micro-batches in one
    program (steps_per_execution=3) and a clip norm that binds: one clipped step on all 40."""
    x, y = _data(40)
    expected = _one_step_on_the_union(x, y, clipnorm=0.05)
    model, trainer = _accumulating_trainer(
        strategies[n], global_clipnorm=0.05, steps_per_execution=3
    )
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    for name, value in params_of(model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7)


def test_accumulation_under_float16_loss_scaling_matches_one_device(strategies):
    """mixed_float16: the loss-scale optimizer skips a step when a replica's own gradient is
    not finite (agreed across replicas, as the accumulator differs); 8 replicas equal one."""
    x, y = _data(40)
    trained = {}
    for n in (1, 8):
        model, trainer = _accumulating_trainer(strategies[n], policy="mixed_float16")
        trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        trained[n] = params_of(model)
    for name, value in trained[8].items():
        np.testing.assert_allclose(value, trained[1][name], rtol=2e-3, atol=1e-4)
    assert any(np.abs(trained[8][name] - v).max() > 0 for name, v in params_of(Regressor()).items())


def test_an_accumulation_saved_midway_resumes_on_another_replica_count(strategies, tmp_path):
    """Two micro-batches accumulated on 8 replicas, saved, restored onto 2 (the checkpoint
    holds the replicas' summed gradients), the third micro-batch there: one step on all 40."""
    x, y = _data(40)
    expected = _one_step_on_the_union(x, y)
    model, trainer = _accumulating_trainer(strategies[8])
    trainer.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
    mirrored.save_checkpoint(tmp_path, model, trainer.optimizer, step=2)
    resumed, again = _accumulating_trainer(strategies[2])
    mirrored.restore_checkpoint(tmp_path, resumed, again.optimizer)
    for name, value in params_of(Regressor()).items():  # not applied yet
        np.testing.assert_array_equal(params_of(resumed)[name], value)
    again.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
    for name, value in params_of(resumed).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [2, 8])
def test_optax_multisteps_given_as_the_optimizer_stays_the_mean_of_micro_batch_means(strategies, n):
    """Keras 3's rule, still available: optax.MultiSteps averages the k mean gradients."""
    x, y = _data(40)  # micro-batches of 16, 16, 8 (+ the next cycle's)
    k = 3
    model = Regressor()
    optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    def loss_fn(model, xb, yb):
        return jnp.mean(mape(yb, model(xb)))

    grads = [nnx.grad(loss_fn)(model, x[s : s + 16], y[s : s + 16]) for s in (0, 16, 32)]
    optimizer.update(model, jax.tree.map(lambda *g: sum(g) / k, *grads))
    with strategies[n].scope():
        mirrored_model = Regressor()
        trainer = mirrored.Trainer(
            mirrored_model, optax.MultiSteps(optax.sgd(0.05), every_k_schedule=k), mape
        )
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    expected = params_of(model)
    for name, value in params_of(mirrored_model).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-7)


# -- sequence losses; re-iterable sources -------------------------------------------------------


class Tokens(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.linear(x)


@pytest.mark.parametrize("n", [2, 8])
def test_a_per_token_loss_is_masked_along_the_batch_and_averaged_as_keras(strategies, n):
    x, _ = _data(21)
    y = np.asarray(np.random.default_rng(1).normal(size=(21, 4)), np.float32)

    def per_token(t, p):
        return (t - p) ** 2  # (batch, tokens): Keras' sum_over_batch_size averages all

    _, logs = _evaluate(strategies[n], Tokens, per_token, x, y, metrics=())
    expected = float(np.mean((y - np.asarray(Tokens()(x))) ** 2))
    assert logs["loss"] == pytest.approx(expected, rel=1e-5)


class Reiterable:
    """A source whose __iter__ returns a fresh iterator (like a DataLoader or tf.data)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(list(self.batches))


def test_a_reiterable_source_is_iterated_anew_every_epoch(strategies):
    strategy = strategies[2]
    x, y = _data(32)
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    seen = []

    class Count(mirrored.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with strategy.scope():
        trainer = mirrored.Trainer(Regressor(), optax.sgd(0.01), mape)
    history = trainer.fit(Reiterable(batches), epochs=3, callbacks=[Count()], verbose=0)
    assert len(history.epoch) == 3 and seen == [0, 1, 2, 3] * 3


def test_a_one_shot_iterator_for_several_epochs_raises_at_the_second(strategies):
    strategy = strategies[2]
    x, y = _data(32)
    generator = ((x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8))
    with strategy.scope():
        trainer = mirrored.Trainer(Regressor(), optax.sgd(0.01), mape)
    with pytest.raises(ValueError, match="one-shot iterator .* already used up") as info:
        trainer.fit(generator, epochs=2, verbose=0)
    assert "re-iterable" in str(info.value)
