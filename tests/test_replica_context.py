"""Collectives inside strategy.run, and the N× gradient trap they refuse."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, global_batches


@pytest.fixture
def strategy(devices):
    return mirrored.MirroredStrategy(devices)


def replica_ids(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array(ctx.replica_id_in_sync_group, np.float32)
    )


def test_replica_id_and_all_reduce(strategy):
    def fn(i):
        ctx = mirrored.get_replica_context()
        same = ctx.replica_id_in_sync_group == i.astype(jnp.int32)
        return {
            "ids_match": same,
            "sum": ctx.all_reduce("SUM", i),
            "mean": ctx.all_reduce(mirrored.ReduceOp.MEAN, i),
            "max": ctx.all_reduce("MAX", i),
            "min": ctx.all_reduce("MIN", i),
            "n": ctx.num_replicas_in_sync,
        }

    out = strategy.run(fn, args=(replica_ids(strategy),))
    assert bool(strategy.reduce("MIN", out["ids_match"]))
    assert float(out["sum"]) == 28.0 and float(out["mean"]) == 3.5
    assert float(out["max"]) == 7.0 and float(out["min"]) == 0.0
    assert int(out["n"]) == 8


def test_all_gather_in_replica_order(strategy):
    def fn(i):
        return mirrored.get_replica_context().all_gather(i[None], axis=0)

    out = strategy.run(fn, args=(replica_ids(strategy),))
    for local in strategy.experimental_local_results(out):  # every replica has all of it
        np.testing.assert_array_equal(local, np.arange(8, dtype=np.float32))


def _gradients_step(strategy, combine):
    """A mirrored model and SGD, and a step whose gradients `combine` changes first."""
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example)

        optimizer.update(model, combine(nnx.grad(loss_fn)(model)))

    return model, optimizer, step


def test_all_reduce_of_mirrored_gradients_explains_the_trap(strategy):
    model, optimizer, step = _gradients_step(
        strategy, lambda grads: mirrored.get_replica_context().all_reduce("MEAN", grads)
    )
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    with pytest.raises(ValueError, match="already identical on every replica") as info:
        strategy.run(step, args=(model, optimizer, x, y))
    message = str(info.value)
    assert "already SUMS the gradients" in message and "compute_average_loss" in message
    assert "Wrong:" in message and "Right:" in message
    assert int(optimizer.step[...]) == 0


def test_a_hand_written_psum_of_mirrored_gradients_is_warned(strategy, caplog):
    """`jax.lax.psum(grads, "replica")` bypasses all_reduce's refusal and gave N× the update
    silently (found by a review); a psum of replica-varying values, or psum(1) to count the
    replicas, is not warned."""
    model, optimizer, step = _gradients_step(
        strategy, lambda grads: jax.tree.map(lambda g: jax.lax.psum(g, "replica"), grads)
    )

    def counted(x):
        replicas = jax.lax.psum(1, "replica")
        return jax.lax.psum(jnp.sum(x), "replica") / replicas

    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    with caplog.at_level("WARNING", logger="mirrored"):
        strategy.run(counted, args=(x,))
        assert "sums over the replicas" not in caplog.text
        strategy.run(step, args=(model, optimizer, x, y))
    assert "'step' sums over the replicas (jax.lax.psum" in caplog.text
    assert "already summed over the replicas by jax.grad" in caplog.text


def test_default_replica_context_is_identity():
    ctx = mirrored.get_replica_context()
    assert ctx.replica_id_in_sync_group == 0
    assert ctx.all_reduce("SUM", 3.0) == 3.0


def test_a_random_key_captured_by_the_step_is_warned(strategy, caplog):
    """A captured key is a constant: the same mask on every replica and step (a review)."""
    key = jax.random.key(0)

    def noisy(x):
        return x * jax.random.bernoulli(key, 0.5, x.shape)

    ((x, _),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    with caplog.at_level("WARNING", logger="mirrored"):
        strategy.run(noisy, args=(x,))
    assert "'noisy' captures the random key 'key'" in caplog.text and "fold_in" in caplog.text
