"""The per-step fast path never uses stale structure: every change between steps is seen."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, global_batches, params_of, train_step


def _setup(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset(global_batches(1, 16))
    return strategy, model, optimizer, x, y


def test_swapped_submodule_is_trained_not_the_old_one(devices):
    # The same roots (model, optimizer) come back; only an attribute inside the model changed.
    # SGD has no per-parameter state, so the optimizer can stay: the guard's attribute check
    # is the only thing that sees the swap.
    strategy, model, optimizer, x, y = _setup(devices)
    strategy.run(train_step, args=(model, optimizer, x, y))
    old = model.out
    old_params = params_of(old)
    with strategy.scope():
        model.out = nnx.Linear(32, 5, rngs=nnx.Rngs(7))
    fresh = params_of(model.out)
    strategy.run(train_step, args=(model, optimizer, x, y))
    assert all(np.array_equal(old_params[k], v) for k, v in params_of(old).items())
    assert any(not np.array_equal(fresh[k], v) for k, v in params_of(model.out).items())


def test_replaced_variable_is_read_and_written(devices):
    strategy, model, *_ = _setup(devices)

    def bias_sum(model):
        return jnp.sum(model.out.bias[...])

    assert float(strategy.run(bias_sum, args=(model,))) == 0.0
    with strategy.scope():
        model.out.bias = nnx.Param(jnp.full((5,), 2.0))
    assert float(strategy.run(bias_sum, args=(model,))) == 10.0


def test_static_flag_change_recompiles(devices):
    class Scaled(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(()))
            self.double = False  # a static attribute, like Dropout's `deterministic`

        def __call__(self):
            return self.w[...] * (2.0 if self.double else 1.0)

    def call(m):
        return m()

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        module = Scaled()
    assert float(strategy.run(call, args=(module,))) == 1.0
    assert float(strategy.run(call, args=(module,))) == 1.0  # the fast path is armed now
    module.double = True  # the same function and module: only the guard sees the change
    assert float(strategy.run(call, args=(module,))) == 2.0


def test_another_model_with_the_same_step(devices):
    strategy, model, optimizer, x, y = _setup(devices)
    strategy.run(train_step, args=(model, optimizer, x, y))
    with strategy.scope():
        other = SmallMLP(rngs=nnx.Rngs(1))
        other_optimizer = nnx.Optimizer(other, optax.sgd(0.1), wrt=nnx.Param)
    before_first = params_of(model)
    strategy.run(train_step, args=(other, other_optimizer, x, y))
    assert int(other_optimizer.step[...]) == 1 and int(optimizer.step[...]) == 1
    assert all(np.array_equal(before_first[k], v) for k, v in params_of(model).items())


def test_state_moved_off_the_mesh_is_caught_on_the_fast_path(devices):
    strategy, model, optimizer, x, y = _setup(devices)
    strategy.run(train_step, args=(model, optimizer, x, y))
    model.out.bias.set_value(jax.device_put(jnp.zeros(5), devices[0]))  # one device only
    with pytest.raises(ValueError, match=r"args\[0\].out.bias .* created outside"):
        strategy.run(train_step, args=(model, optimizer, x, y))
