"""experimental_distribute_dataset: global batches in, one shard per replica out."""

import jax
import numpy as np
import pytest

import mirrored


@pytest.fixture
def strategy(devices):
    return mirrored.MirroredStrategy(devices)


def test_arrays_with_global_batch_size(strategy, devices):
    x = np.arange(128 * 2, dtype=np.float32).reshape(128, 2)
    y = np.arange(128)
    dist = strategy.experimental_distribute_dataset((x, y), batch_size=64)
    assert len(dist) == 2
    seen = []
    for xb, yb in dist:
        assert isinstance(xb, mirrored.PerReplica) and xb.shape == (8, 2)
        for i, local in enumerate(strategy.experimental_local_results(yb)):
            assert local.sharding.device_set == {devices[i]}
            seen.extend(np.asarray(local).tolist())
    assert seen == list(range(128))  # in order, each row once


def test_shuffle_is_seeded_and_differs_per_epoch(strategy):
    y = np.arange(64)

    def epoch(dist):
        return np.concatenate([np.asarray(strategy.gather(b, 0)) for (b,) in dist])

    first = strategy.experimental_distribute_dataset((y,), batch_size=16, shuffle=True, seed=3)
    again = strategy.experimental_distribute_dataset((y,), batch_size=16, shuffle=True, seed=3)
    e1, e2 = epoch(first), epoch(first)
    assert sorted(e1) == list(range(64)) and not np.array_equal(e1, e2)
    assert np.array_equal(e1, epoch(again))


def test_iterables_and_dicts_of_batches(strategy):
    batches = [{"x": np.ones((16, 3)), "y": np.zeros(16)} for _ in range(3)]
    dist = strategy.experimental_distribute_dataset(batches)
    out = list(dist)
    assert len(out) == 3 and set(out[0]) == {"x", "y"}
    assert out[0]["x"].shape == (2, 3)
    gen = strategy.experimental_distribute_dataset(b for b in batches)
    assert len(list(gen)) == 3


def test_drop_remainder(strategy):
    dist = strategy.experimental_distribute_dataset(
        (np.zeros((100, 1)),), batch_size=32, drop_remainder=True
    )
    assert len(dist) == 3 and len(list(dist)) == 3


def test_indivisible_batch_explains_the_fix(strategy):
    dist = strategy.experimental_distribute_dataset((np.zeros((100, 1)),), batch_size=32)
    with pytest.raises(ValueError, match=r"batch of 4 rows \(4 / 8 = 0.5 per replica\)") as info:
        list(dist)
    assert "drop_remainder=True" in str(info.value)


@pytest.mark.parametrize(
    ("batches", "error", "match"),
    [
        ([(np.zeros((8, 2)), np.zeros(16))], ValueError, r"same leading \(batch\) size"),
        ([(np.zeros((8, 2)), "labels")], TypeError, "found str"),
        ([], ValueError, "yielded none"),
        ([(np.zeros((8, 2)),), {"x": np.zeros((8, 2))}], ValueError, "structure of the first"),
        ([(np.zeros((0, 2)),)], ValueError, "0 rows"),
        ([(np.float32(1.0),)], ValueError, "leading batch axis"),
    ],
)
def test_bad_batches(strategy, batches, error, match):
    with pytest.raises(error, match=match):
        list(strategy.experimental_distribute_dataset(batches))


def test_arrays_need_a_batch_size(strategy):
    with pytest.raises(TypeError, match="batch_size=256"):
        strategy.experimental_distribute_dataset(np.zeros((8, 2)))
    with pytest.raises(ValueError, match="GLOBAL batch size"):
        strategy.experimental_distribute_dataset((np.zeros((8, 2)),), batch_size=0)


def test_jax_arrays_are_accepted(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([jax.numpy.ones((16, 2))]))
    assert batch.global_value.sharding.spec == jax.sharding.PartitionSpec(mirrored.REPLICA_AXIS)
