"""ShardedOptimizer (issue 38, ZeRO stage 1): the optimizer state split over the replicas, the
replicated run's numbers, to the bit for elementwise transformations."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, train_step
from mirrored._core.mesh import sharded_spec

RNG = np.random.default_rng(0)
X = RNG.normal(size=(100, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 100).astype(np.int32)
TRANSFORMS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _trained(devices, make, tx, epochs=4):
    """`epochs` passes of 100 rows at batch 24 (the fifth batch of each is ragged)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = make(model, TRANSFORMS[tx]())
    dataset = strategy.experimental_distribute_dataset((X, Y), batch_size=24, shuffle=False)
    for _ in range(epochs):
        for x, y in dataset:
            strategy.run(train_step, args=(model, optimizer, x, y))
    return model, optimizer


def _arrays(*objects):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(objects))]


def _replicated(model, tx):
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize(
    ("tx", "n"),
    [("sgd", 8), ("adam", 1), ("adam", 2), ("adam", 8), ("clip_adam", 8), ("multisteps", 8)],
)
def test_zero1_gives_the_replicated_run_to_the_bit(devices, tx, n):
    """20 steps, ragged batches included: parameters and optimizer state bitwise equal to
    nnx.Optimizer's, whose state is mirrored (clip_by_global_norm sees the whole gradient)."""
    ours = _trained(devices[:n], mirrored.ShardedOptimizer, tx)
    theirs = _trained(devices[:n], _replicated, tx)
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        assert np.array_equal(a, b)


def test_zero1_adafactor_sums_its_factored_moments_in_another_order(devices):
    """Adafactor reduces each leaf's squared gradients to row and column means; split, XLA
    sums the shards in another order: within a few float32 ulps, not to the bit."""
    ours = _trained(devices, mirrored.ShardedOptimizer, "adafactor")
    theirs = _trained(devices, _replicated, "adafactor")
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_the_state_is_split_and_the_model_stays_mirrored(devices):
    model, optimizer = _trained(devices, mirrored.ShardedOptimizer, "adam", epochs=1)
    first = devices[0]
    whole = here = 0
    for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state)):
        assert leaf.sharding.spec == sharded_spec(leaf.shape, 8), (leaf.shape, leaf.sharding)
        whole += leaf.nbytes
        here += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == first)
    # SmallMLP's Adam moments: 2 x 581 floats; out.bias (5 floats) and the count stay whole.
    assert here == 2 * (581 - 5) * 4 // 8 + 2 * 5 * 4 + 4, here
    assert here <= 1.05 * whole / 8 + 2 * 5 * 4 + 4
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert leaf.sharding.is_fully_replicated


def test_a_trainer_with_sharded_state_fits_as_the_mirrored_one(devices):
    def fitted(**options):
        strategy = mirrored.MirroredStrategy(devices)
        with strategy.scope():
            trainer = mirrored.Trainer(
                SmallMLP(rngs=nnx.Rngs(0)),
                optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                "sparse_categorical_crossentropy",
                ["accuracy"],
                from_logits=True,
                **options,
            )
        history = trainer.fit(X, Y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        return trainer, history.history

    sharded, ours = fitted(shard_optimizer_state=True)
    mirrored_, theirs = fitted()
    assert isinstance(sharded.optimizer, mirrored.ShardedOptimizer)
    assert ours == theirs
    both = zip(_arrays(sharded.model), _arrays(mirrored_.model), strict=True)
    assert all(np.array_equal(a, b) for a, b in both)


def test_a_checkpoint_of_sharded_state_restores_onto_any_layout(devices, tmp_path):
    """Saved split over 8 replicas; restored into a mirrored nnx.Optimizer on 2 and into a
    ShardedOptimizer on 2, which keeps its layout; training on from either gives the same."""
    model, optimizer = _trained(devices, mirrored.ShardedOptimizer, "adam", epochs=1)
    mirrored.save_checkpoint(tmp_path, model, optimizer, step=5)
    saved = _arrays(model, optimizer)
    resumed = []
    for make in (_replicated, mirrored.ShardedOptimizer):
        strategy = mirrored.MirroredStrategy(devices[:2])
        with strategy.scope():
            target = SmallMLP(rngs=nnx.Rngs(7))
            target_optimizer = make(target, optax.adam(1e-2))
        assert mirrored.restore_checkpoint(tmp_path, target, target_optimizer) == 5
        restored = _arrays(target, target_optimizer)
        assert all(np.array_equal(a, b) for a, b in zip(saved, restored, strict=True))
        if make is mirrored.ShardedOptimizer:
            mu = target_optimizer.opt_state[0].mu["hidden"]["kernel"]
            assert mu.get_raw_value().sharding.spec == sharded_spec((12, 32), 2)
        for x, y in strategy.experimental_distribute_dataset((X, Y), batch_size=24, shuffle=False):
            strategy.run(train_step, args=(target, target_optimizer, x, y))
        resumed.append(_arrays(target))
    for a, b in zip(*resumed, strict=True):
        assert np.array_equal(a, b)


def test_what_it_does_not_do_yet_is_a_clear_error(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model = SmallMLP(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"inside strategy.scope\(\).*Fix"):
        mirrored.ShardedOptimizer(model, optax.adam(1e-3))
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        with pytest.raises(NotImplementedError, match="shard_gradients=False"):
            mirrored.ShardedOptimizer(model, optax.adam(1e-3), shard_gradients=True)
        optimizer = mirrored.ShardedOptimizer(model, optax.adam(1e-3))
        with pytest.raises(NotImplementedError, match="steps_per_execution=1"):
            mirrored.Trainer(
                model, optax.adam(1e-3), "mse", steps_per_execution=4, shard_optimizer_state=True
            )
        with pytest.raises(ValueError, match="shard_optimizer_state to be False, True"):
            mirrored.Trainer(model, optax.adam(1e-3), "mse", shard_optimizer_state="yes")
    iterator = iter(strategy.experimental_distribute_dataset((X, Y), batch_size=16))
    with pytest.raises(NotImplementedError, match="run_steps does not run a ShardedOptimizer"):
        strategy.run_steps(train_step, iterator, steps=2, args=(model, optimizer))
    x, y = next(iterator)
    mirrored.debug.enable_check_numerics()
    try:
        with pytest.raises(NotImplementedError, match="check_numerics .* ShardedOptimizer"):
            strategy.run(train_step, args=(model, optimizer, x, y))
    finally:
        mirrored.debug.disable_check_numerics()


def test_the_doctor_shows_memory_per_device_and_what_sharding_saves(devices):
    """verify's "Memory per device": the split state at about 1/8 (PASS), a mirrored one with
    what splitting would save (INFO), and a ShardedOptimizer whose state was placed whole
    again (FAIL: the silent no-op)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        split = mirrored.ShardedOptimizer(model, optax.adam(1e-2))
        whole = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset([(X[:16], Y[:16])])

    def memory(optimizer):
        report = mirrored.verify(strategy, train_step, (model, optimizer, x, y))
        return report["Memory per device"], report

    check, report = memory(split)
    assert check.status == "PASS", check.summary
    state = check.data["optimizer state"]
    assert state["replicated"] == 2 * 581 * 4 + 4
    assert state["now"] == 2 * (581 - 5) * 4 // 8 + 2 * 5 * 4 + 4
    # out.bias's two moments (5 floats each) and Adam's count.
    assert "44 B in 3 leaves not divisible by 8 stay whole" in check.summary
    assert check.data["collectives"]["all-gather"] >= 1, check.data
    assert report["Replicas in sync"].status == "PASS"
    check, _ = memory(whole)
    assert check.status == "INFO" and "mirrored.ShardedOptimizer would hold" in check.summary
    for variable in jax.tree.leaves(split.opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        variable.set_raw_value(jax.device_put(variable.get_raw_value(), strategy._replicated))
    check, _ = memory(split)
    assert check.status == "FAIL" and "still whole on every device" in check.summary
