"""compute_average_loss and scale_regularization_loss."""

import jax.numpy as jnp
import numpy as np
import pytest

import mirrored


@pytest.fixture
def strategy(devices):
    return mirrored.MirroredStrategy(devices)


def test_divides_by_the_global_batch(strategy):
    ones = strategy.experimental_distribute_dataset([np.ones((64, 3), np.float32)])
    (batch,) = list(ones)

    def fn(x):
        return mirrored.compute_average_loss(x[:, 0])  # 8 rows per replica, 64 in all

    out = strategy.run(fn, args=(batch,))
    np.testing.assert_array_equal(strategy.experimental_local_results(out)[0], 8 / 64)
    assert float(strategy.reduce("SUM", out)) == 1.0


def test_explicit_global_batch_and_weights(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.ones((16,), np.float32)]))

    def fn(x):
        weights = jnp.full_like(x, 0.5)
        return mirrored.compute_average_loss(x, global_batch_size=32, sample_weight=weights)

    # each replica: 2 rows * 0.5 / 32
    assert float(strategy.reduce("SUM", strategy.run(fn, args=(batch,)))) == 8 / 32


def test_outside_run_uses_one_replica():
    assert float(mirrored.compute_average_loss(jnp.array([1.0, 2.0, 3.0]))) == 2.0
    assert float(mirrored.scale_regularization_loss(jnp.array([1.0, 3.0]))) == 4.0


def test_regularization_is_divided_by_replicas(strategy):
    def fn(x):
        return mirrored.scale_regularization_loss(jnp.float32(8.0)) + 0 * x.sum()

    (batch,) = list(strategy.experimental_distribute_dataset([np.ones((8,), np.float32)]))
    assert float(strategy.reduce("SUM", strategy.run(fn, args=(batch,)))) == 8.0


def test_scalar_loss_is_refused():
    with pytest.raises(ValueError, match="found a scalar") as info:
        mirrored.compute_average_loss(jnp.float32(1.0))
    assert "without .mean()" in str(info.value)


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        (0, ValueError, "must be positive"),
        (-4, ValueError, "must be positive"),
        (True, TypeError, "must be an integer"),
        (4.0, TypeError, "must be an integer"),
        (np.float32(4), TypeError, "must be an integer"),
        (np.array([4, 4]), ValueError, "must be scalar"),
    ],
)
def test_bad_global_batch_size(bad, error, message):
    # TensorFlow's checks on global_batch_size (nn_impl.compute_average_loss): integer, scalar,
    # positive; a float is a TypeError there too.
    with pytest.raises(error, match=message):
        mirrored.compute_average_loss(jnp.ones(3), global_batch_size=bad)


def test_per_replica_size_as_global_batch_is_refused(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.ones((64,), np.float32)]))

    def fn(x):
        return mirrored.compute_average_loss(x, global_batch_size=8)

    with pytest.raises(ValueError, match=r"GLOBAL batch size.*global batch is 64") as info:
        strategy.run(fn, args=(batch,))
    assert "8× too large" in str(info.value)
