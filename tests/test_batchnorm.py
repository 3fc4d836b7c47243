"""BatchNorm under replicas (issues 13 and 18): TensorFlow's per-replica statistics, the
synchronized mode equal to one device, and padded rows never in the batch statistics."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import assert_bit_identical_on_devices
from mirrored._nnx import batch_norm


class Net(nnx.Module):
    def __init__(self, norm="plain", seed=0, fast=False):
        rngs = nnx.Rngs(seed)
        self.dense = nnx.Linear(3, 4, rngs=rngs)
        cls = {"plain": nnx.BatchNorm, "sync": mirrored.layers.SyncBatchNorm}[norm]
        # mirrored computes the variance as the layer asks: one pass (Flax's default) or two.
        self.bn = cls(4, momentum=0.9, use_fast_variance=fast, rngs=rngs)
        self.ln = nnx.LayerNorm(4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.ln(jax.nn.relu(self.bn(self.dense(x)))))


def step(model, optimizer, x, y):
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def single_device_reference(batches, norm="plain", fast=False):
    """Plain JAX, no strategy: one device on each whole global batch."""
    model = Net(norm, fast=fast)
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    for x, y in batches:
        ref_step(model, optimizer, jnp.asarray(x), jnp.asarray(y))
    return model


def data(sizes, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in sizes:
        x = (
            rng.normal(size=(n, 3)).astype(np.float32)
            * np.linspace(1, 3, n, dtype=np.float32)[:, None]
        )
        out.append((x, rng.integers(0, 2, n).astype(np.int32)))
    return out


def train(strategy, batches, norm, fast=False):
    with strategy.scope():
        model = Net(norm, fast=fast)
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    # Each global batch distributed as it is: ragged ones padded, replicas left empty by 5.
    for dist in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(model, optimizer, *dist))
    return model


def _max_diff(a, b):
    fa, fb = nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))
    return max(
        float(np.max(np.abs(np.asarray(va.get_value()) - np.asarray(vb.get_value()))))
        for (_, va), (_, vb) in zip(fa, fb, strict=True)
        if jnp.issubdtype(va.get_value().dtype, jnp.floating)
    )


# Global batches of 16, 13 (ragged: padded to 16 on 8 replicas) and 5 (replicas left empty).
SIZES = (16, 13, 5, 16)


@pytest.mark.parametrize(("replicas", "fast"), [(8, False), (2, False), (1, False), (8, True)])
def test_sync_batchnorm_on_n_replicas_equals_one_device_ragged_batches_included(replicas, fast):
    batches = data(SIZES)
    expected = single_device_reference(batches, fast=fast)
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    model = train(strategy, batches, "sync", fast=fast)
    assert _max_diff(model, expected) <= 1e-5
    assert_bit_identical_on_devices(model)


def test_sync_batchnorm_through_fit_equals_one_device():
    x, y = data((21,), seed=1)[0]  # 21 examples at batch 8: 8, 8 and a ragged 5
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 21, 8)]
    expected = single_device_reference(batches)
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = Net("sync")
        trainer = mirrored.Trainer(
            model, optax.sgd(0.5), loss="sparse_categorical_crossentropy", from_logits=True
        )
    trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _max_diff(model, expected) <= 1e-5


def _replica_rows(strategy, x):
    """Each replica's real rows of the distributed batch (padding dropped), as TensorFlow's."""
    full = np.zeros((16, 3), np.float32)  # a first batch of fewer than 8 would be refused
    (_, dist) = list(strategy.experimental_distribute_dataset([(full,), (x,)]))
    return dist[0], [np.asarray(r) for r in strategy.experimental_local_results(dist[0])]


@pytest.mark.parametrize("rows", [16, 13, 5])
def test_plain_batchnorm_uses_each_replicas_real_rows_and_averages_moving_statistics(rows):
    strategy = mirrored.MirroredStrategy(jax.devices())
    x = data((rows,), seed=2)[0][0]
    with strategy.scope():
        bn = nnx.BatchNorm(3, momentum=0.9, rngs=nnx.Rngs(0))
    dist, local = _replica_rows(strategy, x)
    out = strategy.run(lambda bn, x: bn(x), args=(bn, dist))
    real = [r for r in local if len(r)]  # replicas holding no real row leave the average
    np.testing.assert_allclose(
        np.asarray(bn.mean[...]), 0.1 * np.mean([r.mean(0) for r in real], 0), rtol=1e-5
    )
    np.testing.assert_allclose(
        np.asarray(bn.var[...]), 0.9 + 0.1 * np.mean([r.var(0) for r in real], 0), rtol=1e-5
    )
    # Each replica normalises its real rows with their own statistics.
    for got, r in zip(strategy.experimental_local_results(out), local, strict=True):
        if len(r):
            np.testing.assert_allclose(
                np.asarray(got), (r - r.mean(0)) / np.sqrt(r.var(0) + 1e-5), rtol=1e-4, atol=1e-5
            )
    assert np.isfinite(np.asarray(bn.mean[...])).all()
    assert_bit_identical_on_devices(bn)
    assert nnx.BatchNorm.__call__ is batch_norm._flax_call  # patched only while tracing


def test_padded_rows_do_not_move_batch_statistics_even_when_extreme(monkeypatch):
    """Padded rows are copies of real ones; make them 1e6 instead: no statistic moves."""
    strategy = mirrored.MirroredStrategy(jax.devices())
    full, x = data((16,), seed=3)[0][0], data((13,), seed=3)[0][0]
    pad_to = mirrored._data.batching.pad_to

    def poisoned(leaves, rows, size, fill=None):
        return [
            np.where(np.arange(size)[:, None] < rows, a, 1e6)
            for a in pad_to(leaves, rows, size, fill)
        ]

    results = {}
    for norm in ("plain", "sync"):
        for poison in (False, True):
            if poison:
                monkeypatch.setattr(mirrored._data.batching, "pad_to", poisoned)
            with strategy.scope():
                model = Net(norm)
            (_, (xb,)) = list(strategy.experimental_distribute_dataset([(full,), (x,)]))
            out = strategy.run(lambda m, x: m(x), args=(model, xb))
            results[norm, poison] = (
                np.asarray(model.bn.mean[...]),
                np.asarray(strategy.gather(out, 0)),
            )
            monkeypatch.undo()
    for norm in ("plain", "sync"):
        for clean, poisoned_ in zip(results[norm, False], results[norm, True], strict=True):
            np.testing.assert_array_equal(clean, poisoned_)


def test_sync_batchnorm_outside_run_is_plain_batchnorm():
    x = data((6,), seed=4)[0][0]
    plain, sync = Net("plain"), Net("sync")
    np.testing.assert_allclose(np.asarray(sync(x)), np.asarray(plain(x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sync.bn.var[...]), np.asarray(plain.bn.var[...]))
    sync.eval()
    assert np.isfinite(np.asarray(sync(x))).all()


def test_sync_batchnorm_refuses_another_axis():
    with pytest.raises(ValueError, match="axis_name='data'.*Fix: leave both unset"):
        mirrored.layers.SyncBatchNorm(4, axis_name="data", rngs=nnx.Rngs(0))


class Regularised(Net):
    def __init__(self, norm="plain"):
        super().__init__(norm)
        self.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.out(self.dropout(self.ln(jax.nn.relu(self.bn(self.dense(x))))))


@pytest.mark.parametrize("norm", ["plain", "sync"])
def test_verify_raises_no_false_alarm_for_batchnorm_and_dropout(norm):
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = Regularised(norm)
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    x, y = data((13,), seed=5)[0]
    full = data((16,), seed=5)[0]
    (_, batch) = list(strategy.experimental_distribute_dataset([full, (x, y)]))
    report = mirrored.verify(strategy, step, (model, optimizer, *batch), steps=2)
    assert report.ok, report.to_json()
    assert report["Single-device equivalence"].status == "PASS"
    assert report["Replicas in sync"].status == "PASS"
    assert not model.dropout.deterministic  # verify changed copies only


def test_verify_still_catches_a_wrongly_scaled_step_with_batchnorm():
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = Regularised("plain")
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    def per_replica_mean_step(model, optimizer, x, y):  # the N× trap
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    (batch,) = list(strategy.experimental_distribute_dataset([data((16,), seed=6)[0]]))
    report = mirrored.verify(strategy, per_replica_mean_step, (model, optimizer, *batch))
    check = report["Single-device equivalence"]
    assert check.status == "FAIL" and "8.0× too large" in check.summary


@pytest.mark.parametrize("fast", [True, False])
def test_one_replica_computes_the_statistics_as_flax_does_on_a_padded_batch(fast):
    """At one replica the real rows are the whole batch: Flax's own formula, to rounding."""
    rng = np.random.default_rng(4)
    # Two passes keep their digits when |mean| ≫ std; one pass loses them (in Flax too).
    x = (rng.normal(size=(13, 6, 5)) * 3 + (1 if fast else 40)).astype(np.float32)
    reference = nnx.BatchNorm(5, use_fast_variance=fast, rngs=nnx.Rngs(0))
    expected = np.asarray(reference(jnp.asarray(x), use_running_average=False))
    strategy = mirrored.MirroredStrategy(jax.devices()[:1])
    with strategy.scope():
        norm = nnx.BatchNorm(5, use_fast_variance=fast, rngs=nnx.Rngs(0))
    full = np.concatenate([x, x[:3]])  # a first batch of 16 rows: the static shape
    (_, (padded,)) = list(strategy.experimental_distribute_dataset([(full,), (x,)]))
    assert padded.shape == (16, 6, 5)  # 13 real rows and 3 padded ones
    out = strategy.run(lambda n, v: n(v, use_running_average=False), args=(norm, padded))
    np.testing.assert_allclose(strategy.gather(out, axis=0), expected, rtol=0, atol=2e-5)
    np.testing.assert_allclose(norm.var[...], reference.var[...], rtol=1e-5)


@pytest.mark.parametrize(("norm", "rows", "warned"), [("plain", 16, True), ("sync", 16, False)])
def test_few_rows_per_replica_under_plain_batchnorm_are_said_once(norm, rows, warned, caplog):
    """Issue 33, item 8: per-replica statistics of 2 rows (16 over 8 replicas) train visibly
    worse than one device; TensorFlow says nothing, mirrored warns once (the run, and verify's
    report) and names the fix. SyncBatchNorm's statistics cover the global batch: no warning."""
    strategy = mirrored.MirroredStrategy(jax.devices())
    with strategy.scope():
        model = Regularised(norm)
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset([data((rows,), seed=6)[0]] * 3))
    with caplog.at_level("WARNING", logger="mirrored"):
        for batch in batches:
            strategy.run(step, args=(model, optimizer, *batch))
    said = [r.getMessage() for r in caplog.records if "batch statistics" in r.getMessage()]
    assert len(said) == int(warned)
    if warned:
        assert "each replica's 2 rows" in said[0] and "SyncBatchNorm" in said[0]
    report = mirrored.verify(strategy, step, (model, optimizer, *batches[0]), steps=1)
    names = [c.name for c in report.checks]
    assert ("BatchNorm batch size" in names) == warned
    if warned:
        assert report["BatchNorm batch size"].status == "WARN" and report.ok


def test_keras_batchnormalization_on_few_rows_per_replica_is_said_once(caplog):
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    strategy = mirrored.MirroredStrategy(jax.devices())
    x, y = data((64,), seed=2)[0]
    for synchronized in (False, True):
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((x.shape[1],)),
                    keras.layers.Dense(8),
                    keras.layers.BatchNormalization(synchronized=synchronized),
                    keras.layers.Dense(3),
                ]
            )
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        caplog.clear()
        with caplog.at_level("WARNING", logger="mirrored"):
            model.fit(x, y, batch_size=64, epochs=2, verbose=0)
        said = [r.getMessage() for r in caplog.records if "batch statistics" in r.getMessage()]
        assert len(said) == (0 if synchronized else 1)
        if said:
            assert "8 rows" in said[0] and "synchronized=True" in said[0]
