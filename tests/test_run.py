"""strategy.run: N-replica training equals single-device training, replicas never diverge."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import mirrored
from _helpers import (
    SmallMLP,
    assert_bit_identical_on_devices,
    global_batches,
    max_relative_difference,
    params_of,
    train_mirrored,
    train_single_device,
    train_step,
)
from mirrored._core.mesh import REPLICA_AXIS as AXIS


@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize(
    "make_tx", [lambda: optax.sgd(0.5), lambda: optax.adam(1e-2)], ids=["sgd", "adam"]
)
def test_n_replicas_equal_single_device(devices, n, make_tx):
    batches = global_batches(count=6, batch=64)
    expected = train_single_device(batches, make_tx)
    strategy = mirrored.MirroredStrategy(devices[:n])
    model, optimizer = train_mirrored(strategy, batches, make_tx)
    got = params_of(model)
    initial = params_of(SmallMLP(rngs=nnx.Rngs(0)))
    for name, value in expected.items():
        assert not np.allclose(value, initial[name]), f"{name} did not train"
        assert max_relative_difference(got[name], value) <= 1e-5, name
    assert_bit_identical_on_devices(model)
    assert_bit_identical_on_devices(nnx.state(optimizer))


def test_mean_per_replica_loss_gives_n_times_gradients(devices):
    """The trap the loss convention avoids: averaging per replica makes SGD steps 8x larger."""
    batches = global_batches(count=1, batch=64)
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    before = params_of(model)

    def wrong_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    ((x, y),) = strategy.experimental_distribute_dataset(batches)
    strategy.run(wrong_step, args=(model, optimizer, x, y))
    reference = train_single_device(batches, lambda: optax.sgd(1e-3))
    ratio = (params_of(model)["out/bias"] - before["out/bias"]) / (
        reference["out/bias"] - before["out/bias"]
    )
    np.testing.assert_allclose(ratio, 8.0, rtol=1e-3)


def test_outputs_per_replica_unless_identical(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
    ((x, _),) = strategy.experimental_distribute_dataset(global_batches(1, 16))

    def fn(model, x):
        return {"logits": model(x), "bias_norm": jnp.sum(model.out.bias[...] ** 2), "k": 3}

    out = strategy.run(fn, args=(model, x))
    assert isinstance(out["logits"], mirrored.PerReplica)
    assert out["logits"].shape == (2, 5)
    assert isinstance(out["bias_norm"], jax.Array)  # identical on every replica: mirrored
    assert out["bias_norm"].sharding.is_fully_replicated
    assert int(out["k"]) == 3


def test_calling_a_module_directly(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
    ((x, _),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    logits = strategy.gather(strategy.run(model, args=(x,)), axis=0)
    np.testing.assert_allclose(logits, model(x.global_value), rtol=1e-6, atol=1e-6)


def test_state_created_outside_scope_is_refused(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model = SmallMLP(rngs=nnx.Rngs(0))  # not in strategy.scope()
    with strategy.scope():
        optimizer = nnx.Optimizer(SmallMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    with pytest.raises(ValueError, match=r"created outside strategy.scope\(\)") as info:
        strategy.run(train_step, args=(model, optimizer, x, y))
    message = str(info.value)
    assert "args[0]" in message and "with strategy.scope():" in message
    assert "1 device" not in message and "8 device(s)" in message


def test_captured_state_is_refused_with_the_fix(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
    ((x, _),) = strategy.experimental_distribute_dataset(global_batches(1, 16))

    def step(x):
        return model(x)

    with pytest.raises(ValueError, match="captures 'model'") as info:
        strategy.run(step, args=(x,))
    assert "strategy.run(step, args=(model, x))" in str(info.value)


def test_state_captured_by_a_same_module_helper_is_refused(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        optimizer = nnx.Optimizer(SmallMLP(rngs=nnx.Rngs(0)), optax.sgd(0.1), wrt=nnx.Param)
    globals()["_GLOBAL_OPTIMIZER"] = optimizer
    try:
        with pytest.raises(ValueError, match="_GLOBAL_OPTIMIZER"):
            strategy.run(_uses_global_optimizer, args=(1.0,))
    finally:
        del globals()["_GLOBAL_OPTIMIZER"]


def _helper_reading_global():
    return _GLOBAL_OPTIMIZER.step[...]  # noqa: F821 - set by the test above


def _uses_global_optimizer(scale):
    return scale * _helper_reading_global()


def test_writing_a_replica_local_value_into_state_is_refused(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
    before = params_of(model)
    ((x, _),) = strategy.experimental_distribute_dataset(global_batches(1, 16))

    def step(model, x):
        model.out.bias[...] = x.mean(axis=0)[:5]  # differs per replica

    with pytest.raises(ValueError, match=r"(?s)mirrored variable args\[0\].out.bias.*all_reduce"):
        strategy.run(step, args=(model, x))
    after = params_of(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_a_failing_step_leaves_state_untouched(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = params_of(model)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))

    def broken(model, optimizer, x, y):
        train_step(model, optimizer, x, y)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        strategy.run(broken, args=(model, optimizer, x, y))
    after = params_of(model)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert int(optimizer.step[...]) == 0
    strategy.run(train_step, args=(model, optimizer, x, y))  # still usable
    assert int(optimizer.step[...]) == 1


def test_tied_weights_stay_tied(devices):
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(4, 4, rngs=rngs)
            self.second = self.first  # one set of weights, reached twice

        def __call__(self, x):
            return self.second(jax.nn.tanh(self.first(x)))

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = Tied(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, optimizer, x):
        def loss_fn(model):
            return mirrored.compute_average_loss(jnp.sum(model(x) ** 2, axis=-1))

        optimizer.update(model, nnx.grad(loss_fn)(model))

    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 4)))
    strategy.run(step, args=(model, optimizer, x))
    assert model.first is model.second
    assert_bit_identical_on_devices(model)


def test_two_thousand_steps_do_not_hang(devices):
    """Bounded dispatch: simulated devices deadlock with an unbounded queue of collectives."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    def step(model, optimizer, x):
        def loss_fn(model):
            return mirrored.compute_average_loss(jnp.sum(model(x) ** 2, axis=-1))

        optimizer.update(model, nnx.grad(loss_fn)(model))

    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((4, 4)))
    for _ in range(2000):
        strategy.run(step, args=(model, optimizer, x))
    assert int(optimizer.step[...]) == 2000


def test_logs_devices_and_collectives(devices, caplog):
    caplog.set_level(logging.INFO, logger="mirrored")
    strategy = mirrored.MirroredStrategy(devices)
    assert "8 replica(s) on /cpu:0, /cpu:1" in caplog.text
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    strategy.run(train_step, args=(model, optimizer, x, y))
    compiled = [r.message for r in caplog.records if "all-reduce" in r.message]
    assert len(compiled) == 1
    assert "over 8 replicas" in compiled[0] and "'train_step'" in compiled[0]
    strategy.run(train_step, args=(model, optimizer, x, y))
    assert len([r for r in caplog.records if "all-reduce" in r.message]) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_one_replica_steps_compile_without_an_all_reduce(devices, n):
    """JAX lowers a psum over a one-device axis to an all-reduce XLA keeps: pure cost."""
    strategy = mirrored.MirroredStrategy(devices[:n])
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    text = strategy._compiled_text(train_step, (model, optimizer, x, y), {})
    assert (text.count("all-reduce(") == 0) == (n == 1)

    def totals(v):
        return lax.psum(v, AXIS), lax.pmax(v, AXIS), lax.pmin(v, AXIS)

    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.float32(ctx.replica_id_in_sync_group + 1)
    )
    got = [strategy.experimental_local_results(t)[0] for t in strategy.run(totals, args=(values,))]
    assert [float(v) for v in got] == [n * (n + 1) / 2, n, 1.0]


def test_run_compiles_once_per_signature(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    traces = []

    def step(model, optimizer, x, y):
        traces.append(1)
        return train_step(model, optimizer, x, y)

    for x, y in strategy.experimental_distribute_dataset(global_batches(3, 16)):
        strategy.run(step, args=(model, optimizer, x, y))
    # One trace chooses the output layout and one builds the program; none per step.
    assert len(traces) == 2


def test_args_must_be_a_sequence(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with pytest.raises(TypeError, match=r"args=\(x,\)"):
        strategy.run(lambda x: x, args=np.ones(3))


def test_non_pytree_modules_are_refused_with_the_fix(devices):
    class Legacy(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        legacy = Legacy()
    with pytest.raises(TypeError, match="pytree=False"):
        strategy.run(lambda m: m.w[...], args=(legacy,))


def test_a_step_defined_inside_the_calling_function_compiles_once_and_respects_its_closure():
    """TensorFlow's tutorials define step_fn inside train_step: a new object every call."""
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    (x,) = list(strategy.experimental_distribute_dataset([np.ones((16, 4), np.float32)]))

    def outer(scale):
        def step_fn(model, x):
            return model(x).sum() * scale

        return strategy.reduce("SUM", strategy.run(step_fn, args=(model, x)), axis=None)

    first = float(outer(1.0))
    for i in range(3):
        assert float(outer(float(f"{1 + i * 0}.0"))) == first  # a new, equal float: one program
    scale = 2.0  # held by the closure: another constant, another program
    assert float(outer(scale)) == pytest.approx(2 * first)
    assert len(strategy._runner._programs) == 2
    assert len(strategy._runner._guards) == 2
