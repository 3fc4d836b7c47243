"""No silent wrong numbers: TensorFlow's and Keras' values, or a clear error (issue 12).

Each test names the behaviour it pins; TensorFlow's own cases are in test_tf_conformance.py.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, params_of

REPLICAS = [1, 2, 8]


@pytest.fixture(scope="module")
def strategies():
    devices = jax.devices()
    return {n: mirrored.MirroredStrategy(devices[:n]) for n in REPLICAS}


# -- 1. padding never changes a reduction -----------------------------------------------------


def _ragged(strategy, rows, batch):
    """The last (ragged) batch of `rows` rows of 1, 2, ... at global batch `batch`."""
    values = np.arange(1, rows * 3 + 1, dtype=np.float32).reshape(rows, 3)
    return list(strategy.experimental_distribute_dataset(values, batch_size=batch))[-1], values


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX", "MIN"])
def test_reduce_and_gather_of_a_ragged_batch_count_real_rows_only(strategies, n, op):
    strategy = strategies[n]
    batch, values = _ragged(strategy, 16 + 11, 16)  # last batch: 11 real rows of 16
    real = values[16:]
    numpy_op = {"SUM": np.sum, "MEAN": np.mean, "MAX": np.max, "MIN": np.min}[op]
    np.testing.assert_allclose(strategy.reduce(op, batch, axis=0), numpy_op(real, axis=0))
    np.testing.assert_allclose(strategy.reduce(op, batch, axis=(0, 1)), numpy_op(real))
    gathered = np.asarray(strategy.gather(batch, axis=0))
    np.testing.assert_array_equal(gathered, real)  # reduce and gather agree
    # The same for what run computes per example from the batch: it carries the mask.
    doubled = strategy.run(lambda x: 2 * x, args=(batch,))
    np.testing.assert_allclose(strategy.reduce(op, doubled, axis=0), numpy_op(2 * real, axis=0))
    np.testing.assert_array_equal(np.asarray(strategy.gather(doubled, axis=0)), 2 * real)
    local = strategy.experimental_local_results(doubled)
    np.testing.assert_array_equal(np.concatenate([np.asarray(v) for v in local]), 2 * real)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_masked_max_and_min_on_ints_and_bools(strategies, dtype):
    strategy = strategies[8]
    values = (np.arange(10) % 3).astype(dtype)
    (_, batch) = list(strategy.experimental_distribute_dataset(values, batch_size=8))
    for op, fn in [("MAX", np.max), ("MIN", np.min), ("SUM", np.sum)]:
        assert np.asarray(strategy.reduce(op, batch, axis=0)) == fn(values[8:])


def test_axis_none_on_a_padded_batch_refuses_to_count_padding(strategies):
    strategy = strategies[2]
    batch, _ = _ragged(strategy, 7, 4)  # 3 real rows in 4
    with pytest.raises(ValueError, match=r"axis=None.*3 real examples in 4 rows") as info:
        strategy.reduce("SUM", strategy.run(lambda x: x, args=(batch,)), axis=None)
    assert "axis=0" in str(info.value)
    with pytest.raises(ValueError, match="axis=1"):
        strategy.gather(batch, axis=1)
    values = np.arange(24.0).reshape(8, 3)
    full = next(iter(strategy.experimental_distribute_dataset(values, batch_size=4)))
    # axis=None adds the replicas' rows position by position: rows 0-1 plus rows 2-3.
    np.testing.assert_array_equal(
        strategy.reduce("SUM", full, axis=None), values[0:2] + values[2:4]
    )


def test_a_carried_over_output_does_not_lend_its_mask_to_the_next_batch(strategies):
    # Running sums returned by one step and passed into the next (the Trainer's pattern) have
    # the shape of a replica's rows here; the next batch's mask must be the batch's own.
    strategy = strategies[2]
    data = np.ones((6,), np.float32)  # batches of 4: 4 real rows, then 2 real rows

    def step(sums, x):
        mask = mirrored.get_replica_context().example_mask
        return sums + jnp.sum((x + 1) * mask)  # + 1: a padded row would count as 1

    sums = strategy.experimental_distribute_values_from_function(lambda _: np.zeros(2))
    for x in strategy.experimental_distribute_dataset(data, batch_size=4):
        sums = strategy.run(step, args=(sums, x))
    sums = mirrored.PerReplica(sums.global_value, num_replicas=2, stacked=True)
    # Replica 0: 4 + 4, replica 1: 4 + 0 (its rows of the last batch are padding).
    np.testing.assert_array_equal(strategy.reduce("SUM", sums, axis=None), [12.0, 12.0])


# -- 2. compute_average_loss matches tf.nn.compute_average_loss --------------------------------


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize(
    "weights",
    [np.array([1.0, 2.0, 3.0, 4.0] * 2), np.array([[1.0], [2.0], [3.0], [4.0]] * 2), 2.5],
    ids=["B", "B1", "scalar"],
)
def test_sample_weight_shapes_give_tensorflows_value(strategies, n, weights):
    strategy = strategies[n]
    losses = np.arange(1.0, 9.0, dtype=np.float32)
    w = np.broadcast_to(np.asarray(weights, np.float32).reshape(-1), (8,))
    expected = float(np.sum(losses * w) / 8)  # TF: sum(loss * weight) / global batch
    if np.ndim(weights):
        x, sw = next(iter(strategy.experimental_distribute_dataset([(losses, weights)])))
        out = strategy.run(
            lambda x, sw: mirrored.compute_average_loss(x, sample_weight=sw), (x, sw)
        )
    else:
        (x,) = next(iter(strategy.experimental_distribute_dataset([(losses,)])))
        out = strategy.run(lambda x: mirrored.compute_average_loss(x, sample_weight=2.5), (x,))
    np.testing.assert_allclose(float(strategy.reduce("SUM", out)), expected, rtol=1e-6)


def test_sample_weight_outside_scopes_and_errors():
    losses = jnp.array([1.0, 2.0, 3.0])
    # The case: (B, 1) weights used to make an outer product (15.0, not 7.5).
    weights = jnp.array([[1.0], [2.0], [4.5]])
    assert float(mirrored.compute_average_loss(losses, sample_weight=weights)) == pytest.approx(
        (1 + 4 + 13.5) / 3
    )
    per_token = jnp.ones((3, 4))  # (B,) weights for (B, T) losses are expanded, as in TF
    assert float(mirrored.compute_average_loss(per_token, sample_weight=jnp.array([1, 2, 3]))) == 8
    with pytest.raises(ValueError, match=r"broadcastable.*shape \(3,\); found shape \(4,\)"):
        mirrored.compute_average_loss(losses, sample_weight=jnp.ones(4))
    with pytest.raises(ValueError, match="broadcastable"):
        mirrored.compute_average_loss(losses, sample_weight=jnp.ones((3, 2)))


def _weighted_data(rows=40, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 12)).astype(np.float32)
    y = rng.integers(0, 5, rows).astype(np.int32)
    w = rng.uniform(0.5, 2.0, rows).astype(np.float32)
    return x, y, w


def _reference_weighted_fit(x, y, w, batch, lr):
    """Plain NNX on one device: Keras' weighted loss, sum(l * w) / batch rows, per batch."""
    model = SmallMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, xb, yb, wb):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(xb), yb)
            return jnp.sum(per_example * wb) / xb.shape[0]

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for start in range(0, len(x), batch):
        sl = slice(start, start + batch)
        step(model, optimizer, x[sl], y[sl], w[sl])
    return params_of(model)


@pytest.mark.parametrize("n", [2, 8])
def test_fit_with_sample_weights_trains_like_one_device(strategies, n):
    strategy = strategies[n]
    x, y, w = _weighted_data()
    reference = _reference_weighted_fit(x, y, w, 16, 0.5)
    for weights in (w, w[:, None]):  # (B,) and (B, 1) train the same
        with strategy.scope():
            model = SmallMLP(rngs=nnx.Rngs(0))
            trainer = mirrored.Trainer(
                model, optax.sgd(0.5), "sparse_categorical_crossentropy", from_logits=True
            )
        trainer.fit(x, y, sample_weight=weights, batch_size=16, shuffle=False, verbose=0)
        for name, value in params_of(model).items():
            np.testing.assert_allclose(value, reference[name], rtol=2e-5, atol=1e-6)


# -- 3. cross-replica context ------------------------------------------------------------------


def test_losses_in_cross_replica_context_raise_runtime_error(strategies):
    with strategies[2].scope():
        with pytest.raises(RuntimeError, match="cross replica context") as info:
            mirrored.compute_average_loss(jnp.ones(4))
        assert "Fix: call it inside the function you give to strategy.run" in str(info.value)
        with pytest.raises(RuntimeError, match="`scale_regularization_loss` in cross replica"):
            mirrored.scale_regularization_loss(jnp.ones(()))
        # TensorFlow allows it with an explicit global batch size: nothing to infer.
        assert float(mirrored.compute_average_loss(jnp.ones(4), global_batch_size=8)) == 0.5
    # Outside every scope: TensorFlow's default strategy, one replica.
    assert float(mirrored.compute_average_loss(jnp.ones(4))) == 1.0
    assert float(mirrored.scale_regularization_loss(jnp.array([2.0, 4.0]))) == 6.0


# -- 4. replicated (host) inputs give TensorFlow's update ---------------------------------------


class _Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([0.5, -1.0, 2.0]))

    def __call__(self, x):
        return x @ self.w[...]


@pytest.mark.parametrize("n", REPLICAS)
def test_a_host_batch_given_to_every_replica_trains_like_one_device(strategies, n):
    strategy = strategies[n]
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=6).astype(np.float32)

    def step(model, optimizer, x, y, reg):
        def loss_fn(model):
            loss = mirrored.compute_average_loss((model(x) - y) ** 2)
            return loss + mirrored.scale_regularization_loss(reg * jnp.sum(model.w[...] ** 2))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    with strategy.scope():
        model = _Linear()
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    loss = strategy.run(step, args=(model, optimizer, x, y, 0.1))

    single = _Linear()

    def single_loss(model):
        return jnp.mean((model(x) - y) ** 2) + 0.1 * jnp.sum(model.w[...] ** 2)

    expected_loss = float(single_loss(single))
    grads = nnx.grad(single_loss)(single)
    expected_w = np.asarray(single.w[...]) - 0.1 * np.asarray(grads.w[...])
    assert float(strategy.reduce("SUM", loss)) == pytest.approx(expected_loss, rel=1e-6)
    np.testing.assert_allclose(np.asarray(model.w[...]), expected_w, rtol=1e-6)


# -- 5. the N× trap is named where it happens ----------------------------------------------------


def _mean_loss_step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    optimizer.update(model, nnx.grad(loss_fn)(model))


def _average_loss_step(model, optimizer, x, y):
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)

    optimizer.update(model, nnx.grad(loss_fn)(model))


def _trap_records(strategy, step, caplog):
    x, y, _ = _weighted_data(16)
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    xb, yb = next(iter(strategy.experimental_distribute_dataset((x, y), batch_size=16)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mirrored"):
        for _ in range(3):  # warned once, when the step is traced
            strategy.run(step, args=(model, optimizer, xb, yb))
    return [r for r in caplog.records if r.name == "mirrored.loss"]


def test_a_per_replica_mean_loss_warns_once_naming_the_factor(strategies, caplog):
    (record,) = _trap_records(strategies[8], _mean_loss_step, caplog)
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert "'_mean_loss_step'" in text and "8× the gradient" in text
    assert "compute_average_loss(per_example_loss)" in text
    assert "by the global batch size" in text and "getLogger('mirrored.loss')" in text
    # A distributed batch may be ragged: its padded rows enter an unmasked sum too.
    assert "padded rows" in text and "jnp.where(mask, per_example_loss, 0.0)" in text


def test_compute_average_loss_and_one_replica_never_warn(strategies, caplog):
    assert _trap_records(strategies[8], _average_loss_step, caplog) == []
    assert _trap_records(strategies[1], _mean_loss_step, caplog) == []


def test_the_documented_switch_silences_the_trap_warning(strategies, caplog):
    switch = logging.getLogger("mirrored.loss")
    switch.setLevel(logging.ERROR)
    try:
        assert _trap_records(strategies[2], _mean_loss_step, caplog) == []
    finally:
        switch.setLevel(logging.NOTSET)


# -- 6. context functions inside run ------------------------------------------------------------


def test_run_outside_its_scope_reports_the_running_strategy(strategies):
    strategy = strategies[8]
    seen = {}

    def fn():
        seen["strategy"] = mirrored.get_strategy()
        seen["has"] = mirrored.has_strategy()
        seen["cross"] = mirrored.in_cross_replica_context()
        seen["ctx"] = mirrored.get_replica_context()
        return mirrored.get_strategy().num_replicas_in_sync

    assert strategy.run(fn) == 8
    assert seen["strategy"] is strategy and seen["has"] and not seen["cross"]
    assert seen["ctx"].num_replicas_in_sync == 8
    assert not mirrored.has_strategy() and mirrored.get_strategy().num_replicas_in_sync == 1


def test_scope_objects_reenter_and_strategies_do_not_mix(strategies):
    scope = strategies[2].scope()
    for _ in range(2):
        with scope:
            assert mirrored.get_strategy() is strategies[2]
    assert not mirrored.has_strategy()
    with strategies[2].scope(), pytest.raises(RuntimeError, match="inside the scope of"):
        strategies[8].scope().__enter__()
    assert not mirrored.has_strategy()


# -- 7. Python values passed to run are static --------------------------------------------------


def test_python_bools_ints_strings_select_programs_and_floats_are_traced(strategies):
    strategy = strategies[2]
    (x,) = list(strategy.experimental_distribute_dataset([np.arange(8.0)]))
    traces = []

    def fn(x, training, k, mode, scale):
        traces.append((training, k, mode))
        head = x[:k]  # an int works in a slice
        out = head * 2 if training else head
        return jnp.sum(out if mode == "sum" else -out) * scale

    def total(*args):
        return float(strategy.reduce("SUM", strategy.run(fn, args=(x, *args))))

    assert total(True, 2, "sum", 1.0) == 2 * (0 + 1 + 4 + 5)
    assert total(False, 2, "sum", 1.0) == 0 + 1 + 4 + 5
    assert total(False, 1, "neg", 1.0) == -(0 + 4)
    assert total(False, 1, "neg", 3.0) == -3 * (0 + 4)  # a new float: no new program
    assert total(1, 1, "neg", 1.0) == -2 * (0 + 4)  # 1 is not True: its own program
    assert len(traces) == 2 * 4  # each program is traced twice (shapes, then compile)


# -- 8. Keras parity in Trainer ------------------------------------------------------------------


def _trainer(strategy, lr=0.0, **kwargs):
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        return mirrored.Trainer(
            model,
            optax.sgd(lr),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
            **kwargs,
        )


@pytest.mark.parametrize("n", [1, 8])
def test_logged_loss_and_metrics_use_sample_weights_as_keras(strategies, n):
    trainer = _trainer(strategies[n], weighted_metrics=["accuracy"])
    x, y, w = _weighted_data(37)
    logits = trainer.predict(x)
    per_example = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    hit = (logits.argmax(axis=1) == y).astype(np.float64)
    keras_loss = np.sum(per_example * w) / len(x)  # sum_over_batch_size, batch-size weighted
    logs = trainer.evaluate(x, y, sample_weight=w, batch_size=16)
    assert logs["loss"] == pytest.approx(keras_loss, rel=1e-5)
    assert logs["accuracy"] == pytest.approx(hit.mean(), rel=1e-6)  # `metrics`: unweighted
    assert logs["weighted_accuracy"] == pytest.approx(np.sum(hit * w) / np.sum(w), rel=1e-5)
    history = trainer.fit(
        x,
        y,
        sample_weight=w,
        batch_size=16,
        validation_data=(x, y, w),
        shuffle=False,
        verbose=0,
    )  # lr 0: the model does not change, so the logs equal evaluate's
    assert history.history["loss"][0] == pytest.approx(keras_loss, rel=1e-5)
    assert history.history["val_loss"][0] == pytest.approx(keras_loss, rel=1e-5)
    assert trainer.evaluate(x, y, batch_size=16)["loss"] == pytest.approx(
        per_example.mean(), rel=1e-5
    )


@pytest.mark.parametrize(("rows", "split", "held"), [(37, 0.2, 8), (10, 0.3, 3), (7, 0.5, 4)])
def test_validation_split_holds_out_keras_count(strategies, rows, split, held):
    import math

    assert rows - math.floor(rows * (1 - split)) == held
    trainer = _trainer(strategies[1])
    x, y, _ = _weighted_data(rows)
    history = trainer.fit(x, y, validation_split=split, batch_size=64, verbose=0)
    logits = trainer.predict(x[rows - held :])
    val = np.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y[rows - held :]))
    assert history.history["val_loss"][0] == pytest.approx(float(val), rel=1e-5)


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-8, ValueError), (16.0, TypeError), (True, TypeError)]
)
def test_bad_batch_size_is_an_error(strategies, bad, error):
    trainer = _trainer(strategies[1])
    x, y, _ = _weighted_data(16)
    with pytest.raises(error, match=f"batch_size.*found {bad!r}"):
        trainer.fit(x, y, batch_size=bad, verbose=0)
    with pytest.raises(error, match="batch_size"):
        trainer.evaluate(x, y, batch_size=bad)


class _Scripted(mirrored.callbacks.Callback):
    """Replaces val_loss with a scripted sequence and records the weights' epoch."""

    def __init__(self, values):
        self.values = values

    def on_epoch_end(self, epoch, logs=None):
        logs["val_loss"] = self.values[epoch]
        with self.trainer.strategy.scope():  # mirrored, like every weight
            self.trainer.model.out.bias[...] = jnp.full((5,), float(epoch))


@pytest.mark.parametrize(
    ("values", "kwargs", "epochs_run", "restored"),
    [
        # Keras: wait counts every epoch, improvement resets it; stop when wait >= patience.
        ([1.0, 0.9, 0.95, 0.96, 0.97], {"patience": 2}, 4, 1),
        ([1.0, 1.1, 1.2], {"patience": 1}, 2, 0),
        # A baseline that is never beaten: stop after `patience` epochs, and restore the best
        # epoch even though it did not beat the baseline.
        ([1.0, 1.1, 1.2, 1.3, 1.4], {"patience": 3, "baseline": 0.1}, 3, 0),
        # No early stop: the best weights are still restored at the end of training.
        ([1.0, 0.5, 0.7], {"patience": 5}, 3, 1),
    ],
)
def test_early_stopping_follows_keras(strategies, values, kwargs, epochs_run, restored):
    trainer = _trainer(strategies[1])
    x, y, _ = _weighted_data(16)
    # The scripted callback runs first, so EarlyStopping sees its val_loss and weights.
    stop = mirrored.callbacks.EarlyStopping(restore_best_weights=True, **kwargs)
    history = trainer.fit(
        x, y, epochs=len(values), callbacks=[_Scripted(values), stop], batch_size=16, verbose=0
    )
    assert len(history.epoch) == epochs_run
    np.testing.assert_array_equal(np.asarray(trainer.model.out.bias[...]), float(restored))


def test_a_reused_early_stopping_starts_afresh_each_fit(strategies):
    trainer = _trainer(strategies[1])
    x, y, _ = _weighted_data(16)
    stop = mirrored.callbacks.EarlyStopping(patience=1)
    trainer.fit(x, y, epochs=2, callbacks=[_Scripted([0.1, 0.2]), stop], verbose=0)
    # The first fit's best (0.1) would stop the second at its second epoch: it must not.
    history = trainer.fit(x, y, epochs=3, callbacks=[_Scripted([1.0, 0.9, 0.8]), stop], verbose=0)
    assert len(history.epoch) == 3


class _OneUnit(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([[1.0], [-1.0]]))

    def __call__(self, x):
        return x @ self.w[...]


def test_accuracy_follows_the_shapes_and_logits_threshold_at_zero(strategies):
    strategy = strategies[2]
    x = np.array([[0.8, 0.1], [0.1, 0.3], [0.3, 0.1], [0.1, 0.2]], np.float32)
    y = np.array([[1.0], [0.0], [1.0], [0.0]], np.float32)  # outputs 0.7, -0.2, 0.2, -0.1
    for loss, expected in [
        # Logits: threshold 0, all four right (Keras' 0.5 would say 0.75).
        (mirrored.losses.BinaryCrossentropy(from_logits=True), 1.0),
        # One output unit: Keras' binary accuracy at 0.5 (sparse argmax over one unit: 0.5).
        ("mse", 0.75),
    ]:
        with strategy.scope():
            trainer = mirrored.Trainer(_OneUnit(), optax.sgd(0.0), loss, ["accuracy"])
        assert trainer.evaluate(x, y, batch_size=4)["accuracy"] == pytest.approx(expected)


def test_fetch_to_device_false_still_places_batches_on_the_replicas(strategies):
    strategy = strategies[2]
    options = mirrored.InputOptions(experimental_fetch_to_device=False)
    dataset = strategy.experimental_distribute_dataset(
        np.arange(8.0), options=options, batch_size=4
    )
    batch = next(iter(dataset))
    devices = [next(iter(v.devices())) for v in strategy.experimental_local_results(batch)]
    assert devices == list(strategy.extended.worker_devices)


def test_an_empty_batch_has_loss_zero_and_finite_gradients():
    # TensorFlow's div_no_nan: an empty batch contributes 0, not NaN.
    def loss(scale):
        return mirrored.compute_average_loss(scale * jnp.zeros((0,)))

    assert float(loss(1.0)) == 0.0
    assert float(jax.grad(loss)(1.0)) == 0.0
