# ruff: noqa: E501  (the "# TF: <path>::<Class>.<test>" source lines are longer than 100)
"""Conformance: reduce, gather, replica context and strategy context, ported from TensorFlow.

Every test names the TensorFlow test it ports (repository tensorflow/tensorflow) and keeps its
inputs and expected values. TensorFlow's strategy combinations become mirrored strategies over
1, 2 and 8 simulated CPU devices, OneDeviceStrategy("/cpu:0") and the default strategy
(`mirrored.get_strategy()` outside every scope).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrored

ALL = ["default", "one_device", "mirrored1", "mirrored2", "mirrored8"]
MULTI = ["mirrored2", "mirrored8"]
ONE_REPLICA = ["default", "one_device"]


@pytest.fixture(scope="module")
def strategies():
    devices = jax.devices()
    assert len(devices) == 8, "conftest must simulate 8 CPU devices"
    assert not mirrored.has_strategy()
    return {
        "default": mirrored.get_strategy(),
        "one_device": mirrored.OneDeviceStrategy("/cpu:0"),
        "mirrored1": mirrored.MirroredStrategy(devices[:1]),
        "mirrored2": mirrored.MirroredStrategy(devices[:2]),
        "mirrored8": mirrored.MirroredStrategy(devices),
    }


@pytest.fixture(params=ALL)
def strategy(request, strategies):
    return strategies[request.param]


@pytest.fixture(params=MULTI)
def multi(request, strategies):
    return strategies[request.param]


@pytest.fixture
def two(strategies):
    return strategies["mirrored2"]


def local(strategy, value):
    """experimental_local_results as NumPy, one entry per replica."""
    return [jax.tree.map(np.asarray, v) for v in strategy.experimental_local_results(value)]


def assert_default_state():
    """TF's _assert_in_default_state, through mirrored's public API."""
    ctx = mirrored.get_replica_context()
    assert ctx is not None
    assert ctx.num_replicas_in_sync == 1
    assert not mirrored.in_cross_replica_context()
    assert not mirrored.has_strategy()
    assert mirrored.get_strategy() is ctx.strategy
    assert mirrored.get_strategy().num_replicas_in_sync == 1


# -- ReduceTest -----------------------------------------------------------------------------------


# TF: tensorflow/python/distribute/strategy_common_test.py::ReduceTest.testBasic
def test_reduce_basic(strategy):
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: np.ones((), np.float32)
    )
    n = strategy.num_replicas_in_sync
    with strategy.scope():
        assert float(strategy.reduce(mirrored.ReduceOp.SUM, per_replica_value, axis=None)) == n
    assert float(strategy.reduce(mirrored.ReduceOp.SUM, per_replica_value, axis=None)) == n


# TF: tensorflow/python/distribute/strategy_common_test.py::ReduceTest.testAxis
def test_reduce_axis(strategy):
    x = strategy.run(lambda: jnp.array([1.0, 2.0]))
    assert float(strategy.reduce(mirrored.ReduceOp.MEAN, x, axis=0)) == 1.5
    n = strategy.num_replicas_in_sync
    assert float(strategy.reduce(mirrored.ReduceOp.SUM, x, axis=0)) == 3 * n


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testReduceHostTensor
def test_reduce_host_tensor(two):
    """TF runs it on 2 workers x 1 device: each worker's host value once, 2.0 (here in the
    2-process job, tests/_mw_script.py). On one worker of 2 replicas, TF's MirroredStrategy
    (`reduce_non_distributed_value`) refuses SUM of one host value, N times counted, unless it
    is zero; MEAN returns it; a value on every replica's device (run's output) sums N times."""
    with pytest.raises(ValueError, match=r"found 1\.0 \(float\).*refuses to sum over 2.*Fix"):
        two.reduce(mirrored.ReduceOp.SUM, 1.0, axis=None)
    with pytest.raises(ValueError, match=r"found an array of shape \(3, 4\) \(ndarray\)"):
        two.reduce("SUM", np.ones((3, 4), np.float32), axis=None)
    with pytest.raises(ValueError, match="refuses to sum over 2"):
        two.reduce("SUM", jnp.asarray(1.0), axis=None)  # on one device
    np.testing.assert_array_equal(two.reduce("SUM", np.zeros(3), axis=None), np.zeros(3))
    assert float(two.reduce(mirrored.ReduceOp.MEAN, jnp.asarray(1.0), axis=None)) == 1.0
    assert float(two.reduce("SUM", jnp.asarray([1.0, 2.0]), axis=0)) == 6.0  # run per replica
    mirrored_value = two.run(lambda: jax.lax.psum(1.0, "replica"))
    assert float(two.reduce("SUM", mirrored_value, axis=None)) == 4.0
    one = mirrored.MirroredStrategy(jax.devices()[:1])
    assert float(one.reduce("SUM", 1.0, axis=None)) == 1.0


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testReduceDeviceTensors
def test_reduce_device_tensors(two):
    value = two.run(lambda: jnp.asarray(1.0))
    assert float(two.reduce(mirrored.ReduceOp.SUM, value, axis=None)) == 2.0


# -- TestStrategyTest (a one-replica strategy, in and out of its scope) --------------------------


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testReduce
def test_reduce_in_and_out_of_scope(strategies):
    dist = mirrored.OneDeviceStrategy("/cpu:0")

    def check():
        x = jnp.asarray(1.0)
        assert float(dist.reduce(mirrored.ReduceOp.MEAN, x, axis=None)) == 1.0

    assert_default_state()
    check()
    with dist.scope():
        check()
    assert_default_state()
    # When run under a different strategy the test method should fail.
    another_strategy = mirrored.OneDeviceStrategy("/cpu:0")
    with pytest.raises(RuntimeError, match="[Mm]ixing"), another_strategy.scope(), dist.scope():
        check()
    assert_default_state()


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testReductions_acceptStringOps
@pytest.mark.parametrize("op", ["mean", "MEAN", "sum", "SUM"])
@pytest.mark.parametrize("name", ONE_REPLICA)
def test_reductions_accept_string_ops(strategies, name, op):
    dist = strategies[name]
    x = jnp.asarray(1.0)
    assert float(dist.reduce(op, x, axis=None)) == 1.0


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testReduceMeanAxis
@pytest.mark.parametrize("name", ONE_REPLICA)
def test_reduce_mean_axis(strategies, name):
    dist = strategies[name]
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(dist.reduce(mirrored.ReduceOp.MEAN, x, axis=None), x)
    np.testing.assert_array_equal(dist.reduce(mirrored.ReduceOp.MEAN, x, axis=0), [2.0, 3.0])
    # TF's axis=(0, 1) -> 2.5 is not ported: mirrored takes one int axis (see the report).


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testReduceSumAxis
@pytest.mark.parametrize("name", ONE_REPLICA)
def test_reduce_sum_axis(strategies, name):
    dist = strategies[name]
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(dist.reduce(mirrored.ReduceOp.SUM, x, axis=None), x)
    np.testing.assert_array_equal(dist.reduce(mirrored.ReduceOp.SUM, x, axis=0), [4.0, 6.0])


# -- strategy context: scope, run, nesting ------------------------------------------------------


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testScope
@pytest.mark.parametrize("name", ["one_device", "mirrored2", "mirrored8"])
def test_scope(strategies, name):
    assert_default_state()
    dist = strategies[name]
    with dist.scope():
        assert mirrored.get_replica_context() is None
        assert mirrored.in_cross_replica_context()
        assert mirrored.has_strategy()
        assert mirrored.get_strategy() is dist
    assert_default_state()


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testCallForEachReplica
@pytest.mark.parametrize("name", ["one_device", "mirrored2"])
def test_call_for_each_replica(strategies, name):
    assert_default_state()
    dist = strategies[name]

    def run_and_check():
        seen = []

        def run_fn(x):
            replica_context = mirrored.get_replica_context()
            seen.append(
                (
                    replica_context is not None,
                    mirrored.in_cross_replica_context(),
                    mirrored.has_strategy(),
                    mirrored.get_strategy() is dist,
                )
            )
            return x

        ones = dist.experimental_distribute_values_from_function(lambda _: np.float32(1.0))
        dist.run(run_fn, args=(ones,))
        assert seen and all(s == (True, False, True, True) for s in seen), seen

    run_and_check()  # run outside the scope
    with dist.scope():
        run_and_check()
    assert_default_state()


# TF: tensorflow/python/distribute/distribute_lib_test.py::TestStrategyTest.testSameScopeNesting
def test_same_scope_nesting(strategies):
    assert_default_state()
    dist = strategies["mirrored2"]
    scope_a = dist.scope()
    with scope_a:
        assert mirrored.get_strategy() is dist
        scope_b = dist.scope()
        with scope_b:
            assert mirrored.get_strategy() is dist
            with scope_a:
                assert mirrored.get_strategy() is dist
            assert mirrored.get_strategy() is dist
        assert mirrored.get_strategy() is dist
        dist2 = strategies["mirrored8"]
        scope2 = dist2.scope()
        with pytest.raises(RuntimeError, match="[Mm]ixing"), scope2:
            pass
    assert_default_state()
    with scope_b:
        assert mirrored.get_strategy() is dist
    assert_default_state()


# TF: tensorflow/python/distribute/distribute_lib_test.py::DefaultDistributionStrategyTest.testScopeMostlyNoOp
def test_default_scope_mostly_no_op():
    assert_default_state()
    default_strategy = mirrored.get_strategy()
    scope = default_strategy.scope()
    with scope:
        assert_default_state()
        with scope:
            assert_default_state()
        assert_default_state()
    assert_default_state()


# TF: tensorflow/python/distribute/distribute_lib_test.py::DefaultDistributionStrategyTest.testExperimentalRunV2
def test_default_strategy_run():
    default_strategy = mirrored.get_strategy()
    dataset = [np.arange(i, i + 2) for i in range(0, 10, 2)]  # range(10).batch(2)
    next_val = next(iter(default_strategy.experimental_distribute_dataset(dataset)))

    def train_step(input_data):
        return input_data

    for _ in range(2):
        out = default_strategy.run(train_step, args=(next_val,))
        np.testing.assert_array_equal(default_strategy.gather(out, axis=0), [0, 1])


# TF: tensorflow/python/distribute/distribute_lib_test.py::DefaultDistributionStrategyTest.testDistributedDatasets
def test_default_distributed_datasets():
    default_strategy = mirrored.get_strategy()
    dataset = [np.arange(i, i + 2) for i in range(0, 10, 2)]  # range(10).batch(2)
    next_val = next(iter(default_strategy.experimental_distribute_dataset(dataset)))
    np.testing.assert_array_equal(local(default_strategy, next_val)[0], [0, 1])


# TF: tensorflow/python/distribute/distribute_lib_test.py::DefaultDistributionStrategyTest.testDistributedDatasetsFromFunction
def test_default_distributed_datasets_from_function():
    default_strategy = mirrored.get_strategy()

    def dataset_fn(_):
        return [np.arange(i, i + 2) for i in range(0, 10, 2)]  # range(10).batch(2)

    dist = default_strategy.distribute_datasets_from_function(dataset_fn)
    next_val = next(iter(dist))
    np.testing.assert_array_equal(local(default_strategy, next_val)[0], [0, 1])


# TF: tensorflow/python/distribute/distribute_lib_test.py::InputContextTest.testProperties
def test_input_context_properties():
    input_context = mirrored.InputContext(
        num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6
    )
    assert input_context.num_replicas_in_sync == 6
    assert input_context.input_pipeline_id == 1
    assert input_context.num_input_pipelines == 2


# TF: tensorflow/python/distribute/distribute_lib_test.py::InputContextTest.testPerReplicaBatchSize
def test_input_context_per_replica_batch_size():
    input_context = mirrored.InputContext(
        num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6
    )
    assert input_context.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError):
        input_context.get_per_replica_batch_size(13)


# TF: tensorflow/python/distribute/distribute_lib_test.py::InputContextTest.testStr
def test_input_context_str():
    # Deliberate difference: the class is named mirrored.InputContext, not tf.distribute's.
    input_context = mirrored.InputContext(num_input_pipelines=1, input_pipeline_id=0)
    assert str(input_context) == "mirrored.InputContext(input pipeline id 0, total: 1)"
    input_context = mirrored.InputContext(num_input_pipelines=3, input_pipeline_id=1)
    assert str(input_context) == "mirrored.InputContext(input pipeline id 1, total: 3)"


# -- StrategyLocalResultTest ----------------------------------------------------------------------
# TF runs these on two CPUs (mirrored_strategy_with_cpu_1_and_2); here 1, 2 and 8 replicas.

LOCAL_RESULTS = ["mirrored1", "mirrored2", "mirrored8"]


@pytest.fixture(params=LOCAL_RESULTS)
def distribution(request, strategies):
    return strategies[request.param]


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForDictionary
def test_local_result_for_dictionary(distribution):
    def model_fn():
        return {"a": jnp.asarray(1.0), "b": jnp.asarray(2.0)}

    with distribution.scope():
        got = local(distribution, distribution.run(model_fn))
    assert isinstance(distribution.experimental_local_results({"a": 1.0}), tuple)
    assert got == [{"a": 1.0, "b": 2.0}] * distribution.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForList
def test_local_result_for_list(distribution):
    def model_fn():
        return [jnp.asarray(1.0), jnp.asarray(2.0)]

    with distribution.scope():
        got = local(distribution, distribution.run(model_fn))
    assert got == [[1.0, 2.0]] * distribution.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForTuple
def test_local_result_for_tuple(distribution):
    def model_fn():
        return (jnp.asarray(1.0), jnp.asarray(2.0), jnp.asarray(3.0))

    with distribution.scope():
        got = local(distribution, distribution.run(model_fn))
    assert got == [(1.0, 2.0, 3.0)] * distribution.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForNestedStruct
def test_local_result_for_nested_struct(distribution):
    def model_fn():
        return (
            {"a": jnp.asarray(1.0), "b": jnp.asarray(2.0)},
            {"a": jnp.asarray(4.0), "b": jnp.asarray(6.0)},
        )

    with distribution.scope():
        got = local(distribution, distribution.run(model_fn))
    expected = ({"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0})
    assert got == [expected] * distribution.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForNestedStructWithoutTensor
def test_local_result_for_nested_struct_without_tensor(distribution):
    def model_fn():
        return {"a": 1.0, "b": 2.0}

    with distribution.scope():
        v = distribution.experimental_local_results(distribution.run(model_fn))
    assert isinstance(v, tuple)
    got = [jax.tree.map(np.asarray, r) for r in v]
    assert got == [{"a": 1.0, "b": 2.0}] * distribution.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForScalarValue
def test_local_result_for_scalar_value(distribution):
    def model_fn():
        return mirrored.get_replica_context().replica_id_in_sync_group

    with distribution.scope():
        v = distribution.experimental_local_results(distribution.run(model_fn))
    assert isinstance(v, tuple)
    assert [int(x) for x in v] == list(range(distribution.num_replicas_in_sync))


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForDictionaryDifferentReplicas
def test_local_result_for_dictionary_different_replicas(distribution):
    def model_fn():
        replica_id = mirrored.get_replica_context().replica_id_in_sync_group
        return {
            "a": (replica_id + 1).astype(jnp.float32),
            "b": (replica_id + 2).astype(jnp.float32),
        }

    with distribution.scope():
        got = local(distribution, distribution.run(model_fn))
    n = distribution.num_replicas_in_sync
    assert got == [{"a": i + 1.0, "b": i + 2.0} for i in range(n)]


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyLocalResultTest.testLocalResultForTensor
def test_local_result_for_tensor(distribution):
    def model_fn():
        return jnp.array([2.0, 3.0])

    with distribution.scope():
        v = local(distribution, distribution.run(model_fn))
    np.testing.assert_array_equal(v, [[2.0, 3.0]] * distribution.num_replicas_in_sync)


# -- replica context: replica id, run, all_reduce -------------------------------------------------


# TF: tensorflow/python/distribute/one_device_strategy_test.py::OneDeviceStrategyTest.testReplicaId
def test_replica_id(strategy):
    # strategy_test_lib._test_replica_id: every replica sees a distinct id below the device count.
    with strategy.scope():
        ids = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
        found = sorted(int(i) for i in strategy.experimental_local_results(ids))
    assert found == list(range(len(strategy.extended.worker_devices)))


# TF: tensorflow/python/distribute/strategy_common_test.py::StrategyTest.testCaptureReplicaId
def test_capture_replica_id(strategy):
    def f():
        return mirrored.get_replica_context().replica_id_in_sync_group

    out = strategy.run(f)
    assert [int(i) for i in local(strategy, out)] == list(range(strategy.num_replicas_in_sync))


# TF: tensorflow/python/distribute/one_device_strategy_test.py::OneDeviceStrategyTest.testRun
def test_one_device_run(strategies):
    # strategy_test_lib.OneDeviceDistributionTestBase._test_run
    strategy = strategies["one_device"]
    out1 = strategy.run(lambda: jnp.asarray(4.0))
    np.testing.assert_array_equal(local(strategy, out1), [4.0])
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(local(strategy, out2["a"]), [8.0])
    np.testing.assert_array_equal(local(strategy, out2["b"]), [16.0])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(local(strategy, out3), [42.0])


# TF: tensorflow/python/distribute/strategy_test_lib.py::TwoDeviceDistributionTestBase._test_run
def test_two_device_run(two):
    strategy = two
    out1 = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group + 1)
    np.testing.assert_array_equal(local(strategy, out1), [1, 2])
    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(local(strategy, out2["a"]), [2, 4])
    np.testing.assert_array_equal(local(strategy, out2["b"]), [1, 4])
    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(local(strategy, out3), [6, 14])


def _all_sum(value):
    ctx = mirrored.get_replica_context()
    return ctx.all_reduce(mirrored.ReduceOp.SUM, value)


def _all_mean(value):
    ctx = mirrored.get_replica_context()
    return ctx.all_reduce(mirrored.ReduceOp.MEAN, value)


def _per_replica_inputs(strategy, inputs):
    """TF's make_input_fn_iterator over Dataset.from_tensor_slices(inputs): replica i, element i."""

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        if isinstance(inputs, tuple):
            return tuple(np.asarray(x, np.float32)[i] for x in inputs)
        return np.asarray(inputs, np.float32)[i]

    return strategy.experimental_distribute_values_from_function(value_fn)


COMMS = [
    # (strategy, comm_fn, inputs (slices: one per replica), expected on every replica)
    pytest.param(
        "one_device", _all_sum, ([4.0], [[42.0, 43.0]]), (4.0, [42.0, 43.0]), id="one-sum"
    ),
    pytest.param(
        "one_device", _all_mean, ([2.0], [[21.0, 22.0]]), (2.0, [21.0, 22.0]), id="one-mean"
    ),
    pytest.param(
        "mirrored2",
        _all_sum,
        ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]]),
        (4.0, [42.0, 43.0]),
        id="two-sum",
    ),
    pytest.param(
        "mirrored2",
        _all_mean,
        ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]]),
        (2.0, [21.0, 21.5]),
        id="two-mean",
    ),
]


# TF: tensorflow/python/distribute/strategy_test_lib.py::TwoDeviceDistributionTestBase._test_collective_comms
@pytest.mark.parametrize(("name", "comm_fn", "inputs", "expected"), COMMS)
def test_all_reduce_collective_comms(strategies, name, comm_fn, inputs, expected):
    # one_device_strategy_test.py::OneDeviceStrategyTest.testAllReduceSum / testAllReduceMean use
    # the one-device variant (Dataset.from_tensors, one element).
    strategy = strategies[name]
    values = _per_replica_inputs(strategy, inputs)
    outputs = strategy.run(comm_fn, args=(values,))
    n = strategy.num_replicas_in_sync
    np.testing.assert_array_equal(local(strategy, outputs[0]), [expected[0]] * n)
    np.testing.assert_array_equal(local(strategy, outputs[1]), [expected[1]] * n)


GRADS = [
    pytest.param("one_device", _all_sum, [4.0], [4.0], id="one-sum"),
    pytest.param("one_device", _all_mean, [5.0], [5.0], id="one-mean"),
    pytest.param("mirrored2", _all_sum, [1.0, 3.0], [4.0, 4.0], id="two-sum"),
    pytest.param("mirrored2", _all_mean, [1.0, 3.0], [2.0, 2.0], id="two-mean"),
]


# TF: tensorflow/python/distribute/strategy_test_lib.py::TwoDeviceDistributionTestBase._test_collective_comms_gradient_tape
@pytest.mark.parametrize(("name", "comm_fn", "inputs", "expected_grads"), GRADS)
def test_all_reduce_gradients(strategies, name, comm_fn, inputs, expected_grads):
    # Deliberate difference: TF's x = identity(42.) is a replica-local constant; in mirrored a
    # constant is identical on every replica and all_reduce refuses it, so x = 42 arrives as a
    # per-replica value (one 42 per replica) and jax.grad differentiates with respect to it.
    strategy = strategies[name]
    c = _per_replica_inputs(strategy, inputs)
    x = _per_replica_inputs(strategy, [42.0] * strategy.num_replicas_in_sync)

    def step(c, x):
        return jax.grad(lambda x: comm_fn(x) * c)(x)

    grads = strategy.run(step, args=(c, x))
    np.testing.assert_array_equal(local(strategy, grads), expected_grads)


# TF: tensorflow/python/distribute/strategy_common_test.py::AllReduceTest.testDense
def test_all_reduce_dense(strategy):
    # Deliberate difference: all_reduce of a replica-invariant value raises ValueError (TF's
    # value = identity(1.0) is a constant); a per-replica 1.0 gives TF's expected value.
    with pytest.raises(ValueError, match="identical on every replica"):
        strategy.run(lambda: _all_sum(jnp.asarray(1.0)))
    ones = strategy.experimental_distribute_values_from_function(lambda _: np.float32(1.0))
    got = local(strategy, strategy.run(_all_sum, args=(ones,)))[0]
    assert got == 1.0 * strategy.num_replicas_in_sync


# TF: tensorflow/python/distribute/strategy_common_test.py::ReplicaCtxAllReduceTest.testNestedInput
def test_all_reduce_nested_input(strategy):
    # TF's tuple also holds IndexedSlices (no JAX equivalent); its dense members are kept.
    # Deliberate difference: the constants 1.0 and 2.0 arrive as per-replica values.
    value = strategy.experimental_distribute_values_from_function(
        lambda _: (np.float32(1.0), np.float32(2.0))
    )
    got = local(strategy, strategy.run(_all_sum, args=(value,)))[0]
    n = strategy.num_replicas_in_sync
    assert tuple(float(g) for g in got) == (1.0 * n, 2.0 * n)


# TF: tensorflow/python/distribute/strategy_common_test.py::AllReduceTest.testNestedInput
def test_all_reduce_nested_list_mean(strategy):
    # The dense part of AllReduceTest.testNestedInput ((1.0, 2.0) summed), plus a MEAN over a
    # list, which AllReduceTest.testSparse checks for one value: mean of equal values = value.
    value = strategy.experimental_distribute_values_from_function(
        lambda _: [np.float32(1.0), np.float32(2.0)]
    )
    n = strategy.num_replicas_in_sync
    summed = local(strategy, strategy.run(_all_sum, args=(value,)))
    assert [[float(v) for v in r] for r in summed] == [[1.0 * n, 2.0 * n]] * n
    averaged = local(strategy, strategy.run(_all_mean, args=(value,)))
    assert [[float(v) for v in r] for r in averaged] == [[1.0, 2.0]] * n


# -- GatherTest: gather -------------------------------------------------------------------------

SAME_SHAPE = [
    pytest.param([1, 2, 3], 0, id="Dense1D0Axis"),
    pytest.param([[1, 2, 3]], 0, id="Dense2D0Axis"),
    pytest.param([[1, 2, 3]], 1, id="Dense2D1Axis"),
    pytest.param([[[1, 2], [1, 2]]], 0, id="Dense3D0Axis"),
    pytest.param([[[1, 2], [1, 2]]], 1, id="Dense3D1Axis"),
    pytest.param([[[1, 2], [1, 2]]], 2, id="Dense3D2Axis"),
]


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testGatherPerReplicaDense1D0Axis
# (and testGatherPerReplicaDense2D0Axis, 2D1Axis, 3D0Axis, 3D1Axis, 3D2Axis: the ids)
@pytest.mark.parametrize(("value_on_replica", "axis"), SAME_SHAPE)
def test_gather_same_shape(strategy, value_on_replica, axis):
    value_on_replica = np.asarray(value_on_replica, np.int32)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: value_on_replica
    )
    got = strategy.gather(distributed_values, axis=axis)
    all_results = [value_on_replica for _ in range(strategy.num_replicas_in_sync)]
    np.testing.assert_array_equal(np.asarray(got), np.concatenate(all_results, axis=axis))


def _diff_shape_at_non_axis(ctx):
    return np.ones((1, ctx.replica_id_in_sync_group + 1), np.int32)


def _diff_rank(ctx):
    return np.ones(tuple(range(1, ctx.replica_id_in_sync_group + 2)), np.float32)


def _assert_refused_where_built(strategy, value_fn, shapes):
    """Deliberate difference: TF builds per-replica values of different shapes and its gather
    or all_gather fails on them; mirrored's replicas hold one shape (one SPMD program), so
    such a value is refused where it is built and no gather ever sees one."""
    with pytest.raises(ValueError, match="one shape on every replica") as info:
        strategy.experimental_distribute_values_from_function(value_fn)
    assert f"found shapes {shapes}" in str(info.value)
    assert "Fix: pad the values to a common shape" in str(info.value)


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testGatherRaiseDiffShapeAtNonAxis
def test_gather_raise_diff_shape_at_non_axis(multi):
    n = multi.num_replicas_in_sync
    _assert_refused_where_built(multi, _diff_shape_at_non_axis, [(1, i + 1) for i in range(n)])
    # What mirrored can hold: n + 1 rows split over n replicas, 2 rows on replica 0 and 1 on
    # the others (TF: shapes (2, 2) and (1, 2)), padded here to 2 rows each. Along axis 1 the
    # replicas' shapes differ at axis 0 (TF: "Dimension 0 in both shapes must be equal"):
    # gather must refuse, not return the padding.
    rows = np.arange(2 * (n + 1), dtype=np.int32).reshape(n + 1, 2)
    (batch,) = multi.experimental_distribute_dataset([rows])
    with pytest.raises(
        ValueError, match=r"strategy\.gather\(\.\.\., axis=1\) expected a value"
    ) as info:
        multi.gather(batch, axis=1)
    message = str(info.value)
    assert f"found a padded batch ({n + 1} real examples in {2 * n} rows" in message
    assert "Fix: gather along the batch axis, axis=0" in message
    np.testing.assert_array_equal(multi.gather(batch, axis=0), rows)  # TF's DiffShapeAtAxis0


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testGatherRaiseDifferentRank
def test_gather_raise_different_rank(multi):
    n = multi.num_replicas_in_sync
    _assert_refused_where_built(multi, _diff_rank, [tuple(range(1, i + 2)) for i in range(n)])


# -- GatherTest: all_gather ---------------------------------------------------------------------


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherPerReplicaDense1D0Axis
# (and testAllGatherPerReplicaDense2D0Axis, 2D1Axis, 3D0Axis, 3D1Axis, 3D2Axis: the ids)
@pytest.mark.parametrize(("value_on_replica", "axis"), SAME_SHAPE)
def test_all_gather_same_shape(strategy, value_on_replica, axis):
    # TF's 1D0Axis case is float32, the others int32.
    dtype = np.float32 if np.ndim(value_on_replica) == 1 else np.int32
    value_on_replica = np.asarray(value_on_replica, dtype)
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: value_on_replica
    )

    def replica_fn(per_replica_value):
        ctx = mirrored.get_replica_context()
        return ctx.all_gather(per_replica_value, axis=axis)

    result = local(strategy, strategy.run(replica_fn, args=(per_replica_value,)))
    n = strategy.num_replicas_in_sync
    expect = np.concatenate([value_on_replica] * n, axis=axis)
    np.testing.assert_array_equal(result, [expect] * n)


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherNest1D0Axis
def test_all_gather_nest_1d_0_axis(strategy):
    single_value = np.array([1, 2, 3])  # a constant: NumPy (a captured jax.Array is state)

    def run():
        ctx = mirrored.get_replica_context()
        return ctx.all_gather([single_value, single_value], axis=0)

    n = strategy.num_replicas_in_sync
    expect = np.concatenate([np.array([1, 2, 3])] * n, axis=0)
    result = strategy.run(run)
    assert isinstance(result, list) and len(result) == 2
    for gathered_result in result:
        np.testing.assert_array_equal(local(strategy, gathered_result), [expect] * n)


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherDiffValueTPU
def test_all_gather_diff_value(strategy):
    # TF runs this one on TPUs only ("other strategies' case already covered"); the same data
    # split over 1, 2 or 8 replicas gathers back to the whole batch on every replica.
    data = [[1], [2], [3], [4], [5], [6], [7], [8]]
    dataset = [np.asarray(data, np.int32)]  # from_tensor_slices(data).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica_fn(per_replica_value):
        ctx = mirrored.get_replica_context()
        return ctx.all_gather(per_replica_value, axis=0)

    result = local(strategy, strategy.run(replica_fn, args=(batch,)))
    np.testing.assert_array_equal(result, [data] * strategy.num_replicas_in_sync)


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherRaiseDiffShapeAtNonAxis
def test_all_gather_raise_diff_shape_at_non_axis(multi):
    n = multi.num_replicas_in_sync
    _assert_refused_where_built(multi, _diff_shape_at_non_axis, [(1, i + 1) for i in range(n)])


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherRaiseDifferentRank
def test_all_gather_raise_different_rank(multi):
    n = multi.num_replicas_in_sync
    _assert_refused_where_built(multi, _diff_rank, [tuple(range(1, i + 2)) for i in range(n)])


def _replica_c(strategy):
    def value_fn(ctx):
        x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
        return np.array([x[ctx.replica_id_in_sync_group]], np.float32)

    return strategy.experimental_distribute_values_from_function(value_fn)


def _replica_local(strategy, value):
    value = np.asarray(value, np.float32)
    return strategy.experimental_distribute_values_from_function(lambda _: value)


GRADIENT_STRATEGIES = ["one_device", "mirrored1", "mirrored2", "mirrored8"]


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherGradient
@pytest.mark.parametrize("name", GRADIENT_STRATEGIES)
def test_all_gather_gradient(strategies, name):
    # Deliberate difference: TF's x = constant([[3.], [5.]]) is replica-local. A constant in
    # mirrored is identical on every replica, and jax.grad with respect to such a value is
    # already summed over replicas; x therefore arrives as a per-replica value.
    strategy = strategies[name]
    n = strategy.num_replicas_in_sync

    def all_gather_fn(value):
        axis = 1
        ctx = mirrored.get_replica_context()
        return ctx.all_gather(value, axis)

    def step(c, x):
        return jax.grad(lambda x: jnp.sum(all_gather_fn(x) * c))(x)

    gradient_comp = sum(range(1, n + 1))
    gradient = [[gradient_comp], [gradient_comp]]
    x = _replica_local(strategy, [[3.0], [5.0]])
    result = local(strategy, strategy.run(step, args=(_replica_c(strategy), x)))
    np.testing.assert_array_equal(result, [gradient] * n)


# TF: tensorflow/python/distribute/strategy_gather_test.py::GatherTest.testAllGatherGradientNest
@pytest.mark.parametrize("name", GRADIENT_STRATEGIES)
def test_all_gather_gradient_nest(strategies, name):
    # Deliberate difference: x and y arrive as per-replica values (see test_all_gather_gradient).
    strategy = strategies[name]
    n = strategy.num_replicas_in_sync

    def all_gather_fn(value):
        axis = 1
        ctx = mirrored.get_replica_context()
        return ctx.all_gather(value, axis)

    def step(c, x, y):
        def loss(x):
            mid = all_gather_fn([x, y])
            return jnp.sum(jnp.stack(mid) * c)

        return jax.grad(loss)(x)

    gradient_comp = sum(range(1, n + 1))
    gradient = [[gradient_comp], [gradient_comp]]
    x = _replica_local(strategy, [[3.0], [5.0]])
    y = _replica_local(strategy, [[2.0], [4.0]])
    result = local(strategy, strategy.run(step, args=(_replica_c(strategy), x, y)))
    np.testing.assert_array_equal(result, [gradient] * n)


# -- input on 2 replicas, partial last batches (TF: 2 workers x 1 device) -------------------------


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testDatasetFromFunction
def test_dataset_from_function(two):
    def dataset_fn(input_context):
        global_batch_size = 10
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        # range(100).repeat().batch(5), one epoch of it
        return [np.arange(i, i + batch_size) for i in range(0, 100, batch_size)]

    expected_sum_on_replicas = [10, 35]  # TF: {'chief': 10, 'worker': 35}
    first = next(iter(two.distribute_datasets_from_function(dataset_fn)))
    sums = [int(np.sum(r)) for r in local(two, first)]
    assert sums == expected_sum_on_replicas


def _range_14_batch_8():
    return [np.arange(0, 8), np.arange(8, 14)]  # Dataset.range(14).batch(8)


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromDatasetLastPartialBatch
def test_simple_input_from_dataset_last_partial_batch(two):
    input_iterator = iter(two.experimental_distribute_dataset(_range_14_batch_8()))

    def run(input_iterator):
        return two.run(lambda x: x, args=(next(input_iterator),))

    # Let the complete batch go.
    np.testing.assert_array_equal(two.gather(run(input_iterator), axis=0), np.arange(8))
    # `result` is an incomplete batch: TF gives [8, 9, 10] and [11, 12, 13].
    # Deliberate difference: padding is visible inside fn (each replica holds 4 rows, masked);
    # the gathered real examples are TF's, in order.
    result = run(input_iterator)
    np.testing.assert_array_equal(two.gather(result, axis=0), [8, 9, 10, 11, 12, 13])


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromFnLastPartialBatch
def test_simple_input_from_fn_last_partial_batch(two):
    def dataset_fn(input_context):
        global_batch_size = 8
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        return [np.arange(i, min(i + batch_size, 14)) for i in range(0, 14, batch_size)]

    input_iterator = iter(two.distribute_datasets_from_function(dataset_fn))

    def run(input_iterator):
        return two.run(lambda x: x, args=(next(input_iterator),))

    run(input_iterator)  # Let the complete batch go.
    result = run(input_iterator)  # an incomplete batch
    # TF: {'chief': [8, 9, 10, 11], 'worker': [12, 13]}
    replicas = local(two, result)
    np.testing.assert_array_equal(replicas[0], [8, 9, 10, 11])
    # Deliberate difference: replica 1's 2 examples are padded to 4 rows (masked).
    np.testing.assert_array_equal(replicas[1][:2], [12, 13])
    np.testing.assert_array_equal(two.gather(result, axis=0), [8, 9, 10, 11, 12, 13])


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromDatasetLastPartialBatch
@pytest.mark.parametrize(("op", "expected"), [("SUM", 63.0), ("MEAN", 10.5)], ids=["sum", "mean"])
@pytest.mark.parametrize("through_run", [False, True], ids=["batch", "run-output"])
def test_reduce_last_partial_batch(two, op, expected, through_run):
    # The same partial batch, [8, ..., 13] over 2 replicas (TF: [8, 9, 10] and [11, 12, 13]),
    # reduced over the batch axis: TF's Strategy.reduce docstring promises that MEAN with
    # axis=0 uses the real example count (6) as denominator. Reduced directly, and as the
    # per-example outputs of run.
    batches = list(two.experimental_distribute_dataset(_range_14_batch_8()))
    last = batches[1]
    if through_run:
        last = two.run(lambda x: x.astype(jnp.float32), args=(last,))
    assert float(two.reduce(op, last, axis=0)) == expected


# TF: tensorflow/python/distribute/strategy_common_test.py::DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromDatasetLastPartialBatch
@pytest.mark.parametrize("name", ["mirrored2", "mirrored8"])
def test_reduce_and_gather_rank_2_partial_batch(strategies, name):
    # The partial batch [8, ..., 13] as rank-2 rows [[k, 10 k]]: reduce over axis 0 and gather
    # along axis 0 see the 6 real rows only, on 2 or 8 replicas (8: two replicas hold no row).
    strategy = strategies[name]
    x = np.arange(14, dtype=np.float32)
    rows = np.stack([x, 10 * x], axis=1)
    batches = list(strategy.experimental_distribute_dataset([rows[:8], rows[8:]]))
    last = batches[1]
    np.testing.assert_array_equal(strategy.gather(last, axis=0), rows[8:])
    np.testing.assert_array_equal(strategy.reduce("SUM", last, axis=0), [63.0, 630.0])
    np.testing.assert_array_equal(strategy.reduce("MEAN", last, axis=0), [10.5, 105.0])
    out = strategy.run(lambda r: r * 1.0, args=(last,))
    np.testing.assert_array_equal(strategy.gather(out, axis=0), rows[8:])
    np.testing.assert_array_equal(strategy.reduce("MEAN", out, axis=0), [10.5, 105.0])
