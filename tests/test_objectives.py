"""Users' own losses and metrics (issue 33). Those of the whole batch (item 1): Dice, Tversky,
a loss function or `Loss.call` that reduces the batch itself, the classic scalar `rmse` metric.
None is a mean of per-example terms, so no combination of the replicas' values gives one
device's number; each is evaluated once on the global batch's real rows. Compared with plain
(_keras_reference.py, a process without mirrored): fit with sample weights and a ragged last
batch (13 rows of 64), then evaluate. Per-token weights and Keras masks (item 2)."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
import mirrored.keras
from _helpers import keras_reference
from _keras_models import (
    BINARY,
    PER_TOKEN_BATCHES,
    SAMPLE_WEIGHTS,
    TOKEN_WEIGHTS,
    TOKENS,
    WHOLE_BATCH_LOSSES,
    X,
    per_token,
    whole_batch,
)
from mirrored._core.global_rows import on_global_rows


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    results = keras_reference(tmp_path_factory.mktemp("keras") / "plain.json", "--objectives")
    assert not results["mirrored_imported"]
    return results


def _fit(loss, devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = whole_batch(loss)
    options = {"batch_size": 64, "shuffle": False, "verbose": 0}
    history = model.fit(X, BINARY, sample_weight=SAMPLE_WEIGHTS, epochs=2, **options).history
    evaluation = model.evaluate(X, BINARY, batch_size=64, verbose=0, return_dict=True)
    return model, history, evaluation


def _check(model, history, evaluation, expected):
    weights = model.get_weights()
    for ours, theirs in zip(weights, expected["weights"], strict=True):
        np.testing.assert_allclose(ours, np.asarray(theirs), atol=2e-5)
    for name, values in expected["history"].items():
        assert history[name] == pytest.approx(values, abs=2e-5), name
    for name, value in expected["evaluate"].items():
        assert evaluation[name] == pytest.approx(value, abs=2e-5), name


@pytest.mark.parametrize("replicas", [8, 2, 1])
def test_dice_loss_and_a_scalar_metric_equal_one_device(plain, devices, replicas):
    """Before: 0.6338 vs 0.6204 on full batches (the replicas' Dice averaged); `rmse` crashed."""
    _check(*_fit("dice", devices[:replicas]), plain["whole_batch"]["dice"])


@pytest.mark.parametrize("loss", [name for name in WHOLE_BATCH_LOSSES if name != "dice"])
def test_losses_that_reduce_the_batch_themselves_equal_one_device(plain, devices, loss):
    _check(*_fit(loss, devices), plain["whole_batch"][loss])


def test_on_global_rows_sees_the_real_rows_of_every_batch_in_order(devices):
    """Full and ragged batches, `run` and `run_steps`, the value and its gradient."""
    strategy = mirrored.MirroredStrategy(devices)
    x = np.random.default_rng(0).normal(size=(27, 3)).astype("float32")

    def dice_like(rows):
        return jnp.sum(rows[:, 0] * jnp.arange(rows.shape[0])) / (jnp.sum(rows**2) + 1.0)

    def step(batch):
        return on_global_rows(dice_like, batch)

    expected = [dice_like(x[:16]), dice_like(x[16:])]
    dataset = strategy.experimental_distribute_dataset(x, batch_size=16)
    for batch, value in zip(dataset, expected, strict=True):
        results = strategy.experimental_local_results(strategy.run(step, args=(batch,)))
        assert all(float(r) == pytest.approx(float(value), rel=1e-6) for r in results)
    stacked = strategy.run_steps(step, iter(dataset), steps=2)  # both counts, one program
    for replica in strategy.experimental_local_results(stacked):
        assert np.asarray(replica) == pytest.approx(np.asarray(expected), rel=1e-6)

    w = jnp.asarray([0.5, -1.0, 2.0])

    def loss_share(w, batch):
        value = on_global_rows(lambda rows: dice_like(rows * w), batch)
        return value / strategy.num_replicas_in_sync

    def grad_step(batch):
        return jax.grad(loss_share)(w, batch)

    for batch, rows in zip(dataset, (x[:16], x[16:]), strict=True):
        ours = strategy.run(grad_step, args=(batch,))
        theirs = jax.grad(lambda w, rows=rows: dice_like(rows * w))(w)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5)


# -- the Trainer: loss= and metrics= callables of the whole batch ------------------------------


def _dice(y_true, y_pred):
    p = jax.nn.sigmoid(y_pred)
    return 1.0 - 2.0 * jnp.sum(y_true * p) / (jnp.sum(y_true) + jnp.sum(p) + 1e-6)


def _rmse(y_true, y_pred):
    return jnp.sqrt(jnp.mean((y_true - y_pred) ** 2))


def _plain_dice_run(x, y, w, w0, b0, batch, epochs):
    """Plain JAX, one device: SGD on Dice × the batch's mean weight, Keras' order; the epoch
    logs as Keras keeps them (the loss weighted by rows, rmse a mean over batches)."""

    def loss(params, xb, yb, wb):
        return _dice(yb, xb @ params[0] + params[1]) * jnp.mean(wb)

    params, logs = (w0, b0), []
    for _ in range(epochs):
        losses, rows, rmses = 0.0, 0, []
        for i in range(0, len(x), batch):
            xb, yb, wb = x[i : i + batch], y[i : i + batch], w[i : i + batch]
            value, grads = jax.value_and_grad(loss)(params, xb, yb, wb)
            rmses.append(float(_rmse(yb, xb @ params[0] + params[1])))
            params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
            losses, rows = losses + float(value) * len(xb), rows + len(xb)
        logs.append({"loss": losses / rows, "rmse": float(np.mean(rmses))})
    return params, logs


@pytest.mark.parametrize(("replicas", "steps_per_execution"), [(8, 1), (2, 1), (1, 1), (8, 3)])
def test_trainer_loss_and_metric_of_the_whole_batch_equal_plain_jax(
    devices, replicas, steps_per_execution
):
    """A `loss=` callable that returns one number (before: each replica's Dice, averaged) and a
    scalar `metrics=` function (before: a broadcasting crash); 44 rows at batch 16 end ragged."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(44, 5)).astype(np.float32)
    y = (rng.random(size=(44, 2)) < 0.4).astype(np.float32)
    w = rng.uniform(0.5, 1.5, size=44).astype(np.float32)
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    with strategy.scope():
        model = nnx.Linear(5, 2, rngs=nnx.Rngs(0))
        w0, b0 = np.asarray(model.kernel[...]), np.asarray(model.bias[...])
        trainer = mirrored.Trainer(
            model,
            optax.sgd(0.5),
            loss=_dice,
            metrics=[_rmse],
            steps_per_execution=steps_per_execution,
        )
    history = trainer.fit(
        x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0
    ).history
    params, logs = _plain_dice_run(x, y, w, w0, b0, batch=16, epochs=2)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), params[0], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(model.bias[...]), params[1], rtol=2e-5, atol=2e-6)
    for epoch, expected in enumerate(logs):
        assert history["loss"][epoch] == pytest.approx(expected["loss"], rel=2e-5)
        assert history["_rmse"][epoch] == pytest.approx(expected["rmse"], rel=2e-5)


# -- per-token weights and Keras masks (item 2) --------------------------------------------------


@pytest.mark.parametrize("batch", PER_TOKEN_BATCHES)
def test_per_token_weights_and_masks_equal_one_device(plain, devices, batch):
    """`(n, T)` sample weights and an `Embedding(mask_zero=True)` mask in metrics, weighted
    metrics and the loss; 525 rows end ragged. Before: the (rows,) padding mask multiplied the
    token axis (weighted accuracy 0.41233 vs 0.40855 at 4 rows per replica), a broadcasting
    crash at 5, and evaluate with "accuracy" crashed `(4,) vs (4, 7)`."""
    expected = plain["per_token"][str(batch)]
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = per_token()
    labels = TOKENS % 3
    options = {"batch_size": batch, "verbose": 0}
    evaluation = model.evaluate(TOKENS, labels, **options, return_dict=True)
    history = model.fit(
        TOKENS, labels, sample_weight=TOKEN_WEIGHTS, epochs=2, shuffle=False, **options
    ).history
    weighted = model.evaluate(
        TOKENS, labels, sample_weight=TOKEN_WEIGHTS, **options, return_dict=True
    )
    for ours, theirs in zip(model.get_weights(), expected["weights"], strict=True):
        np.testing.assert_allclose(ours, np.asarray(theirs), atol=2e-5)
    for name, values in expected["history"].items():
        assert history[name] == pytest.approx(values, abs=2e-5), name
    for got, want in ((evaluation, expected["evaluate"]), (weighted, expected["weighted"])):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, abs=2e-5), name


def test_a_step_that_fails_leaves_the_model_usable(devices):
    """Keras' loops detach the variables for the epoch; an error inside mirrored's step (here
    a metric that refuses the replica's 4 rows) left every variable reading as None, so the
    model was broken after a failed evaluate. Now the step's inputs are put back."""

    def picky(y_true, y_pred):
        if y_pred.shape[0] == 4:  # a replica's share of 32 rows over 8 replicas
            raise ValueError("picky: 4 rows")
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)

    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = whole_batch("dice")
    before = model.get_weights()
    model.compile(optimizer="sgd", loss="mse", metrics=[picky])
    for call in (model.evaluate, model.fit):
        with pytest.raises(ValueError, match="picky"):
            call(X[:64], BINARY[:64], batch_size=32, verbose=0)
        for ours, theirs in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(ours, theirs)
    model.compile(optimizer="sgd", loss="mse")
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])  # metrics=None keeps picky


# -- every Keras loss and metric (item 12) ------------------------------------------------------

# Losses that cannot match one device, and why (asserted: they do differ).
HUNT_CANNOT_MATCH = {
    # Each example's term is computed against the other examples of the batch (pairs): per
    # example in shape, yet each replica sees only its own rows' pairs.
    "sparse/Circle": "pairwise over the batch: each replica pairs only its own rows",
}


def _hunt_loss_on_replicas(strategy, loss, labels, predictions, weights):
    dataset = strategy.experimental_distribute_dataset(
        (labels, predictions, weights), batch_size=len(labels)
    )
    ((y, p, w),) = list(dataset)

    def step(y, p, w):
        return loss(y, p), loss(y, p, sample_weight=w)

    plain, weighted = strategy.run(step, args=(y, p, w))
    return [float(strategy.reduce("SUM", v, axis=None)) for v in (plain, weighted)]


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # Keras' Circle loss
def test_every_keras_loss_and_metric_equals_one_device_on_a_ragged_batch(plain, devices):
    """Every class of keras.losses and keras.metrics (but CTC, and Mean / Sum /
    MeanMetricWrapper, which are not (y_true, y_pred) objectives), and the names `compile`
    takes: losses called inside `run` on a global batch of 37 (5 rows per replica, 3 padded),
    with and without sample weights; metrics compiled by object and by string, evaluated at
    batch 16 (a ragged 5 last), 8 replicas against plain Keras on one device."""
    import keras

    from _keras_models import (
        HUNT_DATA,
        HUNT_LEFT_OUT,
        HUNT_LOSS_STRINGS,
        HUNT_LOSSES,
        HUNT_METRICS,
        HUNT_WEIGHTS,
        HUNT_X,
        hunt_compiled,
        hunt_loss,
    )

    covered = {n for names in HUNT_LOSSES.values() for n in names}
    covered |= {n for pairs in HUNT_METRICS.values() for n, _ in pairs}
    every = {
        name
        for module, base in ((keras.losses, keras.losses.Loss), (keras.metrics, keras.Metric))
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, base) and value is not base
    }
    assert every - covered == set(HUNT_LEFT_OUT), "a Keras class neither tested nor listed"
    expected = plain["hunt"]
    strategy = mirrored.MirroredStrategy(devices)
    mismatched = {}
    for family, (labels, predictions, _, _) in HUNT_DATA.items():
        for name in HUNT_LOSSES[family] + HUNT_LOSS_STRINGS[family]:
            key = f"{family}/{name}"
            ours = _hunt_loss_on_replicas(
                strategy, hunt_loss(name), labels, predictions, HUNT_WEIGHTS
            )
            theirs = expected["losses"][key]
            if ours != pytest.approx(theirs, rel=2e-5, abs=1e-6):
                mismatched[key] = (ours, theirs)
        for kind in ("objects", "strings"):
            with strategy.scope():
                model = hunt_compiled(family, kind)
            logs = model.evaluate(HUNT_X, labels, batch_size=16, verbose=0, return_dict=True)
            theirs = expected["metrics"][f"{family}/{kind}"]
            assert logs.keys() == theirs.keys()
            for metric, value in theirs.items():
                if logs[metric] != pytest.approx(value, rel=2e-5, abs=1e-6):
                    mismatched[f"{family}/{kind}/{metric}"] = (logs[metric], value)
    assert set(mismatched) == set(HUNT_CANNOT_MATCH), mismatched


# -- Keras loss and metric objects given to mirrored.Trainer -------------------------------------


class _Outputs(nnx.Module):
    """A model whose outputs are its inputs: a loss or metric sees the test's predictions."""

    def __init__(self):
        self.unused = nnx.Param(jnp.zeros(()))

    def __call__(self, x):
        return x + self.unused


_TRAINER_LOSS = {
    "regression": "mse",
    "binary": "binary_crossentropy",
    "categorical": "categorical_crossentropy",
    "sparse": "sparse_categorical_crossentropy",
}


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # Keras' Circle loss
def test_keras_loss_objects_in_the_trainer_equal_keras(plain, devices):
    """Every keras.losses class as `Trainer(loss=...)`: evaluate on one ragged global batch of
    37 (8 replicas, 3 rows padded), with and without sample weights, gives Keras' call on
    the 37 rows. Before: a weighted loss was Keras' unweighted mean times the mean weight,
    and `reduction='sum'` or `ignore_class` gave other numbers, silently."""
    from _keras_models import HUNT_DATA, HUNT_LOSSES, HUNT_WEIGHTS

    strategy = mirrored.MirroredStrategy(devices)
    mismatched = {}
    for family, (labels, predictions, _, _) in HUNT_DATA.items():
        for name in HUNT_LOSSES[family]:
            with strategy.scope():
                trainer = mirrored.Trainer(
                    _Outputs(), optax.sgd(0.1), loss=getattr(keras.losses, name)()
                )
            options = {"batch_size": len(labels), "verbose": 0}
            ours = [
                trainer.evaluate(predictions, labels, **options)["loss"],
                trainer.evaluate(predictions, labels, sample_weight=HUNT_WEIGHTS, **options)[
                    "loss"
                ],
            ]
            theirs = plain["hunt"]["losses"][f"{family}/{name}"]
            if ours != pytest.approx(theirs, rel=2e-5, abs=1e-6):
                mismatched[f"{family}/{name}"] = (ours, theirs)
    assert set(mismatched) == set(HUNT_CANNOT_MATCH), mismatched


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # Keras' IoU metrics
@pytest.mark.filterwarnings("ignore:You are passing weight as `float`")  # IoU, weighted
def test_keras_metric_objects_in_the_trainer_equal_keras(plain, devices):
    """Every keras.metrics class as `Trainer(metrics=[...])` and `weighted_metrics=[...]`:
    evaluate at batch 16 (16, 16 and a ragged 5 over 8 replicas) gives Keras' result after
    the same updates, per-class arrays (F1Score) included. Before: UnexpectedTracerError (the
    Keras object's own variables were updated inside the step)."""
    from _keras_models import HUNT_DATA, HUNT_METRICS, HUNT_WEIGHTS

    strategy = mirrored.MirroredStrategy(devices)
    mismatched = {}
    for family, (labels, predictions, _, _) in HUNT_DATA.items():
        for weighted in (False, True):
            objects = [getattr(keras.metrics, n)(**o) for n, o in HUNT_METRICS[family]]
            kind = "weighted_metrics" if weighted else "metrics"
            with strategy.scope():
                trainer = mirrored.Trainer(
                    _Outputs(), optax.sgd(0.1), loss=_TRAINER_LOSS[family], **{kind: objects}
                )
            logs = trainer.evaluate(
                predictions,
                labels,
                sample_weight=HUNT_WEIGHTS if weighted else None,
                batch_size=16,
                verbose=0,
            )
            for (name, _), metric in zip(HUNT_METRICS[family], objects, strict=True):
                theirs = plain["hunt"]["updated"][f"{family}/{name}"][int(weighted)]
                if not np.allclose(logs[metric.name], theirs, rtol=2e-5, atol=1e-6):
                    mismatched[f"{family}/{name}/{kind}"] = (logs[metric.name], theirs)
    assert not mismatched


def _keras_fit(loss, metric, devices, x, y, w):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        trainer = mirrored.Trainer(_Small(nnx.Rngs(3)), optax.sgd(0.5), loss=loss, metrics=[metric])
    options = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    history = trainer.fit(x, y, sample_weight=w, **options).history
    return nnx.state(trainer.model, nnx.Param), history


class _Small(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.out = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


@pytest.mark.parametrize(
    "ignore_class, ours",
    [(None, False), (2, False), (2, True)],
    ids=["keras", "keras-ignore-class", "mirrored-ignore-class"],
)
def test_fit_with_a_keras_loss_and_metric_equals_one_device_without_mirrored(
    devices, ignore_class, ours
):
    """`fit` with a Keras loss object (weighted, `ignore_class`: a masked mean of the batch),
    or mirrored's with `ignore_class`, and a stateful Keras metric, 50 rows at batch 16 (a
    ragged 2 last), 8 replicas: the weights and the history of a plain NNX loop on one device
    calling the Keras loss."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(50, 6)).astype(np.float32)
    y = rng.integers(0, 5, 50).astype(np.int32)
    w = rng.uniform(0.2, 2.0, 50).astype(np.float32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore_class)
    given = mirrored.losses.SparseCategoricalCrossentropy(True, ignore_class) if ours else loss
    params, history = _keras_fit(
        given, keras.metrics.SparseTopKCategoricalAccuracy(k=2), devices, x, y, w
    )

    model = _Small(nnx.Rngs(3))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    step = nnx.jit(
        lambda model, optimizer, x, y, w: optimizer.update(
            model, nnx.grad(lambda m: loss(y, m(x), sample_weight=w))(model)
        )
    )
    losses = []
    for _ in range(2):
        total = 0.0
        for start in range(0, 50, 16):
            rows = slice(start, start + 16)
            total += float(loss(y[rows], model(x[rows]), sample_weight=w[rows])) * len(y[rows])
            step(model, optimizer, x[rows], y[rows], w[rows])
        losses.append(total / 50)
    assert history["loss"] == pytest.approx(losses, rel=1e-5)
    expected = nnx.state(model, nnx.Param)
    for ours, theirs in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-6)


def test_keras_loss_objects_are_checked_as_keras_names_are(caplog):
    """A reduction that gives no number is refused; a Keras crossentropy of probabilities
    fed logits warns; sparse labels outside the classes are refused; "accuracy" under a
    `from_logits=True` Keras loss thresholds the logits at 0."""
    with pytest.raises(ValueError, match="reduce each batch to one number.*reduction='none'"):
        mirrored.Trainer(
            _Small(nnx.Rngs(0)),
            optax.sgd(0.1),
            loss=keras.losses.MeanSquaredError(reduction="none"),
        )
    x = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32) * 10
    y = np.arange(20, dtype=np.int32) % 5
    trainer = mirrored.Trainer(
        _Small(nnx.Rngs(0)), optax.sgd(0.1), loss=keras.losses.SparseCategoricalCrossentropy()
    )
    with caplog.at_level("WARNING", logger="mirrored"):
        trainer.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert "look like logits" in caplog.text
    with pytest.raises(ValueError, match=r"class labels in \[0, 5\).*found label 7"):
        trainer.fit(x, np.where(y == 4, 7, y), batch_size=10, epochs=1, verbose=0)
    binary = mirrored.Trainer(
        _Outputs(),
        optax.sgd(0.1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    logits = np.array([[-2.0], [-0.5], [0.3], [4.0]], np.float32)
    labels = np.array([[0.0], [1.0], [1.0], [1.0]], np.float32)
    assert binary.evaluate(logits, labels, verbose=0)["accuracy"] == 0.75


def _mirrored_and_keras_losses():
    m, k = mirrored.losses, keras.losses
    return [
        (
            m.SparseCategoricalCrossentropy(True, 1),
            k.SparseCategoricalCrossentropy(True, 1),
            "sparse",
        ),
        (m.CategoricalCrossentropy(True, 0.2), k.CategoricalCrossentropy(True, 0.2), "one_hot"),
        (
            m.CategoricalCrossentropy(label_smoothing=0.2),
            k.CategoricalCrossentropy(label_smoothing=0.2),
            "probabilities",
        ),
        (
            m.CategoricalCrossentropy(True, axis=1),
            k.CategoricalCrossentropy(True, axis=1),
            "channels_first",
        ),
        (
            m.BinaryCrossentropy(label_smoothing=0.1),
            k.BinaryCrossentropy(label_smoothing=0.1),
            "binary",
        ),
        (m.BinaryCrossentropy(True, 0.1), k.BinaryCrossentropy(True, 0.1), "binary_logits"),
    ]


@pytest.mark.parametrize("replicas", [8, 1])
def test_mirrored_losses_take_keras_arguments(devices, replicas):
    """`label_smoothing`, `axis` and `ignore_class`, `from_logits` positional as in Keras:
    evaluate on a ragged global batch of 37, with and without sample weights, gives Keras'
    loss object on the 37 rows."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=(37, 4)).astype(np.float32)
    classes = rng.integers(0, 4, 37)
    data = {
        "sparse": (classes.astype(np.int32), logits),
        "one_hot": (np.eye(4, dtype=np.float32)[classes], logits),
        "probabilities": (np.eye(4, dtype=np.float32)[classes], np.asarray(jax.nn.softmax(logits))),
        "channels_first": (
            np.eye(4, dtype=np.float32)[rng.integers(0, 4, (37, 3))].transpose(0, 2, 1),
            rng.normal(size=(37, 4, 3)).astype(np.float32),
        ),
        "binary": (
            (logits > 0).astype(np.float32),
            rng.uniform(0.05, 0.95, (37, 4)).astype(np.float32),
        ),
        "binary_logits": ((rng.random((37, 4)) < 0.5).astype(np.float32), logits),
    }
    row_weights = rng.uniform(0.2, 2.0, 37).astype(np.float32)
    strategy = mirrored.MirroredStrategy(devices[:replicas])
    for ours, theirs, kind in _mirrored_and_keras_losses():
        labels, predictions = data[kind]
        # Keras pairs (n,) weights with (n, 3) per-position losses only as (n, 1)
        weights = row_weights[:, None] if kind == "channels_first" else row_weights
        with strategy.scope():
            trainer = mirrored.Trainer(_Outputs(), optax.sgd(0.1), loss=ours)
        options = {"batch_size": 37, "verbose": 0}
        got = [
            trainer.evaluate(predictions, labels, **options)["loss"],
            trainer.evaluate(predictions, labels, sample_weight=weights, **options)["loss"],
        ]
        expected = [
            float(theirs(labels, predictions)),
            float(theirs(labels, predictions, sample_weight=weights)),
        ]
        assert got == pytest.approx(expected, rel=2e-5), (ours, kind)


def test_mirrored_loss_arguments_out_of_range_are_clear_errors():
    cases = [
        (lambda: mirrored.losses.BinaryCrossentropy(label_smoothing=1.5), "label_smoothing"),
        (lambda: mirrored.losses.CategoricalCrossentropy(axis=1.0), "axis"),
        (lambda: mirrored.losses.SparseCategoricalCrossentropy(ignore_class="pad"), "ignore_class"),
        (
            lambda: mirrored.losses.MeanSquaredError(reduction="sum"),
            "keras.losses.MeanSquaredError",
        ),
    ]
    for make, word in cases:
        with pytest.raises(ValueError, match="Expected.*Fix") as error:
            make()
        assert word in str(error.value)


class _TruePositives(keras.metrics.Metric):
    """Keras' own docstring example: `result()` returns the variable itself."""

    def __init__(self, name="true_positives_here", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), initializer="zeros", name="tp")

    def update_state(self, y_true, y_pred, sample_weight=None):
        values = keras.ops.cast((y_true > 0.5) & (y_pred > 0.5), "float32")[..., 0]
        if sample_weight is not None:
            values = values * keras.ops.cast(sample_weight, "float32")
        self.true_positives.assign(self.true_positives + keras.ops.sum(values))

    def result(self):
        return self.true_positives


class _Both(_TruePositives):
    """A result of several values: a dict, merged into the logs as Keras does."""

    def __init__(self):
        super().__init__(name="both")

    def result(self):
        return {"tp": self.true_positives, "tp_half": self.true_positives / 2}


class _ScaledError(keras.metrics.MeanMetricWrapper):
    """A MeanMetricWrapper whose own update_state scales the inputs: the override counts."""

    def __init__(self):
        super().__init__(keras.metrics.mean_absolute_error, name="scaled_error")

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(10.0 * y_true, 10.0 * y_pred, sample_weight)


def test_keras_metric_objects_of_their_own_in_the_trainer(devices):
    """Found by a review: a `result()` returning its variable read 0, a dict result crashed,
    a MeanMetricWrapper subclass's own update_state was ignored (10x off); 53 rows at batch 8
    on 8 replicas against the Keras objects updated on the host."""
    rng = np.random.default_rng(2)
    predictions = rng.uniform(size=(53, 1)).astype(np.float32)
    labels = (rng.random((53, 1)) < 0.5).astype(np.float32)
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        trainer = mirrored.Trainer(
            _Outputs(),
            optax.sgd(0.1),
            loss="mse",
            metrics=[_TruePositives(), _Both(), _ScaledError()],
        )
    logs = trainer.evaluate(predictions, labels, batch_size=8, verbose=0)
    positives = float(np.sum((labels > 0.5) & (predictions > 0.5)))
    assert positives > 0
    assert logs["true_positives_here"] == positives
    assert (logs["tp"], logs["tp_half"]) == (positives, positives / 2)
    scaled = _ScaledError()
    for start in range(0, 53, 8):
        scaled.update_state(labels[start : start + 8], predictions[start : start + 8])
    assert logs["scaled_error"] == pytest.approx(float(scaled.result()), rel=1e-6)


def test_keras_objects_the_trainer_cannot_take_are_clear_errors():
    class Unweighted(keras.metrics.Metric):
        def update_state(self, y_true, y_pred):
            pass

        def result(self):
            return 0.0

    for metric, words in [
        (keras.metrics.Mean(), ["(y_true, y_pred)", "'values'", "MeanMetricWrapper"]),
        (Unweighted(), ["sample_weight", "padded rows", "Fix: add sample_weight=None"]),
    ]:
        with pytest.raises(ValueError) as error:
            mirrored.Trainer(_Outputs(), optax.sgd(0.1), loss="mse", metrics=[metric])
        for word in words:
            assert word in str(error.value)


def test_a_masked_keras_loss_divided_by_the_weights_sum_equals_keras(devices):
    """`ignore_class` with `reduction='mean_with_sample_weight'`: Keras divides by the
    weights of the counted labels only (was 0.904 for Keras' 1.307, found by a review)."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(37, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 37).astype(np.int32)
    weights = rng.uniform(0.2, 2.0, 37).astype(np.float32)
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=1, reduction="mean_with_sample_weight"
    )
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        trainer = mirrored.Trainer(_Outputs(), optax.sgd(0.1), loss=loss)
    got = trainer.evaluate(logits, labels, sample_weight=weights, batch_size=37, verbose=0)
    expected = float(loss(labels, logits, sample_weight=weights))
    assert got["loss"] == pytest.approx(expected, rel=2e-5)


class _StopAtBatch4(mirrored.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 4:
            raise RuntimeError("interrupted at batch 4")


def test_a_keras_metric_sized_by_the_data_resumes_and_verifies(devices, tmp_path):
    """Found by a review: a fresh F1Score resumed by BackupAndRestore mid-epoch dropped its
    saved sums (it has none until built), and `Trainer.verify` leaked MetricNotBuilt; verify
    also failed its single-device check with any stateful metric (the Trainer's tuple of
    metrics was not copied to the one device)."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(53, 6)).astype(np.float32)
    y = np.eye(5, dtype=np.float32)[rng.integers(0, 5, 53)]
    strategy = mirrored.MirroredStrategy(devices)

    def trainer():
        with strategy.scope():
            return mirrored.Trainer(
                _Small(nnx.Rngs(1)),
                optax.sgd(0.1),
                loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.F1Score(name="f1"), mirrored.metrics.AUC(from_logits=True)],
            )

    options = {"batch_size": 8, "epochs": 2, "shuffle": False, "verbose": 0}
    full = trainer().fit(x, y, **options).history
    backup = mirrored.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    with pytest.raises(RuntimeError, match="batch 4"):
        trainer().fit(x, y, callbacks=[backup, _StopAtBatch4()], **options)
    backup = mirrored.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    resumed = trainer().fit(x, y, callbacks=[backup], **options).history
    for name in ("loss", "f1", "auc"):
        np.testing.assert_allclose(np.asarray(resumed[name]), np.asarray(full[name]), rtol=1e-5)
    report = trainer().verify(x, y, batch_size=16)
    assert report.ok, report


class _PerPosition(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.dense(x)


@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64")  # Keras' IoU metrics
def test_keras_metrics_that_count_labels_or_flatten_them_equal_keras(devices):
    """Found by a review: `R2Score(num_regressors=2)` counted a padded batch's padded rows
    (−1.7332 for Keras' −1.7351), and a segmentation MeanIoU (labels (n, 5)) crashed on the
    (n,) mask of real rows. 53 rows at batch 8 on 8 replicas, against Keras on the host."""
    rng = np.random.default_rng(11)
    strategy = mirrored.MirroredStrategy(devices)
    x = rng.normal(size=(53, 3)).astype(np.float32)
    y = (x @ rng.normal(size=(3, 3)) + rng.normal(size=(53, 3))).astype(np.float32)
    maps = rng.normal(size=(53, 5, 4)).astype(np.float32)
    classes = rng.integers(0, 3, (53, 5)).astype(np.int32)
    cases = [
        (_Outputs, "mse", lambda: keras.metrics.R2Score(num_regressors=2), x, y),
        (
            _PerPosition,
            mirrored.losses.SparseCategoricalCrossentropy(True),
            lambda: keras.metrics.MeanIoU(3, sparse_y_pred=False),
            maps,
            classes,
        ),
    ]
    for make, loss, metric, inputs, labels in cases:
        with strategy.scope():
            model = make()
            trainer = mirrored.Trainer(model, optax.sgd(0.1), loss=loss, metrics=[metric()])
        logs = trainer.evaluate(inputs, labels, batch_size=8, verbose=0)
        theirs = metric()
        outputs = np.asarray(nnx.jit(lambda m, v: m(v))(model, inputs))
        for start in range(0, 53, 8):
            theirs.update_state(labels[start : start + 8], outputs[start : start + 8])
        (value,) = [v for k, v in logs.items() if k != "loss"]
        assert value == pytest.approx(float(theirs.result()), rel=1e-5), type(theirs).__name__
