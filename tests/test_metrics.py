"""mirrored.metrics: Keras' metrics, exact inside strategy.run on ragged batches (issue 14)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sklearn import metrics as sk

import mirrored
from _helpers import assert_bit_identical_on_devices
from mirrored import metrics as M
from mirrored._nnx import metrics as flax_rules

RNG = np.random.default_rng(0)
N = 37  # batches of 16, 16 and a ragged 5: padded on 8 replicas
CLASSES = 4
LOGITS = RNG.normal(size=(N, CLASSES)).astype(np.float32)
LABELS = RNG.integers(0, CLASSES, N).astype(np.int32)
PROBS = RNG.uniform(size=(N, 1)).astype(np.float32)
BINARY = (RNG.uniform(size=(N, 1)) < PROBS).astype(np.float32)
WEIGHTS = RNG.uniform(0.5, 2.0, N).astype(np.float32)


def _argmax_hits():
    return (LOGITS.argmax(-1) == LABELS).astype(np.float64)


def _top2_hits():
    return np.array([LABELS[i] in np.argsort(-LOGITS[i])[:2] for i in range(N)], np.float64)


def _mean(values, weights=None):
    weights = np.ones(len(values)) if weights is None else weights
    return float(np.sum(values * weights) / np.sum(weights))


# name -> (metric factory, its inputs (y_true, y_pred), expected on the whole data (unweighted,
# weighted))
CASES = {
    "sparse_categorical_accuracy": (
        M.SparseCategoricalAccuracy,
        (LABELS, LOGITS),
        lambda w: _mean(_argmax_hits(), w),
    ),
    "categorical_accuracy": (
        M.CategoricalAccuracy,
        (np.eye(CLASSES, dtype=np.float32)[LABELS], LOGITS),
        lambda w: _mean(_argmax_hits(), w),
    ),
    "top_2": (
        lambda: M.SparseTopKCategoricalAccuracy(k=2),
        (LABELS, LOGITS),
        lambda w: _mean(_top2_hits(), w),
    ),
    "binary_accuracy": (
        M.BinaryAccuracy,
        (BINARY, PROBS),
        lambda w: _mean(((PROBS > 0.5) == BINARY)[:, 0].astype(float), w),
    ),
    "accuracy": (
        M.Accuracy,
        (LABELS, LOGITS.argmax(-1).astype(np.int32)),
        lambda w: _mean(_argmax_hits(), w),
    ),
    "mse": (
        M.MeanSquaredError,
        (BINARY, PROBS),
        lambda w: _mean(((PROBS - BINARY) ** 2)[:, 0], w),
    ),
    "mae": (
        M.MeanAbsoluteError,
        (BINARY, PROBS),
        lambda w: _mean(np.abs(PROBS - BINARY)[:, 0], w),
    ),
    "precision": (
        M.Precision,
        (BINARY, PROBS),
        lambda w: sk.precision_score(BINARY[:, 0], PROBS[:, 0] > 0.5, sample_weight=w),
    ),
    "recall": (
        M.Recall,
        (BINARY, PROBS),
        lambda w: sk.recall_score(BINARY[:, 0], PROBS[:, 0] > 0.5, sample_weight=w),
    ),
}


@pytest.fixture(scope="module")
def strategy():
    return mirrored.MirroredStrategy(jax.devices())


def _batches(*arrays, size=16):
    return [tuple(a[i : i + size] for a in arrays) for i in range(0, N, size)]


def _update(metric, y, p, w=None):
    metric.update_state(y, p, sample_weight=w)


def _update_unweighted(metric, y, p):
    metric.update_state(y, p)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("replicas", [8, 1])
@pytest.mark.parametrize("name", sorted(CASES))
def test_metric_inside_run_on_ragged_batches_equals_numpy_on_the_whole_data(
    name, replicas, weighted
):
    factory, (y_true, y_pred), expected = CASES[name]
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        metric = factory()
    if weighted:
        dataset = strategy.experimental_distribute_dataset(_batches(y_true, y_pred, WEIGHTS))
        for y, p, w in dataset:
            strategy.run(_update, args=(metric, y, p, w))
    else:
        for y, p in strategy.experimental_distribute_dataset(_batches(y_true, y_pred)):
            strategy.run(_update_unweighted, args=(metric, y, p))
    assert float(metric.result()) == pytest.approx(expected(WEIGHTS if weighted else None), 1e-5)
    assert_bit_identical_on_devices(metric)


def test_auc_matches_keras_examples_and_sklearn_on_8_replicas(strategy):
    exact = M.AUC(num_thresholds=3)  # Keras' docstring examples, outside any strategy
    exact.update_state(np.array([0, 0, 1, 1]), np.array([0, 0.5, 0.3, 0.9]))
    assert float(exact.result()) == pytest.approx(0.75)
    exact.reset_state()
    exact.update_state(
        np.array([0, 0, 1, 1]), np.array([0, 0.5, 0.3, 0.9]), sample_weight=np.array([1, 0, 0, 1])
    )
    assert float(exact.result()) == pytest.approx(1.0)

    with strategy.scope():
        roc, pr, logits = M.AUC(), M.AUC(curve="PR"), M.AUC(from_logits=True)
    raw = np.log(PROBS / (1 - PROBS))

    def step(roc, pr, logits, y, p, r):
        roc.update_state(y, p)
        pr.update_state(y, p)
        logits.update_state(y, r)

    for y, p, r in strategy.experimental_distribute_dataset(_batches(BINARY, PROBS, raw)):
        strategy.run(step, args=(roc, pr, logits, y, p, r))
    # 200 thresholds approximate the exact area.
    assert float(roc.result()) == pytest.approx(sk.roc_auc_score(BINARY, PROBS), abs=5e-3)
    assert float(pr.result()) == pytest.approx(sk.average_precision_score(BINARY, PROBS), abs=3e-2)
    assert float(logits.result()) == pytest.approx(float(roc.result()), abs=1e-6)


def test_mean_and_sum_of_per_replica_scalars_and_rows(strategy):
    with strategy.scope():
        mean_rows, sum_rows, mean_scalars = M.Mean(), M.Sum(), M.Mean()
    values = RNG.normal(size=(N, 3)).astype(np.float32)

    def step(mean_rows, sum_rows, mean_scalars, v):
        mean_rows.update_state(v)  # each row averaged over its 3 values, padded rows masked
        sum_rows.update_state(v)
        mask = mirrored.get_replica_context().example_mask
        real = v if mask is None else v * mask[:, None]
        mean_scalars.update_state(jnp.sum(real))  # one value per replica and step

    batches = list(strategy.experimental_distribute_dataset(_batches(values)))
    for (v,) in batches:
        strategy.run(step, args=(mean_rows, sum_rows, mean_scalars, v))
    assert float(mean_rows.result()) == pytest.approx(values.mean(), rel=1e-5)
    assert float(sum_rows.result()) == pytest.approx(values.sum(), rel=1e-5)
    assert float(mean_scalars.count[...]) == 8 * len(batches)  # every replica, every step
    assert float(mean_scalars.result()) == pytest.approx(values.sum() / (8 * 3), rel=1e-5)


def test_reset_state_keeps_the_metric_mirrored_and_a_result_reads_anywhere(strategy):
    with strategy.scope():
        accuracy = M.SparseCategoricalAccuracy()
    ((y, p),) = strategy.experimental_distribute_dataset([(LABELS[:16], LOGITS[:16])])
    strategy.run(_update_unweighted, args=(accuracy, y, p))
    first = float(accuracy.result())
    accuracy.reset_states()  # Keras 2's name, as TensorFlow's tutorials write it
    assert float(accuracy.result()) == 0.0 and float(accuracy.count[...]) == 0.0
    strategy.run(_update_unweighted, args=(accuracy, y, p))  # still mirrored: run accepts it
    assert float(accuracy.result()) == first
    assert_bit_identical_on_devices(accuracy)
    assert accuracy.name == "sparse_categorical_accuracy"
    assert repr(accuracy) == "SparseCategoricalAccuracy(name='sparse_categorical_accuracy')"


def test_a_subclassed_metric_counts_real_rows_only(strategy):
    class PositiveRate(M.Metric):
        """Share of predictions above zero, weighted by the rows' weights."""

        def __init__(self, name="positive_rate"):
            super().__init__(name)
            self.hits = self.add_variable()
            self.rows = self.add_variable()

        def update_state(self, y_pred, sample_weight=None):
            w = self.weights(y_pred[:, 0], sample_weight)  # padded rows weigh 0
            self.hits[...] += jnp.sum((y_pred[:, 0] > 0) * w)
            self.rows[...] += jnp.sum(w)

        def result(self):
            return self.hits[...] / self.rows[...]

    with strategy.scope():
        rate = PositiveRate()
    for (p,) in strategy.experimental_distribute_dataset(_batches(LOGITS)):
        strategy.run(lambda m, p: m.update_state(p), args=(rate, p))
    assert float(rate.result()) == pytest.approx(np.mean(LOGITS[:, 0] > 0))


def test_bad_metric_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="num_thresholds to be an int > 1"):
        M.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match="curve 'ROC' or 'PR'"):
        M.AUC(curve="roc_pr")
    with pytest.raises(ValueError, match="Expected a metric name from"):
        M.get("f1")


def test_a_value_every_replica_holds_counts_once_per_replica_as_tensorflow(strategy):
    with strategy.scope():
        total, mean = M.Sum(), M.Mean()
    values = np.arange(4, dtype=np.float32)  # a host array: every replica gets all of it

    def step(total, mean, v):
        total.update_state(v)
        mean.update_state(v)

    strategy.run(step, args=(total, mean, values))
    assert float(total.result()) == 8 * values.sum()  # SYNC_ON_READ SUM over 8 replicas
    assert float(mean.result()) == pytest.approx(values.mean())  # total and count alike


def test_flax_average_accuracy_and_multimetric_inside_run_equal_one_device(strategy):
    """Flax's tutorial metrics, updated inside the step: sums combined, padding masked."""

    def step(metrics, y, p, v):
        metrics.update(logits=p, labels=y, values=v)

    def make():
        return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("values"))

    loss_values = RNG.normal(size=N).astype(np.float32)
    with strategy.scope():
        ours = make()
    for y, p, v in strategy.experimental_distribute_dataset(_batches(LABELS, LOGITS, loss_values)):
        strategy.run(step, args=(ours, y, p, v))
    reference = make()  # one device, the whole data at once
    reference.update(logits=jnp.asarray(LOGITS), labels=jnp.asarray(LABELS), values=loss_values)
    got, want = ours.compute(), reference.compute()
    assert float(got["accuracy"]) == pytest.approx(float(want["accuracy"]), abs=1e-6)
    assert float(got["loss"]) == pytest.approx(float(want["loss"]), abs=1e-6)
    assert int(ours.accuracy.count[...]) == N  # real rows only
    assert_bit_identical_on_devices(ours)
    assert (
        nnx.metrics.Average.update is flax_rules._flax_average_update
    )  # patched only while tracing


def test_a_flax_metric_that_is_not_a_sum_is_refused_with_the_fix(strategy):
    with strategy.scope():
        welford = nnx.metrics.Welford()
    ((v,),) = strategy.experimental_distribute_dataset([(np.arange(16, dtype=np.float32),)])
    with pytest.raises(mirrored.ReplicaDivergenceError, match="Welford.*not a sum"):
        strategy.run(lambda m, v: m.update(values=v), args=(welford, v))


class SumOfSquares(nnx.metrics.Metric):
    """A user's own Flax metric whose state is sums (not built on Average)."""

    def __init__(self):
        self.total = nnx.metrics.MetricState(jnp.zeros((), jnp.float32))
        self.rows = nnx.metrics.MetricState(jnp.zeros((), jnp.int32))

    def update(self, *, values, **_):
        self.total[...] += jnp.sum(values**2)
        self.rows[...] = self.rows[...] + values.shape[0]

    def compute(self):
        return self.total[...] / self.rows[...]

    def reset(self):
        self.total[...], self.rows[...] = 0.0, 0


class DecayedMean(SumOfSquares):
    """Not a sum: the old state is scaled."""

    def update(self, *, values, **_):
        self.total[...] = 0.9 * self.total[...] + jnp.sum(values)
        self.rows[...] = self.rows[...] + values.shape[0]


def test_the_jaxpr_check_tells_sums_from_running_means():
    values = jnp.arange(5.0)
    for metric, adds in [
        (nnx.metrics.Average(), True),
        (nnx.metrics.Accuracy(), True),
        (SumOfSquares(), True),
        (DecayedMean(), False),
        (nnx.metrics.Welford(), False),
    ]:
        update = type(metric).update
        kwargs = (
            {"values": values}
            if not isinstance(metric, nnx.metrics.Accuracy)
            else {"logits": jnp.ones((5, 3)), "labels": jnp.zeros(5, jnp.int32)}
        )
        assert flax_rules.adds_to_its_state(update, metric, (), kwargs) is adds, type(
            metric
        ).__name__


def test_a_users_own_flax_sum_metric_inside_run_equals_one_device(strategy, caplog):
    with strategy.scope():
        ours = nnx.MultiMetric(squares=SumOfSquares(), mean=nnx.metrics.Average("values"))
    batches = [(LOGITS[i : i + 16, 0],) for i in (0, 16, 32)]  # 16, 16 and a ragged 5
    dataset = iter(strategy.experimental_distribute_dataset(batches))
    with caplog.at_level("WARNING", logger="mirrored.metrics"):
        for (v,) in itertools.islice(dataset, 2):  # full batches: exact
            strategy.run(lambda m, v: m.update(values=v), args=(ours, v))
        np.asarray(ours.squares.total[...])  # the steps ran
        expected = float(np.mean(LOGITS[:32, 0] ** 2))
        assert float(ours.squares.compute()) == pytest.approx(expected, 1e-6)
        assert int(ours.squares.rows[...]) == 32
        assert_bit_identical_on_devices(ours)
        assert "padded" not in caplog.text
        # The ragged batch: an own metric cannot be masked, so it says so (Average is exact).
        ((v,),) = list(dataset)
        strategy.run(lambda m, v: m.update(values=v), args=(ours, v))
        assert int(ours.squares.rows[...]) == 48  # 5 real rows padded to 16: as warned
    assert "with 11 rows). mirrored cannot tell" in caplog.text
    assert int(ours.mean.count[...]) == 37  # Average: real rows only
    assert SumOfSquares.update.__name__ == "update"  # patched only while tracing
    with strategy.scope():
        decayed = DecayedMean()
    with pytest.raises(mirrored.ReplicaDivergenceError, match="not a sum"):
        strategy.run(lambda m, v: m.update(values=v), args=(decayed, v))


def test_a_replicas_loss_share_given_to_a_mean_metric_warns_of_loss_over_n(strategy, caplog):
    def step(metric, x, per_example):
        loss = mirrored.compute_average_loss(per_example)  # this replica's share
        metric.update(values=per_example if per_example_ok else loss)

    with strategy.scope():
        average = nnx.metrics.Average()
    ((x, losses),) = strategy.experimental_distribute_dataset([(LOGITS[:16], LOGITS[:16, 0])])
    for per_example_ok in (True, False):
        caplog.clear()
        with caplog.at_level("WARNING", logger="mirrored.metrics"):
            strategy.run(step, args=(average, x, losses))
        warned = "reports the loss / 8" in caplog.text
        assert warned is not per_example_ok
    with strategy.scope():
        mean = M.Mean()
    caplog.clear()
    with caplog.at_level("WARNING", logger="mirrored.metrics"):
        strategy.run(
            lambda m, v: m.update_state(mirrored.compute_average_loss(v)), args=(mean, losses)
        )
    assert "Mean('mean') was updated with one scalar per replica" in caplog.text
