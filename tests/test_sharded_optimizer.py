"""ShardedOptimizer (issue 38, ZeRO stage 1): the optimizer state split over the replicas, the
replicated run's numbers, to the bit for elementwise transformations."""

import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, job_env, run_two_workers, train_step
from mirrored._core.mesh import sharded_spec

RNG = np.random.default_rng(0)
X = RNG.normal(size=(100, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 100).astype(np.int32)
TRANSFORMS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "adafactor": lambda: optax.adafactor(1e-2),
}


def _trained(devices, make, tx, epochs=4):
    """`epochs` passes of 100 rows at batch 24 (the fifth batch of each is ragged)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = make(model, TRANSFORMS[tx]())
    dataset = strategy.experimental_distribute_dataset((X, Y), batch_size=24, shuffle=False)
    for _ in range(epochs):
        for x, y in dataset:
            strategy.run(train_step, args=(model, optimizer, x, y))
    return model, optimizer


def _small_trainer(devices, build=None, **options):
    """SmallMLP with Adam (or `build(model, adam)`, made in the scope) and a sparse
    cross-entropy from logits, in a new strategy: (strategy, model, trainer)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        tx = optax.adam(1e-2)
        trainer = mirrored.Trainer(
            model,
            tx if build is None else build(model, tx),
            "sparse_categorical_crossentropy",
            from_logits=True,
            **options,
        )
    return strategy, model, trainer


def _arrays(*objects):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(objects))]


def _replicated(model, tx):
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@pytest.mark.parametrize(
    ("tx", "n"),
    [("sgd", 8), ("adam", 1), ("adam", 2), ("adam", 8), ("clip_adam", 8), ("multisteps", 8)],
)
def test_zero1_gives_the_replicated_run_to_the_bit(devices, tx, n):
    """20 steps, ragged batches included: parameters and optimizer state bitwise equal to
    nnx.Optimizer's, whose state is mirrored (clip_by_global_norm sees the whole gradient)."""
    ours = _trained(devices[:n], mirrored.ShardedOptimizer, tx)
    theirs = _trained(devices[:n], _replicated, tx)
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        assert np.array_equal(a, b)


def test_zero1_adafactor_sums_its_factored_moments_in_another_order(devices):
    """Adafactor reduces each leaf's squared gradients to row and column means; split, XLA
    sums the shards in another order: within a few float32 ulps, not to the bit."""
    ours = _trained(devices, mirrored.ShardedOptimizer, "adafactor")
    theirs = _trained(devices, _replicated, "adafactor")
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)


def test_the_state_is_split_and_the_model_stays_mirrored(devices):
    model, optimizer = _trained(devices, mirrored.ShardedOptimizer, "adam", epochs=1)
    first = devices[0]
    whole = here = 0
    for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state)):
        assert leaf.sharding.spec == sharded_spec(leaf.shape, 8), (leaf.shape, leaf.sharding)
        whole += leaf.nbytes
        here += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == first)
    # SmallMLP's Adam moments: 2 x 581 floats; out.bias (5 floats) and the count stay whole.
    assert here == 2 * (581 - 5) * 4 // 8 + 2 * 5 * 4 + 4, here
    assert here <= 1.05 * whole / 8 + 2 * 5 * 4 + 4
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert leaf.sharding.is_fully_replicated


def test_a_trainer_with_sharded_state_fits_as_the_mirrored_one(devices):
    def fitted(**options):
        strategy = mirrored.MirroredStrategy(devices)
        with strategy.scope():
            trainer = mirrored.Trainer(
                SmallMLP(rngs=nnx.Rngs(0)),
                optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
                "sparse_categorical_crossentropy",
                ["accuracy"],
                from_logits=True,
                **options,
            )
        history = trainer.fit(X, Y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        return trainer, history.history

    sharded, ours = fitted(shard_optimizer_state=True)
    mirrored_, theirs = fitted()
    assert isinstance(sharded.optimizer, mirrored.ShardedOptimizer)
    assert ours == theirs
    both = zip(_arrays(sharded.model), _arrays(mirrored_.model), strict=True)
    assert all(np.array_equal(a, b) for a, b in both)
    scattered, logs = fitted(shard_optimizer_state="gradients")  # ZeRO-2
    assert scattered.optimizer.shard_gradients
    for key, values in theirs.items():
        np.testing.assert_allclose(logs[key], values, rtol=1e-6)
    for a, b in zip(_arrays(scattered.model), _arrays(mirrored_.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("n", "shard", "per_execution"),
    [(8, True, 1), (8, "gradients", 1), (2, True, 3), (1, True, 1)],
)
def test_gradient_accumulation_over_sharded_state_fits_as_the_mirrored_one(
    devices, n, shard, per_execution
):
    """gradient_accumulation_steps=3 with the state split: each micro-batch's gradients are
    summed over the replicas (all-reduce, or reduce-scatter) into one accumulator split like
    the state; the update every 3 batches, ragged and weighted batches included, is the
    mirrored Trainer's (whose replicas keep their own sums) to float rounding."""
    weights = RNG.uniform(0.5, 2.0, 100).astype(np.float32)

    def fitted(**options):
        _, model, trainer = _small_trainer(
            devices[:n],
            gradient_accumulation_steps=3,
            steps_per_execution=per_execution,
            **options,
        )
        history = trainer.fit(
            X, Y, sample_weight=weights, batch_size=24, epochs=2, shuffle=False, verbose=0
        )
        return trainer.optimizer, history.history["loss"], _arrays(model)

    (sharded, ours, params), (plain, theirs, expected) = (
        fitted(shard_optimizer_state=shard),
        fitted(),
    )
    assert isinstance(sharded, mirrored.ShardedOptimizer)
    assert int(sharded.opt_state.mini_step[...]) == int(plain.opt_state.mini_step[...]) == 10 % 3
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    for a, b in zip(params, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    sums = sharded.opt_state.gradients["hidden"]["kernel"].get_raw_value()
    assert sums.shape == (1, 12, 32)  # one sum, not one per replica
    assert sums.sharding.spec == sharded_spec((1, 12, 32), n)


@pytest.mark.parametrize("make", [mirrored.ShardedOptimizer, "zero2"], ids=["zero1", "zero2"])
def test_run_steps_and_steps_per_execution_loop_around_the_update(devices, make):
    """K steps in one program: the update runs in the global view after each step (the loop
    goes around the per-replica program); ragged last chunk and batch included."""
    make = _zero2 if make == "zero2" else make

    def fitted(build):
        strategy, model, trainer = _small_trainer(devices, build, steps_per_execution=3)
        history = trainer.fit(X, Y, batch_size=24, epochs=2, shuffle=False, verbose=0)
        iterator = iter(strategy.experimental_distribute_dataset((X, Y), batch_size=16))
        losses = strategy.run_steps(train_step, iterator, steps=4, args=(model, trainer.optimizer))
        losses = np.asarray(strategy.reduce("SUM", losses, axis=None))
        return history.history["loss"], losses, _arrays(model, trainer.optimizer)

    ours, theirs = fitted(make), fitted(_replicated)
    exact = make is mirrored.ShardedOptimizer
    for a, b in zip([ours[0], ours[1], *ours[2]], [theirs[0], theirs[1], *theirs[2]], strict=True):
        if exact:
            assert np.array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_float16_loss_scaling_over_sharded_state_skips_as_the_mirrored_one(devices):
    """mixed_float16: the LossScaleOptimizer's finite check runs in the step, the update (or
    not) after it on the shards; a batch that overflows float16 skips the update on both."""
    x = X.copy()
    x[24:48] *= 3e4  # the second batch's scaled loss overflows

    def fitted(**options):
        _, model, trainer = _small_trainer(devices, policy="mixed_float16", **options)
        trainer.fit(x, Y, batch_size=24, epochs=1, shuffle=False, verbose=0)
        return trainer.optimizer, _arrays(model, trainer.optimizer)

    (sharded, ours), (mirrored_, theirs) = fitted(shard_optimizer_state=True), fitted()
    assert isinstance(sharded.optimizer, mirrored.ShardedOptimizer)
    assert int(sharded.step[...]) == int(mirrored_.step[...]) < 5  # a step was skipped
    assert float(sharded.scale[...]) == float(mirrored_.scale[...]) < 2.0**15
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    with pytest.raises(NotImplementedError, match="ZeRO-2.*Fix: shard_optimizer_state=True"):
        fitted(shard_optimizer_state="gradients")


def test_a_checkpoint_of_sharded_state_restores_onto_any_layout(devices, tmp_path):
    """Saved split over 8 replicas; restored into a mirrored nnx.Optimizer on 2 and into a
    ShardedOptimizer on 2, which keeps its layout; training on from either gives the same."""
    model, optimizer = _trained(devices, mirrored.ShardedOptimizer, "adam", epochs=1)
    mirrored.save_checkpoint(tmp_path, model, optimizer, step=5)
    saved = _arrays(model, optimizer)
    resumed = []
    for make in (_replicated, mirrored.ShardedOptimizer):
        strategy = mirrored.MirroredStrategy(devices[:2])
        with strategy.scope():
            target = SmallMLP(rngs=nnx.Rngs(7))
            target_optimizer = make(target, optax.adam(1e-2))
        assert mirrored.restore_checkpoint(tmp_path, target, target_optimizer) == 5
        restored = _arrays(target, target_optimizer)
        assert all(np.array_equal(a, b) for a, b in zip(saved, restored, strict=True))
        if make is mirrored.ShardedOptimizer:
            mu = target_optimizer.opt_state[0].mu["hidden"]["kernel"]
            assert mu.get_raw_value().sharding.spec == sharded_spec((12, 32), 2)
        for x, y in strategy.experimental_distribute_dataset((X, Y), batch_size=24, shuffle=False):
            strategy.run(train_step, args=(target, target_optimizer, x, y))
        resumed.append(_arrays(target))
    for a, b in zip(*resumed, strict=True):
        assert np.array_equal(a, b)


def test_bad_arguments_are_clear_errors(devices):
    strategy = mirrored.MirroredStrategy(devices)
    model = SmallMLP(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"inside strategy.scope\(\).*Fix"):
        mirrored.ShardedOptimizer(model, optax.adam(1e-3))
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        with pytest.raises(TypeError, match="shard_gradients to be True .* or False .*Fix"):
            mirrored.ShardedOptimizer(model, optax.adam(1e-3), shard_gradients="yes")
        with pytest.raises(ValueError, match="shard_optimizer_state to be False, True"):
            mirrored.Trainer(model, optax.adam(1e-3), "mse", shard_optimizer_state="yes")


def test_the_doctor_shows_memory_per_device_and_what_sharding_saves(devices):
    """verify's "Memory per device": the split state at about 1/8 (PASS), a mirrored one with
    what splitting would save (INFO), and a ShardedOptimizer whose state was placed whole
    again (FAIL: the silent no-op)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        split = mirrored.ShardedOptimizer(model, optax.adam(1e-2))
        whole = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ((x, y),) = strategy.experimental_distribute_dataset([(X[:16], Y[:16])])

    def memory(optimizer):
        report = mirrored.verify(strategy, train_step, (model, optimizer, x, y))
        return report["Memory per device"], report

    check, report = memory(split)
    assert check.status == "PASS", check.summary
    state = check.data["optimizer state"]
    assert state["replicated"] == 2 * 581 * 4 + 4
    assert state["now"] == 2 * (581 - 5) * 4 // 8 + 2 * 5 * 4 + 4
    # out.bias's two moments (5 floats each) and Adam's count.
    assert "44 B in 3 leaves not divisible by 8 stay whole" in check.summary
    assert check.data["collectives"]["all-gather"] >= 1, check.data
    assert report["Replicas in sync"].status == "PASS"
    assert check.data["grads"]["now"] == check.data["grads"]["replicated"] == 581 * 4
    assert check.data["compiled"]["temp"] > 0 and "temporaries" in check.summary
    check, _ = memory(whole)
    assert check.status == "INFO" and "mirrored.ShardedOptimizer would hold" in check.summary
    with strategy.scope():  # ZeRO-2: each device keeps its shard of the gradients too
        model = SmallMLP(rngs=nnx.Rngs(0))
        scattered = _zero2(model, optax.adam(1e-2))
    check, _ = memory(scattered)
    assert check.status == "PASS", check.summary
    assert check.data["grads"]["now"] == (581 - 5) * 4 // 8 + 5 * 4
    assert check.data["collectives"]["reduce-scatter"] == 3, check.data
    for variable in jax.tree.leaves(split.opt_state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        variable.set_raw_value(jax.device_put(variable.get_raw_value(), strategy._replicated))
    check, _ = memory(split)
    assert check.status == "FAIL" and "still whole on every device" in check.summary


# -- ZeRO-2: shard_gradients=True ---------------------------------------------------------------


def _zero2(model, tx):
    return mirrored.ShardedOptimizer(model, tx, shard_gradients=True)


@pytest.mark.parametrize(
    ("tx", "n", "epochs"),
    [("sgd", 8, 4), ("adam", 2, 1), ("adam", 8, 1), ("clip_adam", 8, 1), ("multisteps", 8, 1)],
)
def test_zero2_gives_the_replicated_run_within_float_rounding(devices, tx, n, epochs):
    """20 SGD steps, 5 of Adam (ragged batches included): each replica sums its shard of the
    gradients (a reduce-scatter) in another order than the all-reduce; within 1e-6."""
    ours = _trained(devices[:n], _zero2, tx, epochs)
    theirs = _trained(devices[:n], _replicated, tx, epochs)
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_zero2_on_one_replica_is_nnx_optimizer_to_the_bit(devices):
    ours = _trained(devices[:1], _zero2, "adam", 1)
    theirs = _trained(devices[:1], _replicated, "adam", 1)
    for a, b in zip(_arrays(*ours), _arrays(*theirs), strict=True):
        assert np.array_equal(a, b)


def test_zero2_compiles_a_reduce_scatter_and_no_whole_gradient(devices):
    strategy = mirrored.MirroredStrategy(devices)
    programs = {}
    for name, make in (("zero1", mirrored.ShardedOptimizer), ("zero2", _zero2)):
        with strategy.scope():
            model = SmallMLP(rngs=nnx.Rngs(0))
            optimizer = make(model, optax.adam(1e-2))
        ((x, y),) = strategy.experimental_distribute_dataset([(X[:16], Y[:16])])
        lowered = strategy._runner.lowered(train_step, (model, optimizer, x, y), {})
        text = lowered.compile().as_text().splitlines()
        programs[name] = {
            op: " ".join(line.split(f" {op}(")[0] for line in text if f" {op}(" in line)
            for op in ("all-reduce", "reduce-scatter")
        }
    # ZeRO-1 all-reduces every gradient whole; ZeRO-2 reduce-scatters hidden.kernel (split
    # on its 32 columns), hidden.bias and out.kernel, and all-reduces out.bias (5) alone.
    assert all(f"f32[{s}]" in programs["zero1"]["all-reduce"] for s in ("12,32", "32,5"))
    assert programs["zero1"]["reduce-scatter"] == ""
    assert programs["zero2"]["all-reduce"].count("f32[") == 1
    assert "f32[1,5]" in programs["zero2"]["all-reduce"]
    scattered = programs["zero2"]["reduce-scatter"]
    assert all(f"f32[{s}]" in scattered for s in ("12,4", "4", "4,5")), scattered


def _loss(model, x, y):
    per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
    return mirrored.compute_average_loss(per_example)


def _mean_of_gradients(model, optimizer, x, y):
    grads = nnx.grad(_loss)(model, x, y)
    optimizer.update(model, mirrored.get_replica_context().all_reduce("MEAN", grads))


def _norm_of_gradients(model, optimizer, x, y):
    grads = nnx.grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return optax.tree.norm(grads)


def _writes_a_parameter(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(_loss)(model, x, y))
    model.out.kernel.set_value(jax.numpy.zeros((32, 5)))


@pytest.mark.parametrize(
    ("step", "error"),
    [
        (_mean_of_gradients, r"all_reduce\('MEAN'\) .* 1/N of the true mean.*Fix"),
        (_norm_of_gradients, r"partial sum .*clip_by_global_norm.*shard_gradients=False"),
        (_writes_a_parameter, r"assignment to a Param of shape \[32, 5\].*Fix"),
    ],
    ids=["mean", "norm", "write"],
)
def test_zero2_refuses_what_would_silently_differ(devices, step, error):
    """JAX would give 1/N for a MEAN of the partial sums without a word; a norm of them
    raises JAX's own error, re-raised with the fix. Nothing changes."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = _zero2(model, optax.adam(1e-2))
    ((x, y),) = strategy.experimental_distribute_dataset([(X[:16], Y[:16])])
    before = _arrays(model, optimizer)
    with pytest.raises(ValueError, match=error):
        strategy.run(step, args=(model, optimizer, x, y))
    assert all(np.array_equal(a, b) for a, b in zip(before, _arrays(model, optimizer), strict=True))


@pytest.mark.slow
def test_two_processes_split_the_state_and_train_as_the_mirrored_run(tmp_path):
    """2 processes x 2 devices: no device holds a whole split leaf; ZeRO-1 equals the mirrored
    optimizer to the bit and ZeRO-2 within 1e-6 (ragged last batch included); a ZeRO-1
    checkpoint restores into a mirrored nnx.Optimizer and a ShardedOptimizer alike."""
    script = str(Path(__file__).resolve().parent / "_zero_script.py")
    command = ["timeout", "-k", "10", "150", sys.executable, script, str(tmp_path)]
    env = {**job_env(), "MIRRORED_LOCAL_DEVICES": "2"}
    codes, outputs = run_two_workers(command, env)
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    result = np.load(tmp_path / "result.npz")
    leaves = sorted({key.split("/")[1] for key in result if key.startswith("mirrored/")}, key=int)
    for i in leaves:
        theirs = result[f"mirrored/{i}"]
        assert np.array_equal(result[f"zero1/{i}"], theirs), i
        np.testing.assert_allclose(result[f"zero2/{i}"], theirs, rtol=1e-6, atol=1e-7)
        for name in ("mirrored", "zero1"):
            assert np.array_equal(result[f"restored_{name}/{i}"], result[f"zero1/{i}"]), i


@pytest.mark.parametrize(
    ("shard", "per_execution"), [(True, 1), ("gradients", 3)], ids=["zero1", "zero2-spe3"]
)
def test_terminate_on_nan_stops_before_the_bad_update_as_the_mirrored_run(
    devices, capsys, shard, per_execution
):
    """Batch 2 holds NaN: the step's check (loss, gradients, the updated shards) keeps the
    model and the split state as they were, and training stops there, as when mirrored."""
    x = X.copy()
    x[48:72] = np.nan

    def fitted(**options):
        _, model, trainer = _small_trainer(devices, steps_per_execution=per_execution, **options)
        callback = mirrored.callbacks.TerminateOnNaN()
        trainer.fit(x, Y, batch_size=24, epochs=2, shuffle=False, callbacks=[callback], verbose=0)
        return trainer, _arrays(model, trainer.optimizer)

    (sharded, ours), (_, theirs) = fitted(shard_optimizer_state=shard), fitted()
    assert isinstance(sharded.optimizer, mirrored.ShardedOptimizer)
    assert capsys.readouterr().out.count("Batch 2: Invalid loss, terminating training") == 2
    assert int(sharded.optimizer.step[...]) == 2  # batches 0 and 1
    for a, b in zip(ours, theirs, strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_check_numerics_names_the_input_and_changes_nothing(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = _zero2(model, optax.adam(1e-2))
    x = X[:16].copy()
    x[3, 2] = np.inf
    ((xb, yb),) = strategy.experimental_distribute_dataset([(x, Y[:16])])
    before = _arrays(model, optimizer)
    mirrored.debug.enable_check_numerics()
    try:
        strategy.run(train_step, args=(model, optimizer, xb, yb))
    finally:
        with pytest.raises(mirrored.debug.NonFiniteError) as raised:
            mirrored.debug.disable_check_numerics()
    assert list(raised.value.inputs)[:1] == ["x"], raised.value
    assert all(np.array_equal(a, b) for a, b in zip(before, _arrays(model, optimizer), strict=True))


def test_an_update_that_makes_a_parameter_infinite_is_not_applied(devices):
    """Finite loss and gradients, an infinite update (scaled by 3e38 twice in float32): the
    check of the updated shards, after the step, keeps the state and names the parameter."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        huge = optax.chain(optax.scale(-3e38), optax.scale(3e38))
        optimizer = mirrored.ShardedOptimizer(model, huge)
    ((xb, yb),) = strategy.experimental_distribute_dataset([(X[:16], Y[:16])])
    before = _arrays(model, optimizer)
    mirrored.debug.enable_check_numerics()
    try:
        strategy.run(train_step, args=(model, optimizer, xb, yb))
    finally:
        with pytest.raises(mirrored.debug.NonFiniteError, match="state") as raised:
            mirrored.debug.disable_check_numerics()
    assert "kernel" in str(raised.value) or "bias" in str(raised.value), raised.value
    assert all(np.array_equal(a, b) for a, b in zip(before, _arrays(model, optimizer), strict=True))


def test_state_over_a_per_device_budget_when_mirrored_fits_under_it_when_sharded(devices):
    """A budget of 20 KB of optimizer state per device: Adam on a 64-64-64 MLP needs 66.6 KB
    mirrored, 8.4 KB split over 8 replicas."""
    budget = 20_000

    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)

    def per_device(make):
        strategy = mirrored.MirroredStrategy(devices)
        with strategy.scope():
            model = Wide(nnx.Rngs(0))
            optimizer = make(model, optax.adam(1e-3))
        return sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state))
            for s in leaf.addressable_shards
            if s.device == devices[0]
        )

    assert per_device(_replicated) == 2 * 2 * (64 * 64 + 64) * 4 + 4 > budget
    assert per_device(mirrored.ShardedOptimizer) == 2 * 2 * (64 * 64 + 64) * 4 // 8 + 4 <= budget


class _Interrupt(mirrored.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise RuntimeError("interrupted after the first epoch's backup")


def test_a_sharded_fit_resumes_from_its_backup_and_its_checkpoint_restores_anywhere(
    devices, tmp_path
):
    """BackupAndRestore: a fit interrupted after epoch 1 and run again equals one never
    interrupted, to the bit; ModelCheckpoint's split state restores into a mirrored
    nnx.Optimizer on one device with the same values."""
    options = {"batch_size": 24, "epochs": 3, "shuffle": False, "verbose": 0}
    backup = str(tmp_path / "backup")
    _, _, first = _small_trainer(devices, shard_optimizer_state=True)
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(
            X, Y, callbacks=[mirrored.callbacks.BackupAndRestore(backup), _Interrupt()], **options
        )
    _, model, resumed = _small_trainer(devices, shard_optimizer_state=True)
    saves = mirrored.callbacks.ModelCheckpoint(str(tmp_path / "ckpt"))
    resumed.fit(X, Y, callbacks=[mirrored.callbacks.BackupAndRestore(backup), saves], **options)
    _, clean_model, clean = _small_trainer(devices, shard_optimizer_state=True)
    clean.fit(X, Y, **options)
    ours = _arrays(model, resumed.optimizer)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(ours, _arrays(clean_model, clean.optimizer), strict=True)
    )
    strategy = mirrored.MirroredStrategy(devices[:1])
    with strategy.scope():
        target = SmallMLP(rngs=nnx.Rngs(5))
        target_optimizer = _replicated(target, optax.adam(1e-2))
    assert mirrored.restore_checkpoint(tmp_path / "ckpt", target, target_optimizer) == 3
    assert all(
        np.array_equal(a, b) for a, b in zip(ours, _arrays(target, target_optimizer), strict=True)
    )
