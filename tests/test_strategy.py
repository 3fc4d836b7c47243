"""Devices, scopes and the default strategy."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP


def test_default_uses_every_local_device(devices):
    strategy = mirrored.MirroredStrategy()
    assert strategy.num_replicas_in_sync == 8
    assert strategy.extended.worker_devices == tuple(devices)


@pytest.mark.parametrize("spec", ["/cpu:3", "cpu:3", "/device:CPU:3", 3])
def test_device_names(devices, spec):
    strategy = mirrored.MirroredStrategy([spec, devices[5]])
    assert strategy.extended.worker_devices == (devices[3], devices[5])


def test_missing_cpu_device_lists_the_ones_that_exist(devices):
    with pytest.raises(ValueError, match="'/cpu:99', which does not exist") as info:
        mirrored.MirroredStrategy(["/cpu:0", "/cpu:99"])
    assert "/cpu:0, /cpu:1" in str(info.value) and "/cpu:7" in str(info.value)


def test_missing_gpu_mentions_cuda_visible_devices(devices):
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES") as info:
        mirrored.MirroredStrategy(["/gpu:0"])
    assert "Devices that do exist: /cpu:0" in str(info.value)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (["/cpu:1", "/cpu:1"], ValueError, "duplicates"),
        ([], ValueError, "at least one device"),
        (["tpu-zero"], ValueError, "Expected a device name like"),
        ([1.5], TypeError, "found 1.5"),
    ],
)
def test_bad_device_lists(devices, spec, error, match):
    with pytest.raises(error, match=match):
        mirrored.MirroredStrategy(spec)


def test_one_device_strategy(devices):
    strategy = mirrored.OneDeviceStrategy("/cpu:2")
    assert strategy.num_replicas_in_sync == 1
    with strategy.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert model.kernel.get_value().sharding.device_set == {devices[2]}


def test_scope_mirrors_modules_optimizers_and_arrays(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        table = {"w": jnp.zeros((3, 3)), "b": jnp.ones(3)}
    for leaf in jax.tree.leaves((nnx.state(model), nnx.state(optimizer), table)):
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(devices)


def test_contexts_follow_tensorflow(devices):
    strategy = mirrored.MirroredStrategy(devices)
    assert not mirrored.has_strategy()
    assert not mirrored.in_cross_replica_context()
    default = mirrored.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert mirrored.get_replica_context().num_replicas_in_sync == 1
    with strategy.scope():
        assert mirrored.get_strategy() is strategy
        assert mirrored.has_strategy()
        assert mirrored.in_cross_replica_context()
        assert mirrored.get_replica_context() is None

        def fn(x):
            ctx = mirrored.get_replica_context()
            assert ctx is not None and ctx.num_replicas_in_sync == 8
            assert not mirrored.in_cross_replica_context()
            return x

        strategy.run(fn, args=(1.0,))
    assert mirrored.get_strategy() is default


def test_nested_scopes(devices):
    first = mirrored.MirroredStrategy(devices[:2])
    second = mirrored.MirroredStrategy(devices[2:4])
    with first.scope(), first.scope():  # re-entering the same strategy is fine
        assert mirrored.get_strategy() is first
    with (
        first.scope(),
        pytest.raises(ValueError, match="inside the scope of") as info,
        second.scope(),
    ):
        pass
    assert "leave the first" in str(info.value)
    assert not mirrored.has_strategy()


def test_scope_restores_on_error(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with pytest.raises(KeyError), strategy.scope():
        raise KeyError("x")
    assert not mirrored.has_strategy()


def test_default_strategy_runs_state_created_outside_any_scope():
    model = SmallMLP(rngs=nnx.Rngs(0))
    strategy = mirrored.get_strategy()
    out = strategy.run(lambda m, x: m(x), args=(model, jnp.ones((3, 12))))
    assert strategy.experimental_local_results(out)[0].shape == (3, 5)


def test_run_inside_run_is_refused(devices):
    strategy = mirrored.MirroredStrategy(devices)

    def outer(x):
        return strategy.run(lambda y: y, args=(x,))

    with pytest.raises(RuntimeError, match="inside another strategy.run"):
        strategy.run(outer, args=(1.0,))


def test_max_in_flight_is_validated(devices):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_in_flight"):
            mirrored.MirroredStrategy(devices, max_in_flight=bad)


@pytest.mark.parametrize(
    ("n", "max_in_flight", "queued"), [(8, None, 2), (1, None, 0), (1, 3, 3), (8, 1, 1)]
)
def test_dispatch_is_bounded_with_several_replicas_and_free_with_one(
    devices, n, max_in_flight, queued
):
    """Several replicas: a deeper queue of collectives deadlocks simulated CPU devices. One:
    nothing to deadlock, and each wait costs the devices CPU time, so the host runs ahead."""
    strategy = mirrored.MirroredStrategy(devices[:n], max_in_flight=max_in_flight)
    for _ in range(5):
        strategy.run(lambda: jnp.ones(()))
    assert len(strategy._runner.bound_dispatch._in_flight) == queued
