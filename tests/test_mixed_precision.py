"""Mixed precision, loss scaling, clipping and accumulation under a strategy."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import (
    SmallMLP,
    assert_bit_identical_on_devices,
    global_batches,
    max_relative_difference,
    params_of,
    train_single_device,
)
from mirrored.mixed_precision import LossScaleOptimizer, Policy


def scaled_step(model, optimizer, x, y):
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return optimizer.get_scaled_loss(mirrored.compute_average_loss(per_example))

    grads = nnx.grad(loss_fn)(model)
    return optimizer.apply(model, optimizer.get_unscaled_gradients(grads))


def scaled_setup(devices, **kwargs):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = LossScaleOptimizer(model, optax.adam(1e-2), **kwargs)
    return strategy, model, optimizer


def test_overflow_on_one_replica_skips_the_update_everywhere(devices):
    strategy, model, optimizer = scaled_setup(devices)
    ((xb, yb),) = list(strategy.experimental_distribute_dataset(global_batches(1, 64)))
    # A huge loss on replica 3 only: its scaled loss, and so the summed gradient, overflow.
    boost = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(1e38 if ctx.replica_id_in_sync_group == 3 else 1.0)
    )

    def step(model, optimizer, x, y, boost):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return optimizer.get_scaled_loss(mirrored.compute_average_loss(per_example) * boost)

        grads = nnx.grad(loss_fn)(model)
        return optimizer.apply(model, optimizer.get_unscaled_gradients(grads))

    before = params_of(model)
    applied = strategy.run(step, args=(model, optimizer, xb, yb, boost))
    assert not bool(applied)
    assert float(optimizer.scale[...]) == 2.0**14  # halved
    assert int(optimizer.step[...]) == 0 and int(optimizer.good_steps[...]) == 0
    after = params_of(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert_bit_identical_on_devices(model)
    assert_bit_identical_on_devices(nnx.state(optimizer))
    normal = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
    assert bool(strategy.run(step, args=(model, optimizer, xb, yb, normal)))
    assert int(optimizer.step[...]) == 1


class _DropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)  # its own random stream, folded per replica
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x))))


@pytest.mark.parametrize("replicas", [8, 1])
def test_loss_scaling_leaves_a_models_random_streams_to_the_step(devices, replicas):
    """The loss-scaled update selects only what it writes (parameters, optimizer state): a
    model whose Dropout holds its own key trains under mixed_float16 on several replicas (it
    raised ReplicaDivergenceError on the key, which each replica folds with its index), and a
    skipped step still leaves the parameters as they were."""
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        trainer = mirrored.Trainer(
            _DropoutMLP(nnx.Rngs(0)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            from_logits=True,
            policy="mixed_float16",
        )
    x, y = (np.concatenate(parts) for parts in zip(*global_batches(2, 32), strict=True))
    losses = trainer.fit(x, y, batch_size=16, epochs=2, verbose=0).history["loss"]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    assert_bit_identical_on_devices(trainer.model)
    with strategy.scope():
        model = _DropoutMLP(nnx.Rngs(0))
        optimizer = LossScaleOptimizer(model, optax.sgd(0.1))
    ((xb, yb),) = list(strategy.experimental_distribute_dataset([(x[:16] * 1e38, y[:16])]))
    before = params_of(model)
    assert not bool(strategy.run(scaled_step, args=(model, optimizer, xb, yb)))
    after = params_of(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_scale_grows_after_growth_interval_finite_steps(devices):
    strategy, model, optimizer = scaled_setup(devices, initial_scale=4.0, growth_interval=3)
    batches = list(strategy.experimental_distribute_dataset(global_batches(4, 64)))
    scales = []
    for xb, yb in batches:
        assert bool(strategy.run(scaled_step, args=(model, optimizer, xb, yb)))
        scales.append(float(optimizer.scale[...]))
    assert scales == [4.0, 4.0, 8.0, 8.0]


def test_fixed_scale_still_skips_non_finite_steps(devices):
    strategy, model, optimizer = scaled_setup(devices, dynamic=False, initial_scale=128.0)
    x, y = global_batches(1, 64)[0]
    x[:8] = np.inf
    ((xb, yb),) = list(strategy.experimental_distribute_dataset([(x, y)]))
    assert not bool(strategy.run(scaled_step, args=(model, optimizer, xb, yb)))
    assert float(optimizer.scale[...]) == 128.0


def test_scaled_training_equals_unscaled_training(devices):
    """Loss scaling by a power of two is exact: the same parameters as plain SGD."""
    batches = global_batches(3, 64)
    expected = train_single_device(batches, lambda: optax.sgd(0.5))
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = LossScaleOptimizer(model, optax.sgd(0.5))
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(scaled_step, args=(model, optimizer, xb, yb))
    got = params_of(model)
    for name, value in expected.items():
        assert max_relative_difference(got[name], value) <= 1e-5, name


def _float16_reference(batches, learning_rate):
    """Plain NNX and Optax on one device, no mirrored: float32 master weights, float16 compute,
    the mean float32 loss of each global batch, SGD on the float32 gradients (no loss scaling:
    scaling by a power of two and back is exact, so a scaled run must land here too)."""
    model = SmallMLP(rngs=nnx.Rngs(0))
    model.hidden.dtype = model.out.dtype = jnp.float16
    optimizer = nnx.Optimizer(model, optax.sgd(learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            logits = model(x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for x, y in batches:
        step(model, optimizer, x, y)
    return params_of(model)


@pytest.mark.parametrize("replicas", [1, 8])
def test_trainer_float16_with_loss_scaling_equals_plain_float16_sgd(devices, replicas):
    """mixed_float16 in the Trainer: the loss is scaled by 2**15 and the gradients must be
    unscaled before SGD applies them (Adam would hide a missing unscale: it is scale-free)."""
    batches = global_batches(4, 64, seed=5)
    start = params_of(SmallMLP(rngs=nnx.Rngs(0)))
    expected = _float16_reference(batches, 0.5)
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.5),
            "sparse_categorical_crossentropy",
            from_logits=True,
            policy="mixed_float16",
        )
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    trainer.fit(x, y, batch_size=64, shuffle=False, verbose=0)
    assert isinstance(trainer.optimizer, LossScaleOptimizer)
    assert int(trainer.optimizer.step[...]) == 4  # no step skipped
    assert float(trainer.optimizer.scale[...]) == 2.0**15
    got = params_of(model)
    for name, value in expected.items():
        # float16 rounds the per-replica gradients before they are summed: compare the updates
        # (a missing unscale makes them 32768 times larger).
        moved = value - start[name]
        assert np.max(np.abs(moved)) > 1e-3, name
        assert max_relative_difference(got[name] - start[name], moved) <= 5e-3, name


def test_loss_scale_state_is_checkpointed(devices, tmp_path):
    _, model, optimizer = scaled_setup(devices, initial_scale=64.0)
    mirrored.save_checkpoint(tmp_path, model, optimizer)
    _, other_model, other = scaled_setup(devices[:2])
    mirrored.restore_checkpoint(tmp_path, other_model, other)
    assert float(other.scale[...]) == 64.0


@pytest.fixture(scope="module")
def digits():
    from mirrored._cli.demo import load_digits_split

    return load_digits_split()


def _digits_accuracy(devices, digits, policy):
    from mirrored._cli.demo import DigitsMLP

    x, y, xt, yt = digits
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        trainer = mirrored.Trainer(
            DigitsMLP(rngs=nnx.Rngs(0)),
            optax.adam(3e-3),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
            policy=policy,
        )
    trainer.fit(x, y, batch_size=128, epochs=12, verbose=0)
    return trainer, trainer.evaluate(xt, yt)["accuracy"]


def test_mixed_precision_policies_match_float32_accuracy(devices, digits):
    _, reference = _digits_accuracy(devices, digits, "float32")
    bf16, bf16_accuracy = _digits_accuracy(devices, digits, "mixed_bfloat16")
    f16, f16_accuracy = _digits_accuracy(devices, digits, "mixed_float16")
    assert reference > 0.9
    assert abs(bf16_accuracy - reference) <= 0.02 and abs(f16_accuracy - reference) <= 0.02
    assert bf16.model.hidden.dtype == jnp.bfloat16
    assert bf16.model.hidden.kernel.get_value().dtype == jnp.float32  # master weights
    assert isinstance(f16.optimizer, LossScaleOptimizer)  # automatic with mixed_float16
    assert not isinstance(bf16.optimizer, LossScaleOptimizer)


def test_global_policy(devices):
    mirrored.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        assert mirrored.mixed_precision.global_policy() == Policy("mixed_bfloat16")
        strategy = mirrored.MirroredStrategy(devices)
        with strategy.scope():
            trainer = mirrored.Trainer(SmallMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), "mse")
        assert trainer.policy.compute_dtype == jnp.bfloat16
    finally:
        mirrored.mixed_precision.set_global_policy("float32")
    with pytest.raises(ValueError, match="found 'float16'"):
        Policy("float16")


def test_clipping_uses_the_global_batch_norm(devices):
    x, y = global_batches(1, 64)[0]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))

    def norm_of_grads(model, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example)

        return optax.tree.norm(nnx.grad(loss_fn)(model))

    ((xb, yb),) = list(strategy.experimental_distribute_dataset([(x, y)]))
    replicated_norm = float(strategy.run(norm_of_grads, args=(model, xb, yb)))
    single = SmallMLP(rngs=nnx.Rngs(0))

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    single_norm = float(optax.tree.norm(nnx.grad(loss_fn)(single)))
    np.testing.assert_allclose(replicated_norm, single_norm, rtol=1e-6)


def test_trainer_clipping_equals_single_device_clipping(devices):
    x = np.concatenate([b[0] for b in global_batches(3, 32)])
    y = np.concatenate([b[1] for b in global_batches(3, 32)])
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)]
    make = lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5))  # noqa: E731
    expected = train_single_device(batches, make)
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.5),
            "sparse_categorical_crossentropy",
            from_logits=True,
            global_clipnorm=0.05,
        )
    trainer.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    got = params_of(model)
    for name, value in expected.items():
        assert max_relative_difference(got[name], value) <= 1e-5, name


def test_accumulation_equals_one_step_on_a_k_times_larger_batch(devices):
    x, y = global_batches(1, 64)[0]
    expected = train_single_device([(x, y)], lambda: optax.sgd(0.5))
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.5),
            "sparse_categorical_crossentropy",
            from_logits=True,
            gradient_accumulation_steps=4,
        )
    trainer.fit(x, y, batch_size=16, shuffle=False, verbose=0)  # 4 micro-batches of 16
    got = params_of(model)
    for name, value in expected.items():
        assert max_relative_difference(got[name], value) <= 1e-5, name


def test_building_blocks_refuse_a_built_optimizer(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        built = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        with pytest.raises(ValueError, match="pass the Optax transformation itself"):
            mirrored.Trainer(model, built, "mse", global_clipnorm=1.0)
        with pytest.raises(ValueError, match="positive int"):
            mirrored.Trainer(model, optax.sgd(0.1), "mse", gradient_accumulation_steps=0)
