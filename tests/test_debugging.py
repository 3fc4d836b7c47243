"""Debugging a distributed step as in TensorFlow's eager mode (issue 21): `run_functions_eagerly`
and `Trainer(run_eagerly=True)` run the step op by op with the compiled path's numbers;
Python branches get a clear error; `mirrored.debug.enable_check_numerics()` finds the first
non-finite value by step, replica and parameter, and leaves the state as it was."""

import logging
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, adam_trainer, global_batches, params_of, train_step

ROOT = Path(__file__).resolve().parents[1]
BATCHES = global_batches(3, 64)
BATCHES[-1] = (BATCHES[-1][0][:13], BATCHES[-1][1][:13])  # ragged: 13 rows on 8 replicas


@pytest.fixture
def eagerly():
    mirrored.config.run_functions_eagerly(True)
    yield
    mirrored.config.run_functions_eagerly(False)


@pytest.fixture
def checking():
    mirrored.debug.enable_check_numerics()
    yield
    mirrored.debug.disable_check_numerics()


def _state(strategy, make_tx):
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, make_tx(), wrt=nnx.Param)


def _train(replicas, make_tx, batches=BATCHES, steps_per_program=1):
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    model, optimizer = _state(strategy, make_tx)
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    losses = []
    if steps_per_program == 1:
        for x, y in iterator:
            loss = strategy.run(train_step, args=(model, optimizer, x, y))
            losses.append(float(strategy.reduce("SUM", loss, axis=None)))
    else:
        while (
            out := strategy.run_steps(
                train_step, iterator, steps=steps_per_program, args=(model, optimizer)
            )
        ) is not None:
            losses += [float(v) for v in strategy.reduce("SUM", out, axis=None)]
    return params_of(model), losses, (model, optimizer)


def _max_diff(a, b):
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_eager_steps_equal_compiled_steps_ragged_last_batch_included():
    # Op by op is slow (8-45 s a case on 2 busy cores): one case, 8 replicas and Adam, a full
    # batch then the ragged one. (A 1-replica SGD case was measured equal too.)
    replicas, make_tx = 8, lambda: optax.adam(0.01)
    batches = BATCHES[1:]
    compiled, compiled_losses, _ = _train(replicas, make_tx, batches)
    mirrored.config.run_functions_eagerly(True)
    try:
        assert mirrored.config.functions_run_eagerly()
        eager, eager_losses, _ = _train(replicas, make_tx, batches)
        if replicas == 8:  # run_steps too
            scanned, _, _ = _train(replicas, make_tx, batches, steps_per_program=2)
            assert _max_diff(scanned, compiled) <= 1e-6
    finally:
        mirrored.config.run_functions_eagerly(False)
    assert not mirrored.config.functions_run_eagerly()
    assert _max_diff(eager, compiled) <= 1e-6
    np.testing.assert_allclose(eager_losses, compiled_losses, rtol=0, atol=1e-6)


def _print_step(model, optimizer, x, y):
    print("batch rows:", x[:, 0])
    return train_step(model, optimizer, x, y)


def test_print_shows_each_replica_with_its_id_and_one_warning_says_how_to_stop(
    eagerly, capsys, caplog
):
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    with caplog.at_level(logging.WARNING, logger="mirrored"):
        for x, y in strategy.experimental_distribute_dataset(BATCHES[:2]):
            strategy.run(_print_step, args=(model, optimizer, x, y))
    out = capsys.readouterr().out
    for replica in range(8):  # each replica's shard, named by its replica id
        assert f"at mesh coordinates (replica,) = ({replica},)" in out
    first_rows = BATCHES[0][0][::8, 0]  # replica r's first row is the batch's row 8 r
    assert f"{first_rows[3]:.4f}"[:6] in out
    warnings = [r for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "run_functions_eagerly(False)" in warnings[0].getMessage()


def _raising_step(model, x):
    if x.shape[-1] != 7:
        raise ValueError("planted: the user's own error")  # the line the traceback must show
    return model(x)


def test_an_exception_in_the_step_points_at_the_users_line(eagerly):
    strategy = mirrored.MirroredStrategy()
    model, _ = _state(strategy, lambda: optax.sgd(0.1))
    (batch,) = strategy.experimental_distribute_dataset([BATCHES[0][0]])
    with pytest.raises(ValueError, match="planted") as info:
        strategy.run(_raising_step, args=(model, batch))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].filename == __file__ and frames[-1].name == "_raising_step"
    assert "raise ValueError" in frames[-1].line


def test_breakpoint_stops_inside_the_step_with_the_replicas_values(tmp_path):
    script = tmp_path / "debug_step.py"
    script.write_text(
        textwrap.dedent(
            """
            import mirrored
            mirrored.simulate_cpu_devices(4)
            import numpy as np
            mirrored.config.run_functions_eagerly(True)
            strategy = mirrored.MirroredStrategy()
            (x,) = strategy.experimental_distribute_dataset([np.arange(8.0)])

            def step(x):
                doubled = 2 * x
                breakpoint()
                return doubled

            out = strategy.run(step, args=(x,))
            print("after:", strategy.gather(out, axis=0))
            """
        )
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONBREAKPOINT": "pdb.set_trace"}
    result = subprocess.run(
        ["timeout", "-k", "5", "120", sys.executable, str(script)],
        input="p doubled\nc\n",
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert ("(Pdb)" in out and "doubled = 2 * x" in out) or "-> return doubled" in out
    # The replicas' values, each with its replica id: replica 2 holds rows 4 and 5.
    assert "at mesh coordinates (replica,) = (2,):\n[ 8. 10.]" in out
    assert "after: [ 0.  2.  4.  6.  8. 10. 12. 14.]" in out


def _same_on_every_replica(x):
    total = mirrored.get_replica_context().all_reduce("SUM", jnp.sum(x))
    if total > 0:  # Python if on a value every replica agrees on
        return total
    return -total


def _differs_per_replica(x):
    if jnp.sum(x) > 50:
        return x
    return -x


def test_python_branches_work_on_mirrored_values_eagerly_and_explain_the_rest():
    strategy = mirrored.MirroredStrategy()
    (x,) = strategy.experimental_distribute_dataset([np.arange(16.0).reshape(8, 2)])
    with pytest.raises(mirrored.PythonBranchError, match="run_functions_eagerly") as compiled:
        strategy.run(_same_on_every_replica, args=(x,))
    assert "jnp.where" in str(compiled.value) and "jax.lax.cond" in str(compiled.value)
    assert isinstance(compiled.value, jax.errors.TracerBoolConversionError)  # JAX's type too
    mirrored.config.run_functions_eagerly(True)
    try:
        assert float(strategy.run(_same_on_every_replica, args=(x,))) == 120.0
        with pytest.raises(mirrored.PythonBranchError, match="differs per replica") as eager:
            strategy.run(_differs_per_replica, args=(x,))
    finally:
        mirrored.config.run_functions_eagerly(False)
    assert "jnp.where" in str(eager.value) and "all_reduce" in str(eager.value)
    with pytest.raises(mirrored.PythonBranchError, match="differs per replica"):
        strategy.run(_differs_per_replica, args=(x,))
    with pytest.raises(TypeError, match="True or False"):
        mirrored.config.run_functions_eagerly("yes")


def test_trainer_run_eagerly_gives_fits_evaluates_and_predicts_numbers():
    x = np.concatenate([b[0] for b in BATCHES])
    y = np.concatenate([b[1] for b in BATCHES])
    results = []
    for run_eagerly in (False, True):
        trainer = adam_trainer(run_eagerly=run_eagerly)
        history = trainer.fit(x, y, batch_size=64, epochs=1, verbose=0).history
        results.append((trainer, history, trainer.evaluate(x, y), trainer.predict(x)))
    (compiled, h1, e1, p1), (eager, h2, e2, p2) = results
    assert _max_diff(params_of(eager.model), params_of(compiled.model)) <= 1e-6
    for name in h1:
        np.testing.assert_allclose(h2[name], h1[name], rtol=0, atol=1e-6)
    assert e2 == pytest.approx(e1, abs=1e-6)
    np.testing.assert_allclose(p2, p1, rtol=0, atol=1e-5)
    assert p2.shape == (len(x), 5)
    assert not mirrored.config.functions_run_eagerly()  # only inside the trainer's loops
    with pytest.raises(TypeError, match="run_eagerly"):
        adam_trainer(run_eagerly="yes")


def _nan_batches(step, replica):
    """BATCHES with one NaN in replica `replica`'s shard of batch `step` (8 rows a shard)."""
    batches = global_batches(5, 64)
    x = batches[step][0].copy()
    x[8 * replica + 3, 5] = np.nan
    batches[step] = (x, batches[step][1])
    return batches


def _snapshot(model, optimizer):
    return jax.tree.map(np.asarray, jax.tree.leaves(nnx.state((model, optimizer))))


def _same(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("eager", [False, True], ids=["compiled", "eager"])
def test_check_numerics_reports_the_step_replica_and_parameter_and_keeps_the_state(checking, eager):
    bad = 1 if eager else 3  # eager raises at once (op by op is slow); compiled, two behind
    batches = _nan_batches(step=bad, replica=2)
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy, lambda: optax.adam(0.01))
    mirrored.config.run_functions_eagerly(eager)
    try:
        iterator = iter(strategy.experimental_distribute_dataset(batches))
        for _ in range(bad):
            strategy.run(train_step, args=(model, optimizer, *next(iterator)))
        before = _snapshot(model, optimizer)  # before the bad step
        with pytest.raises(mirrored.debug.NonFiniteError) as info:
            # Compiled, the flags are read two steps behind (the devices never wait for the
            # host); at the latest, reading a value through the strategy raises.
            loss = strategy.run(train_step, args=(model, optimizer, *next(iterator)))
            loss = strategy.run(train_step, args=(model, optimizer, *next(iterator)))
            strategy.reduce("SUM", loss, axis=None)
    finally:
        mirrored.config.run_functions_eagerly(False)
    error = info.value
    assert error.step == bad and error.replicas == [2] and error.batch_replicas == [2]
    assert error.stage == "outputs"  # the loss of replica 2, before any all-reduce
    grads = {"hidden.kernel", "hidden.bias", "out.kernel", "out.bias"}
    assert error.parameter in grads and set(error.paths["gradients"]) == grads
    assert f"step {bad} of 'train_step'" in str(error) and "replica(s) [2]" in str(error)
    assert "Fix:" in str(error)
    # Neither the bad step nor the one dispatched after it changed the model or the optimizer.
    assert _same(_snapshot(model, optimizer), before)
    # The next, finite, step trains from there.
    (x, y) = next(iter(strategy.experimental_distribute_dataset(BATCHES[:1])))
    strategy.reduce("SUM", strategy.run(train_step, args=(model, optimizer, x, y)), axis=None)
    assert not _same(_snapshot(model, optimizer), before)


def test_check_numerics_inside_run_steps_stops_the_state_at_the_bad_step(checking):
    batches = _nan_batches(step=3, replica=5)
    clean, _, _ = _train(8, lambda: optax.sgd(0.1), batches[:3])  # steps 0-2 only
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    strategy.run_steps(train_step, iterator, steps=2, args=(model, optimizer))  # steps 0, 1
    with pytest.raises(mirrored.debug.NonFiniteError) as info:  # steps 2, 3 (NaN), 4
        out = strategy.run_steps(train_step, iterator, steps=3, args=(model, optimizer))
        strategy.reduce("SUM", out, axis=None)
    assert info.value.step == 3 and info.value.replicas == [5]
    assert "the 1 step(s) dispatched after it" in str(info.value)
    assert _max_diff(params_of(model), clean) == 0.0  # step 2 applied, steps 3 and 4 not


def _sqrt_of_zero_step(model, optimizer, x, y):
    """Planted: a finite loss whose gradient is NaN (d sqrt(u)/du at u = 0)."""

    def loss_fn(model):
        per_example = jnp.sqrt(jnp.sum(model(x) * 0.0, axis=-1) ** 2)
        return mirrored.compute_average_loss(per_example)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_check_numerics_names_the_gradient_when_the_loss_is_finite(checking):
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    (x, y) = next(iter(strategy.experimental_distribute_dataset(BATCHES[:1])))
    before = _snapshot(model, optimizer)
    loss = strategy.run(_sqrt_of_zero_step, args=(model, optimizer, x, y))
    with pytest.raises(mirrored.debug.NonFiniteError) as info:
        mirrored.debug.disable_check_numerics()  # raises for the steps not looked at yet
    assert not mirrored.debug.check_numerics_enabled()
    assert np.isfinite(float(strategy.reduce("SUM", loss, axis=None)))  # the loss is finite
    error = info.value
    assert error.stage == "gradients" and error.replicas == list(range(8))
    assert error.path == error.parameter and error.path in error.paths["gradients"]
    assert error.batch_replicas == []
    assert _same(_snapshot(model, optimizer), before)


def test_check_numerics_is_off_by_default_and_in_fit(checking):
    batches = _nan_batches(step=1, replica=0)
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    trainer = adam_trainer(run_eagerly=False)
    with pytest.raises(mirrored.debug.NonFiniteError, match="'train_step'") as info:
        trainer.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert info.value.step == 1 and info.value.replicas == [0]
    mirrored.debug.disable_check_numerics()
    assert not mirrored.debug.check_numerics_enabled()
    history = adam_trainer(run_eagerly=False).fit(
        x, y, batch_size=64, epochs=1, shuffle=False, verbose=0
    )
    assert np.isnan(history.history["loss"][0])  # unchecked: the NaN trains silently


def test_a_non_finite_last_step_raises_as_the_loop_over_the_dataset_ends(checking):
    """The flags are read two steps behind; the loop's end looks at the rest (issue 33, 9)."""
    batches = _nan_batches(step=4, replica=6)  # the last of 5 batches
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy, lambda: optax.sgd(0.1))
    steps = 0
    with pytest.raises(mirrored.debug.NonFiniteError) as info:
        for x, y in strategy.experimental_distribute_dataset(batches):
            strategy.run(train_step, args=(model, optimizer, x, y))
            steps += 1
    assert steps == 5  # every step ran; the error came from the `for` statement itself
    assert info.value.step == 4 and info.value.replicas == [6]


def test_a_non_finite_last_step_of_keras_fit_raises_before_fit_returns(checking):
    """Keras' fit reads the flags two steps behind too; fit's end looks at the rest (issue 33,
    9): before, a NaN in the last batch surfaced only at interpreter exit."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    import mirrored.keras

    x, y = global_batches(1, 96)[0]
    x = x.copy()
    x[-1, 2] = np.nan  # the last row: the last of 3 batches of 32
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(10)])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer="sgd", loss=loss)
    with pytest.raises(mirrored.debug.NonFiniteError) as info:
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert info.value.step == 2
