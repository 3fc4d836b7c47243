"""reduce, gather, local results and PerReplica's refusals."""

import jax
import numpy as np
import pytest

import mirrored


@pytest.fixture
def strategy(devices):
    return mirrored.MirroredStrategy(devices)


def per_replica_rows(strategy):
    """Replica i holds [[i, 10 + i, -i], [2i, 3, 5 - i]]."""

    def value(ctx):
        i = ctx.replica_id_in_sync_group
        return np.array([[i, 10 + i, -i], [2 * i, 3, 5 - i]], np.float32)

    expected = np.stack([value(mirrored.ValueContext(i, 8)) for i in range(8)])
    return strategy.experimental_distribute_values_from_function(value), expected


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX", "MIN", mirrored.ReduceOp.SUM, "mean"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_reduce_matches_numpy(strategy, op, axis):
    value, stacked = per_replica_rows(strategy)
    name = mirrored.ReduceOp.parse(op).value
    numpy_op = {"SUM": np.sum, "MEAN": np.mean, "MAX": np.max, "MIN": np.min}[name]
    axes = (0,) if axis is None else (0, axis % 2 + 1)
    got, want = strategy.reduce(op, value, axis=axis), numpy_op(stacked, axes)
    if name == "MEAN":  # one float32 division: equal up to rounding
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:  # sums of small integers, maxima, minima: exact
        np.testing.assert_array_equal(got, want)


def test_mean_over_an_axis_divides_by_the_global_count(strategy):
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((4,), ctx.replica_id_in_sync_group, np.float32)
    )
    # 32 elements in all: (0 + 1 + ... + 7) * 4 / 32 = 3.5
    assert float(strategy.reduce("MEAN", value, axis=0)) == 3.5


def test_reduce_of_a_mirrored_value_counts_every_replica(strategy):
    """A value every replica's device holds (as run returns one the same on every replica)
    sums N times; one host value is TensorFlow's error for SUM (MirroredStrategy's
    reduce_non_distributed_value), returned as it is by MEAN."""
    mirrored_value = jax.device_put(np.float32(2.0), strategy._replicated)
    assert float(strategy.reduce("SUM", mirrored_value)) == 16.0
    assert float(strategy.reduce("MEAN", np.float32(2.0))) == 2.0
    with pytest.raises(ValueError, match=r"found np.float32\(2.0\).*count it 8 times"):
        strategy.reduce("SUM", np.float32(2.0))


def test_reduce_rejects_bad_op_and_axis(strategy):
    value, _ = per_replica_rows(strategy)
    with pytest.raises(ValueError, match="one of \\['SUM', 'MEAN', 'MAX', 'MIN'\\]; found 'AVG'"):
        strategy.reduce("AVG", value)
    with pytest.raises(
        ValueError, match="axis to be None, an int or a tuple of distinct ints in \\[-2, 2\\)"
    ):
        strategy.reduce("SUM", value, axis=2)


def test_gather_concatenates_in_replica_order(strategy):
    value, stacked = per_replica_rows(strategy)
    np.testing.assert_array_equal(strategy.gather(value, axis=0), np.concatenate(stacked, 0))
    np.testing.assert_array_equal(strategy.gather(value, axis=1), np.concatenate(stacked, 1))


def test_local_results_are_on_their_devices(strategy, devices):
    value, stacked = per_replica_rows(strategy)
    results = strategy.experimental_local_results(value)
    assert len(results) == 8
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result, stacked[i])
        assert result.sharding.device_set == {devices[i]}


def test_reduce_and_local_results_accept_pytrees(strategy):
    value, stacked = per_replica_rows(strategy)
    reduced = strategy.reduce("SUM", {"a": value, "b": [value]})
    np.testing.assert_array_equal(reduced["b"][0], stacked.sum(0))
    local = strategy.experimental_local_results({"a": value})
    assert len(local) == 8 and set(local[3]) == {"a"}


def test_distribute_values_requires_one_shape(strategy):
    with pytest.raises(ValueError, match="arrays of one shape"):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: np.zeros(ctx.replica_id_in_sync_group + 1)
        )


@pytest.mark.parametrize(
    ("use", "what"),
    [
        (lambda v: list(v), "Iterating over"),
        (lambda v: float(v), "Converting to float"),
        (lambda v: bool(v), "truth value"),
        (lambda v: np.asarray(v), "NumPy array"),
        (lambda v: v[0], "Indexing"),
        (lambda v: 0.0 + v, "Arithmetic on"),  # `total_loss += loss` without a reduce
        (lambda v: v / 2, "Arithmetic on"),
        (lambda v: -v, "Arithmetic on"),
        (lambda v: v % 2, "Arithmetic on"),
        (lambda v: round(v), "Arithmetic on"),
        (lambda v: v < 1.0, "Comparing"),  # `if loss < best:` before a reduce
        (lambda v: f"{v:.4f}", "Formatting"),
        (lambda v: v.numpy(), r"\.numpy\(\)"),
        (lambda v: v.item(), r"\.item\(\)"),
    ],
)
def test_per_replica_refuses_ambiguous_use(strategy, use, what):
    value, _ = per_replica_rows(strategy)
    with pytest.raises(TypeError, match=what) as info:
        use(value)
    message = str(info.value)
    assert "8 values, one per replica" in message and "strategy.reduce('SUM'" in message


def test_per_replica_repr_explains_how_to_read(strategy):
    value, _ = per_replica_rows(strategy)
    assert "num_replicas=8, shape=(2, 3)" in repr(value)
    assert f"{value}" == repr(value)  # print(f"loss {loss}") still describes it
    assert "strategy.reduce" in repr(value)


def test_run_output_reduces_exactly(strategy):
    def fn(x):
        return x * 2.0

    value, stacked = per_replica_rows(strategy)
    out = strategy.run(fn, args=(value,))
    assert isinstance(out, mirrored.PerReplica)
    np.testing.assert_array_equal(strategy.reduce("SUM", out), (stacked * 2).sum(0))
    assert jax.tree.leaves(out) == [out]  # a leaf, not a pytree of per-device values


def test_reduce_and_gather_inside_run_are_refused_as_in_tensorflow(strategy):
    """Inside the step each replica reduced only its own value: `reduce("SUM", ...)` gave 8×
    its own sum and `gather` its own rows 8 times, silently (found by a review). TensorFlow
    raises RuntimeError (cross-replica context only); the message names the in-step way."""
    batches = strategy.experimental_distribute_dataset(
        np.arange(16, dtype=np.float32), batch_size=16
    )
    (batch,) = list(batches)
    for call, instead in [
        (lambda a: strategy.reduce("SUM", a.sum(), axis=None), "all_reduce('SUM', value)"),
        (lambda a: strategy.gather(a, axis=0), "all_gather(value, 0)"),
    ]:
        with pytest.raises(RuntimeError, match="cross-replica context") as error:
            strategy.run(call, args=(batch,))
        assert instead in str(error.value)
    totals = strategy.run(lambda a: a.sum(), args=(batch,))  # the host way still works
    assert float(strategy.reduce("SUM", totals, axis=None)) == 120.0


def test_tensorflow_iterator_and_per_replica_habits(strategy):
    """`iterator.get_next()` works as in TensorFlow; `.values` of a PerReplica and an unknown
    iterator attribute are errors that give the fix (they named internal classes before)."""
    iterator = iter(
        strategy.experimental_distribute_dataset(np.arange(32, dtype=np.float32), batch_size=16)
    )
    first = iterator.get_next()
    second = next(iterator)
    assert strategy.gather(first, axis=0).tolist() == list(range(16))
    assert strategy.gather(second, axis=0).tolist() == list(range(16, 32))
    with pytest.raises(StopIteration):
        iterator.get_next()
    with pytest.raises(AttributeError, match="experimental_local_results"):
        first.values  # noqa: B018
    with pytest.raises(AttributeError, match="get_next"):
        iterator.next_batch  # noqa: B018


def test_the_scope_and_local_results_inside_a_step_act_as_in_tensorflow(strategy):
    """TensorFlow lets a step enter its strategy's scope again and gives a replica's own
    value from experimental_local_results; both raised JAX's set_mesh error."""
    batches = strategy.experimental_distribute_dataset(
        np.arange(16, dtype=np.float32), batch_size=16
    )
    (batch,) = list(batches)

    def step(a):
        with strategy.scope():
            (own,) = strategy.experimental_local_results(a)
        return own * 2

    doubled = strategy.run(step, args=(batch,))
    assert strategy.gather(doubled, axis=0).tolist() == [2.0 * i for i in range(16)]


def test_a_step_returning_a_string_says_what_a_step_may_return(strategy):
    with pytest.raises(TypeError, match=r"return arrays, numbers or None.*found str 'done'"):
        strategy.run(lambda: "done")


def test_a_mean_of_loss_shares_is_warned(strategy, caplog, monkeypatch):
    """`strategy.reduce("MEAN", per_replica_loss)` of compute_average_loss' shares is the
    loss / N, silently before (a review); SUM is the loss, and a per-replica mean of a
    step without compute_average_loss averages correctly, unwarned."""
    from mirrored._strategy import cross_replica

    monkeypatch.setattr(cross_replica, "_warned_shares", [])
    (x,) = list(strategy.experimental_distribute_dataset(np.arange(16.0), batch_size=16))
    shares = strategy.run(lambda x: mirrored.compute_average_loss(x**2), args=(x,))
    means = strategy.run(lambda x: x.mean(), args=(x,))
    with caplog.at_level("WARNING", logger="mirrored.loss"):
        assert float(strategy.reduce("SUM", shares, axis=None)) == np.mean(np.arange(16.0) ** 2)
        assert float(strategy.reduce("MEAN", means, axis=None)) == 7.5
        assert "loss / N" not in caplog.text
        strategy.reduce("MEAN", shares, axis=None)
    assert "their MEAN is the loss / N" in caplog.text and "reduce('SUM'" in caplog.text


def test_a_checkpoint_inside_a_step_is_refused_and_cross_device_ops_ignored(
    strategy, tmp_path, caplog
):
    """save_checkpoint inside the step raised a raw ConcretizationTypeError, and
    restore_checkpoint called a good checkpoint corrupt and said to delete it (a review)."""
    from flax import nnx

    with strategy.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    mirrored.save_checkpoint(tmp_path / "ok", model)
    for call in (
        lambda m: mirrored.save_checkpoint(tmp_path / "inside", m),
        lambda m: mirrored.restore_checkpoint(tmp_path / "ok", m),
    ):
        with pytest.raises(RuntimeError, match="inside the step of strategy.run.*between steps"):
            strategy.run(call, args=(model,))
    assert mirrored.latest_checkpoint(tmp_path / "ok") is not None
    with caplog.at_level("WARNING", logger="mirrored"):
        mirrored.MirroredStrategy(cross_device_ops=object())
    assert "XLA picks the collective" in caplog.text
