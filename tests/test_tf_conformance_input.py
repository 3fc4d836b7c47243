# ruff: noqa: E501  (the "# TF: <path>::<Class>.<test>" source lines are longer than 100)
"""Conformance: TensorFlow's distributed-input, run and PerReplica tests, ported to mirrored.

Sources (tensorflow/tensorflow): tensorflow/python/distribute/custom_training_loop_input_test.py,
input_lib_test.py, mirrored_strategy_test.py (with strategy_test_lib.py's shared bodies) and
values_test.py. Same inputs, same expected values; `tf.data.Dataset.from_tensor_slices(d).batch(b)`
becomes a list of NumPy batches (`batches(d, b)`) or arrays with `batch_size=b`.

TF's strategy combinations map to: default strategy -> `mirrored.get_strategy()` outside any
scope; one_device_strategy -> `OneDeviceStrategy("/cpu:0")`; mirrored_strategy_with_one_cpu ->
1 device; mirrored_strategy_with_gpu_and_cpu / multidevice_strategies -> 2 devices; and 8 devices
where TF's test does not depend on the replica count.
"""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mirrored

# -- strategies and helpers ---------------------------------------------------------------------


@functools.cache
def strategy_named(name):
    """One shared strategy per name (programs compile once per strategy)."""
    if name == "default":
        return mirrored.get_strategy()
    if name == "one_device":
        return mirrored.OneDeviceStrategy("/cpu:0")
    n = int(name.rsplit("_", 1)[1])
    return mirrored.MirroredStrategy(jax.devices()[:n])


ALL = ["default", "one_device", "mirrored_1", "mirrored_2", "mirrored_8"]
UP_TO_TWO = ["default", "one_device", "mirrored_1", "mirrored_2"]
ALL_MINUS_DEFAULT = ["one_device", "mirrored_1", "mirrored_2", "mirrored_8"]


def batches(data, size, drop_remainder=False):
    """`tf.data.Dataset.from_tensor_slices(data).batch(size, drop_remainder)` as a list."""
    data = jax.tree.map(np.asarray, data)
    rows = len(jax.tree.leaves(data)[0])
    out = []
    for start in range(0, rows, size):
        if drop_remainder and start + size > rows:
            break
        out.append(jax.tree.map(lambda x, s=start: x[s : s + size], data))
    return out


def masked_sum(values):
    """The sum of a replica's real rows: padded rows (copies of real ones) are masked out."""
    mask = mirrored.get_replica_context().example_mask
    if mask is None:
        return jnp.sum(values)
    return jnp.sum(values * mask.reshape(mask.shape + (1,) * (values.ndim - 1)))


def local(strategy, value):
    """`experimental_local_results` as NumPy arrays."""
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def flattened(strategy, value):
    """custom_training_loop_input_test's assert_equal_flattened: local results, concatenated."""
    final_result = []
    for val in strategy.experimental_local_results(value):
        final_result.extend(np.atleast_1d(np.asarray(val)).tolist())
    return final_result


def square(x):
    return jnp.square(x)


# -- mirrored_strategy_test.py ------------------------------------------------------------------


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.testNumReplicasInSync
@pytest.mark.parametrize("n", [1, 2, 8, None])
def test_num_replicas_in_sync(n):
    devices = jax.devices() if n is None else jax.devices()[:n]
    strategy = mirrored.MirroredStrategy(None if n is None else devices)
    assert strategy.num_replicas_in_sync == len(devices)
    assert tuple(strategy.extended.worker_devices) == tuple(devices)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.testReduceToCpu
@pytest.mark.parametrize("name", ["mirrored_1", "mirrored_2", "mirrored_8"])
def test_reduce_to_cpu(name):
    distribution = strategy_named(name)
    with distribution.scope():
        result = distribution.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
        reduced = distribution.reduce(mirrored.ReduceOp.SUM, result, axis=None)
        expected = sum(range(distribution.num_replicas_in_sync))
        assert int(reduced) == expected


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredStrategyCallForEachReplicaTest.testFunctionInCallForEachReplica
def test_function_in_call_for_each_replica():
    distribution = strategy_named("mirrored_2")
    with distribution.scope():
        result = distribution.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
        assert tuple(int(v) for v in local(distribution, result)) == (0, 1)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.testRun
def test_run_two_devices():
    # strategy_test_lib.TwoDeviceDistributionTestBase._test_run
    strategy = strategy_named("mirrored_2")
    out1 = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group + 1)
    np.testing.assert_array_equal(local(strategy, out1), [1, 2])

    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(local(strategy, out2["a"]), [2, 4])
    np.testing.assert_array_equal(local(strategy, out2["b"]), [1, 4])

    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(local(strategy, out3), [6, 14])


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredOneDeviceDistributionTest.testRun
def test_run_one_device():
    # strategy_test_lib.OneDeviceDistributionTestBase._test_run
    strategy = strategy_named("mirrored_1")
    out1 = strategy.run(lambda: jnp.asarray(4.0))
    np.testing.assert_array_equal(local(strategy, out1), [4.0])

    out2 = strategy.run(lambda x: {"a": x * 2, "b": x * x}, args=(out1,))
    np.testing.assert_array_equal(local(strategy, out2["a"]), [8.0])
    np.testing.assert_array_equal(local(strategy, out2["b"]), [16.0])

    out3 = strategy.run(lambda b, a: a + 2 * b + 2, kwargs=out2)
    np.testing.assert_array_equal(local(strategy, out3), [42.0])


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.testReplicateDataset
def test_replicate_dataset_input_context():
    # Deliberate difference: unbatched datasets raise, so each of TF's range(10) elements is a
    # per-replica batch of one example; distribute_datasets_from_function hands one per replica.
    distribution = strategy_named("mirrored_2")
    contexts = []

    def input_fn(input_context):
        # strategy_test_lib._input_fn_to_test_input_context
        assert input_context is not None
        contexts.append(input_context)
        assert input_context.num_replicas_in_sync == 2
        assert input_context.num_input_pipelines == 1
        assert input_context.input_pipeline_id == 0
        return batches(np.arange(10), 1)

    expected_values = [[i, i + 1] for i in range(0, 10, 2)]
    # strategy_test_lib._test_input_fn_iterable
    iterable = distribution.distribute_datasets_from_function(input_fn)
    assert len(contexts) == 1
    for _ in range(2):  # after re-initializing the iterator, should be able to iterate again
        iterator = iter(iterable)
        for expected_value in expected_values:
            computed_value = [int(v[0]) for v in local(distribution, next(iterator))]
            assert computed_value == expected_value
        with pytest.raises(StopIteration):
            next(iterator)


class _PulledOn:
    """Batches of `batches(np.arange(100), 2)`, recording on which thread each one is pulled."""

    def __init__(self):
        self.threads = []

    def __iter__(self):
        for batch in batches(np.arange(100), 2):
            self.threads.append(threading.current_thread())
            yield batch


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.test_prefetch_to_device_dataset
def test_prefetch_to_device_dataset():
    distribution = strategy_named("mirrored_2")
    input_options = mirrored.InputOptions(experimental_fetch_to_device=True)
    source = _PulledOn()
    dataset = distribution.experimental_distribute_dataset(source, options=input_options)
    item = next(iter(dataset))
    values = distribution.experimental_local_results(item)
    device_types = [next(iter(t.devices())).platform for t in values]
    expected_device_types = [d.platform for d in distribution.extended.worker_devices]
    assert device_types == expected_device_types
    assert [t.devices() for t in values] == [{d} for d in distribution.extended.worker_devices]
    np.testing.assert_array_equal(np.concatenate(local(distribution, item)), [0, 1])
    # Fetched ahead: the batches are pulled and placed on a background thread.
    assert source.threads and threading.main_thread() not in source.threads


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.test_prefetch_to_host_dataset
def test_prefetch_to_host_dataset():
    # Deliberate difference: TF leaves the elements on the host; mirrored places each batch on
    # the replicas' devices when it is asked for, on the caller's thread, with nothing
    # fetched ahead. (On CPU "the host" and "the devices" are the same platform: the thread
    # and the count of pulled batches are what tell the two options apart.)
    distribution = strategy_named("mirrored_2")
    input_options = mirrored.InputOptions(experimental_fetch_to_device=False)
    source = _PulledOn()
    dataset = distribution.experimental_distribute_dataset(source, options=input_options)
    iterator = iter(dataset)
    item = next(iterator)
    assert source.threads == [threading.main_thread()]  # this one batch, pulled by the caller
    values = distribution.experimental_local_results(item)
    assert [t.devices() for t in values] == [{d} for d in distribution.extended.worker_devices]
    np.testing.assert_array_equal(np.concatenate(local(distribution, item)), [0, 1])
    np.testing.assert_array_equal(np.concatenate(local(distribution, next(iterator))), [2, 3])
    assert source.threads == [threading.main_thread()] * 2


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredTwoDeviceDistributionTest.testNumpyDataset
def test_numpy_dataset_two_epochs():
    # strategy_test_lib._test_numpy_dataset: numpy arrays, global batch 6, repeat(2) -> 2 epochs.
    strategy = strategy_named("mirrored_2")
    x = np.asarray([[1, 2], [6, 12], [2, 4], [5, 10], [3, 6], [4, 8]])
    y = np.asarray([5, 4, 3, 2, 1, 0])
    ds = strategy.experimental_distribute_dataset((x, y), batch_size=6)

    def run_and_concatenate(strategy, batch):
        x, y = strategy.run(lambda z: z, args=(batch,))
        return np.concatenate(local(strategy, x)), np.concatenate(local(strategy, y))

    for _ in range(2):  # 2 epochs
        i = iter(ds)
        x_1, y_1 = run_and_concatenate(strategy, next(i))
        np.testing.assert_array_equal(x, x_1)
        np.testing.assert_array_equal(y, y_1)
        with pytest.raises(StopIteration):
            next(i)


class MockModel(nnx.Module):
    """mirrored_strategy_test.MockModel: variables 1.25 (and 2.0)."""

    def __init__(self, two_variables=False):
        self.v1 = nnx.Param(jnp.asarray(1.25))
        self.v2 = nnx.Param(jnp.asarray(2.0)) if two_variables else None

    def __call__(self, factor=2):
        x = factor * self.v1[...]
        if self.v2 is not None:
            x += self.v2[...]
        return x


def _call_and_check(distribution, model_fn, inputs, expected_result, two_variables=False):
    # Deliberate difference: state is passed to run as an argument, never captured.
    with distribution.scope():
        mock_model = MockModel(two_variables)
    result = distribution.run(model_fn, args=[mock_model, *inputs])
    for r in range(distribution.num_replicas_in_sync):
        device_result = jax.tree.map(lambda v, r=r: local(distribution, v)[r], result)
        device_expected_result = (
            expected_result[r] if isinstance(expected_result, tuple) else expected_result
        )
        np.testing.assert_allclose(device_result, device_expected_result)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredStrategyDefunTest.testVariableInDefun
def test_variable_in_defun():
    @jax.jit
    def times_two(mock_model):
        return mock_model()

    _call_and_check(strategy_named("mirrored_2"), lambda m: times_two(m), [], 2.5)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredStrategyDefunTest.testTwoVariablesInNestedDefun
def test_two_variables_in_nested_defun():
    def fn1(mock_model):
        return mock_model()

    def fn2(mock_model):
        return fn1(mock_model) + 1

    _call_and_check(strategy_named("mirrored_2"), fn2, [], 5.5, two_variables=True)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredStrategyDefunTest.testGradientTapeOverNestedDefuns
def test_gradient_over_nested_functions():
    def fn1(mock_model):
        return mock_model()

    def fn2(mock_model):
        return fn1(mock_model) + 1

    def model_fn(mock_model):
        grads = nnx.grad(fn2)(mock_model)
        return [grads["v1"][...], grads["v2"][...]]

    _call_and_check(strategy_named("mirrored_2"), model_fn, [], [2.0, 1.0], two_variables=True)


# TF: tensorflow/python/distribute/mirrored_strategy_test.py::MirroredStrategyDefunTest.testPassPerReplica
def test_pass_per_replica():
    distribution = strategy_named("mirrored_2")
    factors = distribution.experimental_distribute_values_from_function(
        lambda ctx: np.float32((5.0, 3.0)[ctx.replica_id_in_sync_group])
    )
    expected_result = (5.0 * 1.25, 3.0 * 1.25)
    _call_and_check(distribution, lambda m, factor: m(factor), [factors], expected_result)


# -- values_test.py -----------------------------------------------------------------------------


def gather_stacked(distribution, value):
    """values_test's ds_test_util.gather: each replica's value, stacked along a new axis 0."""
    return jax.tree.map(
        lambda *vs: np.stack([np.asarray(v) for v in vs]),
        *distribution.experimental_local_results(value),
    )


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueFromTensor
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_from_tensor(name):
    distribution = strategy_named(name)
    single_value = np.int32(1)
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: single_value
    )
    np.testing.assert_array_equal(
        gather_stacked(distribution, distributed_values),
        np.full((distribution.num_replicas_in_sync,), 1.0),
    )


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueSingleNumpyArrayConstant
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_single_numpy_array_constant(name):
    distribution = strategy_named(name)
    array_value = np.array([1.0, 2.0, 3.0])
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: array_value
    )
    np.testing.assert_array_equal(
        gather_stacked(distribution, distributed_values),
        [[1.0, 2.0, 3.0]] * distribution.num_replicas_in_sync,
    )


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueTupleConstant
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_tuple_constant(name):
    distribution = strategy_named(name)
    tuple_value = (1.0, 2.0, 3.0)
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: tuple_value
    )
    distributed_values = gather_stacked(distribution, distributed_values)
    # Expected output for 2 replicas: ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0])
    expected = tuple([v for i in range(distribution.num_replicas_in_sync)] for v in tuple_value)
    assert isinstance(distributed_values, tuple)
    for got, want in zip(distributed_values, expected, strict=True):
        np.testing.assert_array_equal(got, want)


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueNestedStructurePerReplica
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_nested_structure_per_replica(name):
    distribution = strategy_named(name)
    tuple_value = (1.0, 2.0, 3.0)

    def value_fn(ctx):
        per_replica = []
        for val in tuple_value:
            per_replica.append(val * ctx.replica_id_in_sync_group)
        return tuple(per_replica)

    distributed_values = distribution.experimental_distribute_values_from_function(value_fn)
    distributed_values = gather_stacked(distribution, distributed_values)
    # Expected output for 2 replicas: ([0.0, 1.0], [0.0, 2.0], [0.0, 3.0])
    expected = tuple([v * i for i in range(distribution.num_replicas_in_sync)] for v in tuple_value)
    for got, want in zip(distributed_values, expected, strict=True):
        np.testing.assert_array_equal(got, want)


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueExtractFromArray
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_extract_from_array(name):
    distribution = strategy_named(name)
    multiple_values = range(distribution.num_replicas_in_sync)

    def value_fn(ctx):
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = distribution.experimental_distribute_values_from_function(value_fn)
    distributed_values = gather_stacked(distribution, distributed_values)
    expected = range(distribution.num_replicas_in_sync)
    np.testing.assert_array_equal(distributed_values, list(expected))


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueAndRun
@pytest.mark.parametrize("name", ALL_MINUS_DEFAULT)
def test_make_distributed_value_and_run(name):
    distribution = strategy_named(name)
    multiple_values = range(distribution.num_replicas_in_sync)

    def value_fn(ctx):
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = distribution.experimental_distribute_values_from_function(value_fn)

    def computation(x):
        return jnp.square(x)

    results = gather_stacked(
        distribution, distribution.run(computation, args=(distributed_values,))
    )
    expected = [i**2 for i in range(distribution.num_replicas_in_sync)]
    np.testing.assert_array_equal(results, expected)


# TF: tensorflow/python/distribute/values_test.py::DistributedValuesTest.testMakeDistributedValueExplicitDevicePlacement
@pytest.mark.parametrize("name", ["mirrored_2", "mirrored_8"])
def test_make_distributed_value_explicit_device_placement(name):
    distribution = strategy_named(name)
    worker_devices = distribution.extended.worker_devices
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: np.float32(1.0)
    )
    values = distribution.experimental_local_results(distributed_values)
    for i in range(len(worker_devices)):
        assert values[i].devices() == {worker_devices[i]}


# -- custom_training_loop_input_test.py -------------------------------------------------------


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testConstantNumpyInput
@pytest.mark.parametrize("name", ALL)
def test_constant_numpy_input(name):
    # Semantics 7: a Python float passed to run becomes a traced scalar, the same on every replica.
    distribution = strategy_named(name)

    def run(x):
        def computation(x):
            return jnp.square(x)

        return distribution.experimental_local_results(distribution.run(computation, args=(x,)))

    np.testing.assert_array_equal(
        np.full((distribution.num_replicas_in_sync,), 4.0), [np.asarray(v) for v in run(2.0)]
    )


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testFullEager
@pytest.mark.parametrize("name", UP_TO_TWO)
def test_full_eager(name):
    distribution = strategy_named(name)
    dataset = batches(np.array([5.0, 6.0, 7.0, 8.0], np.float32), 2)

    def train_step(data):
        return jnp.square(data)

    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    results = []
    for x in dist_dataset:
        results.append(flattened(distribution, distribution.run(train_step, args=(x,))))
    assert results == [[25.0, 36.0], [49.0, 64.0]]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testGetNextAsOptional
@pytest.mark.parametrize("name", UP_TO_TWO)
def test_get_next_as_optional(name):
    distribution = strategy_named(name)
    dataset = batches(np.array([5.0, 6.0, 7.0, 8.0], np.float32), 2)
    iterator = iter(distribution.experimental_distribute_dataset(dataset))

    def train_step(data):
        return jnp.square(data)

    value = iterator.get_next_as_optional().get_value()
    assert flattened(distribution, distribution.run(train_step, args=(value,))) == [25.0, 36.0]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testGetNextAsOptionalExampleUsage
@pytest.mark.parametrize("name", ["mirrored_1", "mirrored_2"])  # TF: a batch of 2
def test_get_next_as_optional_example_usage(name):
    """TF's loop: at most steps_per_loop steps, stopping when the optional is empty (8
    examples at global batch 2: 4 steps of 6); then an empty optional's get_value is an error
    naming the fix (TF: InvalidArgumentError). The ragged last batch included (7 examples)."""
    distribution = strategy_named(name)
    for examples, expected in (
        (8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (7, [[0, 1], [2, 3], [4, 5], [6]]),
    ):
        distributed_iterator = iter(
            distribution.experimental_distribute_dataset(
                batches(np.arange(examples, dtype=np.int32), 2)
            )
        )
        seen = []
        for _ in range(6):
            optional_data = distributed_iterator.get_next_as_optional()
            if not optional_data.has_value():
                break
            out = distribution.run(lambda x: x, args=(optional_data.get_value(),))
            seen.append(distribution.gather(out, axis=0).tolist())
        assert seen == expected
        empty = distributed_iterator.get_next_as_optional()
        assert not empty.has_value()
        with pytest.raises(ValueError, match="epoch has ended.*Fix: check optional.has_value"):
            empty.get_value()


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testIterationOutsideFunction
@pytest.mark.parametrize("name", ["one_device", "mirrored_2"])
def test_iteration_outside_function_generator(name):
    # The dataset is a Python generator of global batches.
    distribution = strategy_named(name)

    def f_train_step(input_data):
        return flattened(distribution, distribution.run(square, args=(input_data,)))

    def generator():
        yield from batches(np.array([5.0, 6.0, 7.0, 8.0], np.float32), 2)

    dist_dataset = distribution.experimental_distribute_dataset(generator())
    iterator = iter(dist_dataset)
    results = []
    # we iterate through the loop 2 times since we have 4 elements and a global batch of 2.
    for _ in range(2):
        results.append(f_train_step(next(iterator)))
    assert results == [[25.0, 36.0], [49.0, 64.0]]
    with pytest.raises(StopIteration):
        next(iterator)


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testNestedOutput
def test_nested_output():
    distribution = strategy_named("mirrored_2")
    dataset = batches(np.array([0, 1, 2, 3], np.int32), 2)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    def computation(x):
        return [{"a": x - 1, "b": x + 1}]

    inputs = next(input_iterator)
    outputs = distribution.run(computation, args=(inputs,))
    results = jax.tree.map(
        lambda v: local(distribution, v),
        outputs,
        is_leaf=lambda v: isinstance(v, mirrored.PerReplica),
    )
    for replica in range(distribution.num_replicas_in_sync):
        # The input dataset is range(4), so the replica id is same as input.
        np.testing.assert_array_equal(results[0]["a"][replica], [replica - 1])
        np.testing.assert_array_equal(results[0]["b"][replica], [replica + 1])


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetIterationInFunction
@pytest.mark.parametrize("name", ["one_device", "mirrored_2"])
def test_dataset_iteration_twice(name):
    # Deliberate difference: state is passed to run as an argument, never captured. TF's
    # ONLY_FIRST_REPLICA variable: every replica adds the same 1.0 to a mirrored variable.
    distribution = strategy_named(name)
    with distribution.scope():
        a = nnx.Variable(jnp.asarray(1.0))

    def train_step(a, _):
        a[...] = a[...] + 1.0

    dataset = batches(np.array([5.0, 6.0, 7.0, 8.0], np.float32), 2)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)

    number_of_steps = 0.0
    product_of_means = 2.0
    for x in dist_dataset:  # loop with values modified each iteration
        number_of_steps += 1
        product_of_means *= float(distribution.reduce("MEAN", x, axis=0))
    for y in dist_dataset:  # loop with no intermediate state
        distribution.run(train_step, args=(a, y))

    assert number_of_steps == 2
    assert product_of_means == pytest.approx(2 * (5 + 6) / 2 * (7 + 8) / 2, abs=1e-3)
    # We set the initial value of `a` to 1 and iterate through the dataset 2 times (4/2 where 4
    # is the number of dataset elements and 2 is the batch size). Hence the final result is 3.
    assert float(a[...]) == 3.0


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetAssertWithDynamicBatch
@pytest.mark.parametrize("name", ["one_device", "mirrored_2"])
def test_dataset_with_dynamic_batch(name):
    distribution = strategy_named(name)

    def step_fn(data):
        return jnp.square(data)

    dataset = batches(np.array([5.0, 6.0, 7.0], np.float32), 2)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    results = []
    iterator = iter(dist_dataset)
    for _ in range(2):
        elem = next(iterator)
        results.append(distribution.run(step_fn, args=(elem,)))

    expected_results = [[25.0, 36.0], [49.0]]
    assert len(results) == len(expected_results)
    # TF concatenates the replicas' local results; the per-example outputs of the ragged last
    # batch count their real examples only (semantics 1), in gather's replica order.
    for expected_result, result in zip(expected_results, results, strict=True):
        np.testing.assert_array_equal(
            np.asarray(distribution.gather(result, axis=0)), expected_result
        )


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetAssertWithDynamicBatch
def test_dataset_with_dynamic_batch_local_results():
    # The same, read as TF does: each replica's local results, concatenated.
    distribution = strategy_named("mirrored_2")
    dataset = batches(np.array([5.0, 6.0, 7.0], np.float32), 2)
    results = [
        flattened(distribution, distribution.run(square, args=(elem,)))
        for elem in distribution.experimental_distribute_dataset(dataset)
    ]
    assert results == [[25.0, 36.0], [49.0]]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDistributeDatasetIteratorWithoutFunction
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_distribute_dataset_iterator_without_function(name):
    # Deliberate difference: unbatched datasets raise; dataset_fn yields per-replica batches of
    # one element, so each replica takes one of TF's elements.
    distribution = strategy_named(name)
    data = [5.0, 6.0, 7.0, 8.0]
    input_iterator = iter(
        distribution.distribute_datasets_from_function(
            lambda _: batches(np.array(data, np.float32), 1)
        )
    )
    assert (
        flattened(distribution, next(input_iterator)) == data[0 : distribution.num_replicas_in_sync]
    )


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDistributeDatasetPrefetch
def test_distribute_dataset_prefetch():
    distribution = strategy_named("mirrored_2")
    data = [5.0, 6.0, 7.0, 8.0]
    input_iterator = iter(
        distribution.experimental_distribute_dataset(batches(np.array(data, np.float32), 2))
    )
    local_results = distribution.experimental_local_results(next(input_iterator))
    backing_devices = [next(iter(result.devices())) for result in local_results]
    assert backing_devices == list(distribution.extended.worker_devices)


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDistributeDatasetFunctionPrefetch
def test_distribute_dataset_function_prefetch():
    # Deliberate difference: unbatched datasets raise (per-replica batches of one element).
    distribution = strategy_named("mirrored_2")
    data = [5.0, 6.0, 7.0, 8.0]
    input_iterator = iter(
        distribution.distribute_datasets_from_function(
            lambda _: batches(np.array(data, np.float32), 1)
        )
    )
    local_results = distribution.experimental_local_results(next(input_iterator))
    backing_devices = [next(iter(result.devices())) for result in local_results]
    assert backing_devices == list(distribution.extended.worker_devices)


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDynamicShapes
def test_dynamic_shapes():
    # Deliberate difference: inside fn the ragged batch is padded to a static shape; the
    # replica context's example_mask marks the real rows, so the mean over them is TF's.
    distribution = strategy_named("mirrored_2")
    dataset = batches(np.array([5.0, 6.0, 7.0], np.float32), 4)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))

    def computation(x):
        mask = mirrored.get_replica_context().example_mask
        return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.sum(mask)

    outputs = local(distribution, distribution.run(computation, args=(next(input_iterator),)))
    # This assumes that there are exactly 2 replicas
    np.testing.assert_array_equal([5.5, 7.0], outputs)


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testStrategyReduceWithDynamicShapes
@pytest.mark.parametrize("source", ["batches", "arrays"])
def test_strategy_reduce_with_dynamic_shapes(source):
    distribution = strategy_named("mirrored_2")
    data = np.array([5.0, 6.0, 7.0], np.float32)
    if source == "batches":
        dist = distribution.experimental_distribute_dataset(batches(data, 4))
    else:
        dist = distribution.experimental_distribute_dataset(data, batch_size=4)
    inputs = next(iter(dist))
    assert float(distribution.reduce(mirrored.ReduceOp.MEAN, inputs, axis=0)) == 6.0


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testStrategyReduceWithDynamicShapesRank2
def test_strategy_reduce_with_dynamic_shapes_rank2():
    distribution = strategy_named("mirrored_2")
    dataset = batches(np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], np.float32), 4)
    inputs = next(iter(distribution.experimental_distribute_dataset(dataset)))
    np.testing.assert_array_equal(
        distribution.reduce(mirrored.ReduceOp.MEAN, inputs, axis=0), [1.0, 1.0]
    )


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDynamicShapesWithSizeOp
def test_dynamic_shapes_with_size_op():
    # Deliberate difference: static shapes inside fn; the size of the real part is the mask's sum.
    distribution = strategy_named("mirrored_2")
    dataset = batches(np.array([5.0, 6.0, 7.0], np.float32), 4)
    inputs = next(iter(distribution.experimental_distribute_dataset(dataset)))

    def computation(x):
        return jnp.sum(mirrored.get_replica_context().example_mask.astype(jnp.int32))

    # This assumes that there are exactly 2 replicas
    np.testing.assert_array_equal(
        [2, 1], local(distribution, distribution.run(computation, (inputs,)))
    )
    # What each replica holds, read from the host: its real rows only.
    assert [v.shape for v in local(distribution, inputs)] == [(2,), (1,)]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testSegmentSumWithDynamicNumberOfSegments
def test_dynamic_number_of_rows_from_function():
    # Deliberate difference: static shapes inside fn (per-replica batches padded to 3 rows);
    # TF's dynamic output shapes (3,) and (2,) are the replicas' real-row counts.
    distribution = strategy_named("mirrored_2")

    def dataset_fn(_):
        data = np.arange(5, dtype=np.int32)  # TF's zeros: distinct here, so rows can be told apart
        return batches(data, 3)

    example = next(iter(distribution.distribute_datasets_from_function(dataset_fn)))

    def step_fn(example):
        return jnp.sum(mirrored.get_replica_context().example_mask.astype(jnp.int32))

    outputs = local(distribution, distribution.run(step_fn, args=(example,)))
    assert [int(v) for v in outputs] == [3, 2]
    assert [v.tolist() for v in local(distribution, example)] == [[0, 1, 2], [3, 4]]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetDistributeEvenlyDivisibleDrop
# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetDistributeEvenlyDivisibleNoDrop
@pytest.mark.parametrize("drop_remainder", [True, False])
@pytest.mark.parametrize("name", UP_TO_TWO)
def test_dataset_distribute_evenly_divisible(name, drop_remainder):
    distribution = strategy_named(name)
    dataset = batches(np.array([5.0, 6.0], np.float32), 2, drop_remainder=drop_remainder)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset))
    data = next(input_iterator)
    assert flattened(distribution, data) == [5.0, 6.0]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetDistributeNotDivisibleDrop
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_dataset_distribute_not_divisible_drop(name):
    distribution = strategy_named(name)
    data = np.array([5.0, 6.0], np.float32)
    if distribution.num_replicas_in_sync > 1:
        # Deliberate difference: a global batch (1) smaller than the replica count (2) raises;
        # TF hands replica 0 the example and replica 1 nothing.
        with pytest.raises(ValueError, match="at least 2"):
            next(iter(distribution.experimental_distribute_dataset(batches(data, 1, True))))
        with pytest.raises(ValueError, match="at least 2"):
            distribution.experimental_distribute_dataset(data, batch_size=1, drop_remainder=True)
        return
    input_iterator = iter(distribution.experimental_distribute_dataset(batches(data, 1, True)))
    assert flattened(distribution, next(input_iterator)) == [5.0]


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetPartialBatchWithMixedOutputs
@pytest.mark.parametrize("name", ["one_device", "mirrored_2"])
def test_dataset_partial_batch_with_mixed_outputs(name):
    distribution = strategy_named(name)
    # Dataset.from_tensor_slices([5.]).batch(2): one partial batch of the static size 2.
    dataset = (np.array([5.0], np.float32),)
    input_iterator = iter(distribution.experimental_distribute_dataset(dataset, batch_size=2))

    def computation(x):
        # Fixed size output with a dynamic sized output.
        return jnp.zeros([3]), jnp.square(x)

    (x,) = next(input_iterator)
    results = distribution.run(computation, args=(x,))

    # First result is fixed for all replicas.
    for replica_id in range(distribution.num_replicas_in_sync):
        np.testing.assert_array_equal([0.0, 0.0, 0.0], local(distribution, results[0])[replica_id])
    # Only first replica has distributed dataset computation.
    np.testing.assert_array_equal([25.0], local(distribution, results[1])[0])
    # Other replicas have no distributed dataset computation.
    for replica_id in range(1, distribution.num_replicas_in_sync):
        assert local(distribution, results[1])[replica_id].tolist() == []
    np.testing.assert_array_equal(distribution.gather(results[1], axis=0), [25.0])


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testMultiDeviceDataCapturedFunction
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_multi_device_data_captured_function(name):
    # Deliberate differences: unbatched datasets raise (per-replica batches of one element);
    # the variable is passed to run as an argument.
    distribution = strategy_named(name)
    inputs = np.array([2.0, 3.0], np.float32)
    input_iterator = iter(
        distribution.distribute_datasets_from_function(lambda _: batches(inputs, 1) * 5)
    )
    with distribution.scope():
        var = nnx.Variable(jnp.asarray(1.0))

    def func(var, inputs):
        return jnp.square(inputs) + var[...]

    def train_step(input_iterator):
        per_replica_outputs = distribution.run(func, (var, next(input_iterator)))
        mean = distribution.reduce(mirrored.ReduceOp.MEAN, per_replica_outputs, axis=None)
        for _ in range(1):
            per_replica_outputs = distribution.run(func, (var, next(input_iterator)))
            mean = distribution.reduce(mirrored.ReduceOp.MEAN, per_replica_outputs, axis=None)
        return mean

    with distribution.scope():
        expected = 10.0 if distribution.num_replicas_in_sync == 1 else 7.5
        np.testing.assert_allclose(np.asarray(train_step(input_iterator)), expected)


# TF: tensorflow/python/distribute/custom_training_loop_input_test.py::InputIterationTest.testDatasetOutOfRange
@pytest.mark.parametrize("name", ["one_device", "mirrored_2"])
def test_dataset_out_of_range(name):
    # Deliberate difference: state is passed to run as an argument. TF's SUM-aggregated variable
    # adds every replica's value: an all_reduce("SUM") of the per-replica sums.
    distribution = strategy_named(name)
    with distribution.scope():
        a = nnx.Variable(jnp.asarray(0.0))

    def train_step(a, val):
        ctx = mirrored.get_replica_context()
        a[...] = a[...] + ctx.all_reduce("SUM", jnp.sum(val))

    def f_train_step(iterator):
        distribution.run(train_step, args=(a, next(iterator)))
        return a

    dataset = batches(np.array([5.0, 6.0, 7.0, 8.0], np.float32), 2)
    iterator = iter(distribution.experimental_distribute_dataset(dataset))
    with pytest.raises(StopIteration):
        for _ in range(100):
            f_train_step(iterator)
    assert float(a[...]) == pytest.approx(26.0)


# -- input_lib_test.py --------------------------------------------------------------------------


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorSingleWorkerTest.testOneDeviceCPU
@pytest.mark.parametrize("name", ["one_device", "mirrored_1"])
def test_one_device_cpu_unbatched_raises(name):
    # Deliberate difference: unbatched datasets raise (TF yields range(10)'s elements one by one).
    distribution = strategy_named(name)
    with pytest.raises(ValueError, match="leading batch axis"):
        next(iter(distribution.experimental_distribute_dataset(list(range(10)))))
    with pytest.raises(TypeError, match="batch_size"):
        distribution.experimental_distribute_dataset(np.arange(10))


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorSingleWorkerTest.testTupleDataset
def test_tuple_dataset():
    # Deliberate difference: unbatched datasets raise; TF's one element per replica per step is a
    # global batch of 2 split over the 2 replicas.
    distribution = strategy_named("mirrored_2")
    dataset1 = np.arange(10)
    dataset2 = np.arange(10) ** 2
    dist = distribution.experimental_distribute_dataset((dataset1, dataset2), batch_size=2)
    expected_values = [[(i, i**2), (i + 1, (i + 1) ** 2)] for i in range(0, 10, 2)]
    for _ in range(2):  # after re-initializing the iterator, should be able to iterate again
        actual_values = []
        for x in dist:
            first, second = (local(distribution, v) for v in x)
            actual_values.append(
                [(int(a[0]), int(b[0])) for a, b in zip(first, second, strict=True)]
            )
        assert actual_values == expected_values


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorSingleWorkerTest.testUnevenDatasetBatches
@pytest.mark.parametrize("drop_remainder", [True, False])
def test_uneven_dataset_batches(drop_remainder):
    # TF's input_fn (and its unsplit dataset): every replica takes a whole batch of
    # range(9).batch(2).
    distribution = strategy_named("mirrored_2")
    dist = distribution.distribute_datasets_from_function(
        lambda _: batches(np.arange(9), 2, drop_remainder=drop_remainder)
    )
    # The last global batch only contains data for one replica.
    if drop_remainder:
        expected_values = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    else:
        expected_values = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    for _ in range(2):  # after re-initializing the iterator, should be able to iterate again
        iterator = iter(dist)
        for expected_value in expected_values:
            computed_value = [v.tolist() for v in local(distribution, next(iterator))]
            assert computed_value == expected_value
        with pytest.raises(StopIteration):
            next(iterator)


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorSingleWorkerTest.testBatchSplitting
@pytest.mark.parametrize("split_batch_by", [None, 2])
def test_batch_splitting(split_batch_by):
    distribution = strategy_named("mirrored_2")
    batch_size = 10
    dataset = batches(np.arange(100), batch_size)
    if split_batch_by:  # the global batch is split over the replicas
        dist = distribution.experimental_distribute_dataset(dataset)
    else:  # every replica takes a whole batch
        dist = distribution.distribute_datasets_from_function(lambda _: dataset)
    updated_batch_size = batch_size // split_batch_by if split_batch_by else batch_size
    expected_values = [
        [
            list(range(i, i + updated_batch_size)),
            list(range(i + updated_batch_size, i + 2 * updated_batch_size)),
        ]
        for i in range(0, 100, updated_batch_size * 2)
    ]
    for _ in range(2):
        actual_values = [[v.tolist() for v in local(distribution, x)] for x in dist]
        assert actual_values == expected_values


def _ragged_dense():
    # row_lengths = mod(arange(20), 4); RaggedTensor.from_row_lengths(...).to_tensor()
    row_lengths = np.mod(np.arange(20), 4).astype(np.int64)
    dense = np.zeros((20, 3), np.float32)
    for i, length in enumerate(row_lengths):
        dense[i, :length] = i
    return dense


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTensorTypeTest.testRaggedSparse
@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("input_type", ["dataset", "input_fn"])
def test_ragged_sparse_dense_part(input_type, drop_remainder):
    # The dense member of TF's {"dense", "ragged", "sparse"} dict (ragged and sparse tensors
    # have no mirrored equivalent). Source: commit 0004ac98864da68d6a90d96385bd55c86e04a8c1.
    distribution = strategy_named("mirrored_2")
    global_batch_size = 8
    seen = []

    def dataset_fn(ctx=None):
        ctx = ctx or mirrored.InputContext()
        batch_size = ctx.get_per_replica_batch_size(global_batch_size)
        seen.append((ctx.num_replicas_in_sync, batch_size))
        # Use 20 which isn't divisible by 8 to test partial batch behavior.
        data = {"dense": _ragged_dense()}
        # dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id): one pipeline here.
        assert (ctx.num_input_pipelines, ctx.input_pipeline_id) == (1, 0)
        return batches(data, batch_size, drop_remainder=drop_remainder)

    if input_type == "dataset":
        dataset = distribution.experimental_distribute_dataset(dataset_fn(mirrored.InputContext()))
        assert seen == [(1, 8)]
    else:
        dataset = distribution.distribute_datasets_from_function(dataset_fn)
        assert seen == [(2, 4)]

    per_replica_batch = next(iter(dataset))
    np.testing.assert_array_equal(
        local(distribution, per_replica_batch["dense"])[0],
        [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [2.0, 2.0, 0.0], [3.0, 3.0, 3.0]],
    )
    np.testing.assert_array_equal(
        local(distribution, per_replica_batch["dense"])[1],
        [[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [6.0, 6.0, 0.0], [7.0, 7.0, 7.0]],
    )

    # Iterate through all the batches and sum them up.
    def sum_batch(per_replica_features):
        def map_fn(per_replica_values):
            # Deliberate difference: padded rows are visible inside fn; the sum masks them.
            per_replica_sums = distribution.run(masked_sum, (per_replica_values,))
            return distribution.reduce(mirrored.ReduceOp.SUM, per_replica_sums, axis=None)

        return {k: map_fn(v) for k, v in per_replica_features.items()}

    sums = {"dense": 0.0}
    for batch in dataset:
        sums = {name: value + float(sum_batch(batch)[name]) for name, value in sums.items()}
    # When there's no partial batch, the sum is smaller.
    assert sums["dense"] == (200.0 if input_type == "dataset" and drop_remainder else 310.0)


# TF: tensorflow/python/distribute/input_lib_test.py::InputTypeSpecTest.testInputSignatureForPerReplicaValues
@pytest.mark.parametrize("input_type", ["dataset", "dataset_fn"])
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_input_signature_for_per_replica_values(name, input_type):
    distribution = strategy_named(name)

    # TF's ones: distinct values here, so a dropped or reordered row shows.
    data = np.arange(120, dtype=np.float32).reshape(10, 12)

    def dataset_fn(ctx):
        del ctx  # unused
        return batches(data, 4)

    if input_type == "dataset":
        ds = distribution.experimental_distribute_dataset(dataset_fn(mirrored.InputContext()))
    else:
        ds = distribution.distribute_datasets_from_function(dataset_fn)

    def process_inputs(inputs):
        return distribution.run(lambda inputs: inputs, args=(inputs,))

    got = [np.concatenate(local(distribution, process_inputs(x))) for x in ds]
    np.testing.assert_array_equal(np.concatenate(got), data)


# TF: tensorflow/python/distribute/input_lib_test.py::InputTypeSpecTest.testInputSignatureForNestedPerReplicaValues
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_input_signature_for_nested_per_replica_values(name):
    distribution = strategy_named(name)
    a = np.arange(20).reshape(10, 2) * 5  # TF's ones * 5 and * 6: distinct rows here
    b = np.arange(30).reshape(10, 3) * 6
    dist_dataset = distribution.experimental_distribute_dataset(batches((a, b), 2))

    def process_inputs(inputs):
        return distribution.run(lambda inputs: inputs, args=(inputs,))

    steps = 0
    for x in dist_dataset:
        out_a, out_b = process_inputs(x)
        rows = slice(2 * steps, 2 * steps + 2)
        np.testing.assert_array_equal(distribution.gather(out_a, axis=0), a[rows])
        np.testing.assert_array_equal(distribution.gather(out_b, axis=0), b[rows])
        steps += 1
    assert steps == 5


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTest.testIterableIteratorError
@pytest.mark.parametrize("name", ["mirrored_1", "mirrored_2"])
def test_iterable_iterator_error(name):
    distribution = strategy_named(name)
    dataset = batches(np.arange(10), 2)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)

    iterator = iter(dist_dataset)
    # Raises error when next(iterator) is called without strategy scope
    with pytest.raises(ValueError):

        def replica_fn1(iterator):
            return next(iterator)

        distribution.run(replica_fn1, args=(iterator,))

    if distribution.num_replicas_in_sync == 1:
        expected_result = [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]]]
    elif distribution.num_replicas_in_sync == 2:
        expected_result = [[[0], [1]], [[2], [3]], [[4], [5]], [[6], [7]], [[8], [9]]]

    with distribution.scope():

        def replica_fn2(iterator):
            return iterator

        result = distribution.run(replica_fn2, args=(next(iterator),))
        assert [v.tolist() for v in local(distribution, result)] == expected_result[0]

    # Confirm default ReplicaContext also works
    iterator = iter(dist_dataset)
    for i, element in enumerate(iterator):
        assert [v.tolist() for v in local(distribution, element)] == expected_result[i]


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTest.testCacheAcrossIteration
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_cache_across_iteration(name):
    # range(16).shuffle(16).cache(): one fixed shuffled order, batched by 4.
    distribution = strategy_named(name)
    order = np.random.default_rng(0).permutation(16)
    dist_dataset = distribution.experimental_distribute_dataset(batches(order, 4))

    first_epoch = [local(distribution, x) for x in dist_dataset]
    second_epoch = [local(distribution, x) for x in dist_dataset]
    np.testing.assert_array_equal(first_epoch, second_epoch)


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTest.testShuffleAcrossIterations
@pytest.mark.parametrize("reshuffle", [True, False])
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2"])
def test_shuffle_across_iterations(name, reshuffle):
    # range(12).shuffle(12, reshuffle_each_iteration=reshuffle).batch(4): the arrays fast path
    # reshuffles every epoch; without reshuffling, one fixed shuffled order.
    distribution = strategy_named(name)
    if reshuffle:
        dist_dataset = distribution.experimental_distribute_dataset(
            np.arange(12), batch_size=4, shuffle=True, seed=0
        )
    else:
        order = np.random.default_rng(0).permutation(12)
        dist_dataset = distribution.experimental_distribute_dataset(order, batch_size=4)

    first_epoch = [local(distribution, x) for x in dist_dataset]
    second_epoch = [local(distribution, x) for x in dist_dataset]
    if reshuffle:
        assert not np.array_equal(first_epoch, second_epoch)
    else:
        np.testing.assert_array_equal(first_epoch, second_epoch)
    assert sorted(np.concatenate([np.concatenate(e) for e in first_epoch]).tolist()) == list(
        range(12)
    )


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTest.testGetNextOptionalShape
@pytest.mark.parametrize("name", ["one_device", "mirrored_1", "mirrored_2", "mirrored_8"])
def test_get_next_optional_shape(name):
    distribution = strategy_named(name)
    batch_size = 8
    dataset = {"feature": np.ones([batch_size, 10]), "label": np.ones([batch_size])}
    dataset = batches(dataset, batch_size, drop_remainder=True)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    per_replica_batch_size = batch_size // distribution.num_replicas_in_sync

    for data in dist_dataset:
        feature = local(distribution, data["feature"])
        label = local(distribution, data["label"])
        # Assert the shapes are still static from all replicas.
        for replica_id in range(len(distribution.extended.worker_devices)):
            assert [per_replica_batch_size, 10] == list(feature[replica_id].shape)
            assert [per_replica_batch_size] == list(label[replica_id].shape)


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorTest.testLoopOverDatasetInTFFunction
def test_loop_over_dict_dataset_with_partial_batch():
    # TF runs this on 2 replicas (multi_worker_mirrored_2x1). Deliberate difference: the
    # variable is passed to run; TF's SUM aggregation is an all_reduce("SUM").
    strategy = strategy_named("mirrored_2")
    x = np.arange(10)
    dataset = batches({"y": x.astype(np.float32) ** 2}, 4)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    with strategy.scope():
        v = nnx.Variable(jnp.asarray(0.0))

    def assign_add_fn(v, data):
        ctx = mirrored.get_replica_context()
        # Deliberate difference: the last batch's padded rows are visible; the sum masks them.
        v[...] = v[...] + ctx.all_reduce("SUM", masked_sum(data["y"]))

    for data in dist_dataset:
        strategy.run(assign_add_fn, args=(v, data))
    assert float(v[...]) == 285.0


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorPerDeviceTest.testPrefetchBufferSizeInputOptions
@pytest.mark.parametrize("fetch_to_device", [False, True])
def test_prefetch_buffer_size_input_options(fetch_to_device):
    distribution = strategy_named("mirrored_2")
    input_options = mirrored.InputOptions(
        experimental_fetch_to_device=fetch_to_device, experimental_per_replica_buffer_size=2
    )

    def dataset_fn(input_context):
        # Each element (a row of 5 values) is one replica's batch.
        return list(np.arange(1, 11).reshape((2, 5)) * (input_context.input_pipeline_id + 1))

    ds = distribution.distribute_datasets_from_function(dataset_fn, input_options)

    # validating the values
    x = next(iter(ds))
    values = local(distribution, x)
    assert np.array_equal(values[0], np.array([1, 2, 3, 4, 5]))
    assert np.array_equal(values[1], np.array([6, 7, 8, 9, 10]))


# TF: tensorflow/python/distribute/input_lib_test.py::DistributedIteratorPerDeviceTest.testDevicePlacementForPerWorkerValuesWithPrefetch
def test_device_placement_for_per_worker_values_with_prefetch():
    # Deliberate difference: unbatched datasets raise (per-replica batches of one element).
    distribution = strategy_named("mirrored_2")
    input_options = mirrored.InputOptions(experimental_fetch_to_device=True)

    def dataset_fn(input_context):
        return batches(np.array([1, 2, 3, 4]), 1)

    ds = distribution.distribute_datasets_from_function(dataset_fn, input_options)
    steps = 0
    for x in ds:
        values = distribution.experimental_local_results(x)
        assert values[0].devices() == {distribution.extended.worker_devices[0]}
        assert values[1].devices() == {distribution.extended.worker_devices[1]}
        steps += 1
    assert steps == 2
