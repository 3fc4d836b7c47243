"""Real-model patterns (issue 13): per-replica randomness, state reached other than through the
arguments, aliased buffers and donation, checkpoints of random keys."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, global_batches, params_of, train_step


@pytest.fixture(scope="module")
def strategy():
    return mirrored.MirroredStrategy(jax.devices())


class Dropped(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed)
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.linear(x))


def _masks(strategy, model, steps):
    """Each step's dropout keep-masks, one row per replica: (steps, replicas, 4)."""
    x = np.ones((strategy.num_replicas_in_sync, 4), np.float32)
    (xb,) = next(iter(strategy.experimental_distribute_dataset([(x,)])))

    def keep(model, x):
        return model.dropout(jnp.ones_like(x)) != 0

    out = [strategy.run(keep, args=(model, xb)) for _ in range(steps)]
    return np.stack([np.asarray(strategy.gather(o, axis=0)) for o in out])


def test_dropout_differs_between_replicas_and_steps_and_repeats_from_the_seed(strategy):
    with strategy.scope():
        first, second = Dropped(seed=3), Dropped(seed=3)
    masks = _masks(strategy, first, 3)
    assert masks.shape == (3, 8, 4)
    for step in masks:  # different on every replica
        assert len({row.tobytes() for row in step}) > 1
    assert not np.array_equal(masks[0], masks[1])  # and new on every step
    np.testing.assert_array_equal(_masks(strategy, second, 3), masks)  # reproducible
    # The stream's key stays mirrored; only its count moved on, once per step.
    assert int(first.dropout.rngs.count[...]) == 3


def test_user_draws_from_rngs_differ_per_replica(strategy):
    with strategy.scope():
        holder = nnx.Dict(rngs=nnx.Rngs(params=1))

    def draw(holder):
        return jax.random.normal(holder["rngs"].params(), (2,))

    values = np.asarray(strategy.gather(strategy.run(draw, args=(holder,)), axis=0))
    assert len({v.tobytes() for v in values.reshape(8, 2)}) == 8


def test_fit_with_dropout_trains_and_replicas_stay_in_sync(strategy):
    from _helpers import assert_bit_identical_on_devices

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.hidden = nnx.Linear(12, 32, rngs=rngs)
            self.dropout = nnx.Dropout(0.3, rngs=rngs)
            self.out = nnx.Linear(32, 5, rngs=rngs)

        def __call__(self, x):
            return self.out(self.dropout(jax.nn.relu(self.hidden(x))))

    x, y = global_batches(1, 64)[0]
    with strategy.scope():
        model = Net()
        trainer = mirrored.Trainer(
            model, optax.adam(1e-2), "sparse_categorical_crossentropy", from_logits=True
        )
    history = trainer.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert_bit_identical_on_devices(model)


# -- state reached other than through the arguments -------------------------------------------


def _setup(strategy):
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    return model, optimizer, x, y


class Holder:
    """A plain training class holding the model: `strategy.run(holder.step, ...)`."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def step(self, x, y):
        return train_step(self.model, self.optimizer, x, y)


class Globals:
    pass


G = Globals()


def _module_level_step(x, y):
    return train_step(G.model, G.optimizer, x, y)


def test_state_through_self_defaults_or_module_objects_is_refused(strategy):
    model, optimizer, x, y = _setup(strategy)
    holder = Holder(model, optimizer)
    with pytest.raises(ValueError, match="captures 'self' \\(Holder\\)") as info:
        strategy.run(holder.step, args=(x, y))
    assert "strategy.run(step, args=(model, x))" in str(info.value)

    def with_default(x, y, model=model, optimizer=optimizer):
        return train_step(model, optimizer, x, y)

    with pytest.raises(ValueError, match="captures 'a default argument'"):
        strategy.run(with_default, args=(x, y))

    G.model, G.optimizer = model, optimizer
    try:
        with pytest.raises(ValueError, match="captures 'G' \\(Globals\\)"):
            strategy.run(_module_level_step, args=(x, y))
    finally:
        del G.model, G.optimizer
    before = params_of(model)  # nothing ran: the model is as it was
    strategy.run(train_step, args=(model, optimizer, x, y))
    assert any(not np.array_equal(before[k], v) for k, v in params_of(model).items())


# -- aliased buffers and donation ------------------------------------------------------------


def test_aliased_variables_do_not_crash_and_train_independently(strategy):
    model, optimizer, x, y = _setup(strategy)
    with strategy.scope():
        target = nnx.clone(model)  # shares every array with `model`
        target_optimizer = nnx.Optimizer(target, optax.sgd(0.1), wrt=nnx.Param)
    model.out.bias[...] = target.out.bias[...]  # and one more alias, by assignment

    def both(model, optimizer, target, target_optimizer, x, y):
        return train_step(model, optimizer, x, y) + train_step(target, target_optimizer, x, y)

    for _ in range(2):
        strategy.run(both, args=(model, optimizer, target, target_optimizer, x, y))
    a, b = params_of(model), params_of(target)
    for name in a:  # the same start, the same batches: the same result, held twice
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6)
    assert model.out.bias[...] is not target.out.bias[...]


def test_without_donation_arrays_read_before_a_step_stay_valid():
    keep = mirrored.MirroredStrategy(jax.devices(), donate=False)
    model, optimizer, x, y = _setup(keep)
    kernel = model.out.kernel[...]
    strategy_run = keep.run(train_step, args=(model, optimizer, x, y))
    assert np.isfinite(np.asarray(kernel)).all()  # still readable: not donated
    assert not np.array_equal(np.asarray(kernel), np.asarray(model.out.kernel[...]))
    del strategy_run
    donating = mirrored.MirroredStrategy(jax.devices())
    model, optimizer, x, y = _setup(donating)
    kernel = model.out.kernel[...]
    donating.run(train_step, args=(model, optimizer, x, y))
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(kernel)
    with pytest.raises(TypeError, match="donate"):
        mirrored.MirroredStrategy(jax.devices(), donate="yes")


# -- checkpoints of random keys ----------------------------------------------------------------


def test_a_model_with_dropout_checkpoints_and_restores_on_another_replica_count(strategy, tmp_path):
    with strategy.scope():
        model = Dropped(seed=5)
    _masks(strategy, model, 2)  # advance the stream
    mirrored.save_checkpoint(tmp_path / "ckpt", model, step=2)
    two = mirrored.MirroredStrategy(jax.devices()[:2])
    with two.scope():
        restored = Dropped(seed=9)
    assert mirrored.restore_checkpoint(tmp_path / "ckpt", restored) == 2
    np.testing.assert_array_equal(
        jax.random.key_data(restored.dropout.rngs.key[...]),
        jax.random.key_data(model.dropout.rngs.key[...]),
    )
    assert int(restored.dropout.rngs.count[...]) == 2
    np.testing.assert_array_equal(
        np.asarray(restored.linear.kernel[...]), np.asarray(model.linear.kernel[...])
    )
    _masks(two, restored, 1)  # the restored key is mirrored on its new strategy


# -- BatchNorm ------------------------------------------------------------------------------------


class Normed(nnx.Module):
    def __init__(self):
        self.bn = nnx.BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(x)


def test_batchnorm_moving_statistics_are_the_mean_over_replicas(strategy):
    from _helpers import assert_bit_identical_on_devices

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32) * np.arange(1, 17, dtype=np.float32)[:, None]
    with strategy.scope():
        model = Normed()
    (xb,) = next(iter(strategy.experimental_distribute_dataset([(x,)])))
    strategy.run(lambda m, x: jnp.sum(m(x)), args=(model, xb))  # training mode: updates stats
    shards = x.reshape(8, 2, 3)  # each replica's own batch statistics, as in TensorFlow
    expected_mean = 0.1 * shards.mean(axis=1).mean(axis=0)
    expected_var = 0.9 + 0.1 * shards.var(axis=1).mean(axis=0)
    np.testing.assert_allclose(np.asarray(model.bn.mean[...]), expected_mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.bn.var[...]), expected_var, rtol=1e-5)
    assert_bit_identical_on_devices(model)
