"""A catalogue of bad inputs across the public API (issue 36): each one is a clear error that
says what was expected, what was found and how to fix it, raised before anything changed:
the model's parameters and the optimizer's state are `np.array_equal` before and after.

Cases where Keras itself accepts the input (`epochs=0`, `initial_epoch >= epochs`: nothing is
trained) are Keras' behaviour and listed at the end as such.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from typer.testing import CliRunner

import mirrored
from _helpers import SmallMLP

RNG = np.random.default_rng(0)
X = RNG.normal(size=(40, 12)).astype(np.float32)
Y = RNG.integers(0, 5, 40).astype(np.int32)


class _Other(nnx.Module):  # SmallMLP's names with another width
    def __init__(self, rngs):
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.out = nnx.Linear(16, 5, rngs=rngs)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            optax.adam(1e-2),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
        )
        other = _Other(nnx.Rngs(0))
    trainer.fit(X, Y, batch_size=16, verbose=0)  # an optimizer state that is not all zeros
    mirrored.save_checkpoint(tmp / "ok", trainer.model, trainer.optimizer, step=1)
    mirrored.save_checkpoint(tmp / "model_only", trainer.model, step=1)
    shutil.copytree(tmp / "ok", tmp / "truncated")
    for root, _, files in os.walk(tmp / "truncated"):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 1000:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
    (tmp / "a_file").write_text("not a directory")
    return {"tmp": tmp, "strategy": strategy, "trainer": trainer, "other": other}


def _state(env):
    trainer = env["trainer"]
    return [
        np.array(leaf)
        for leaf in jax.tree.leaves(nnx.state((trainer.model, trainer.optimizer)))
        if hasattr(leaf, "dtype")
    ]


def _metric(kind, **kwargs):
    def make(env):
        with env["strategy"].scope():
            return getattr(mirrored.metrics, kind)(**kwargs)

    return make


def _tf_config(config):
    def resolve(env):
        os.environ["TF_CONFIG"] = config if isinstance(config, str) else json.dumps(config)
        try:
            return mirrored.TFConfigClusterResolver()
        finally:
            del os.environ["TF_CONFIG"]

    return resolve


def _trainer(**kwargs):
    def make(env):
        args = {
            "optimizer": optax.sgd(0.1),
            "loss": "sparse_categorical_crossentropy",
            "metrics": ["accuracy"],
        }
        args.update(kwargs)
        with env["strategy"].scope():
            return mirrored.Trainer(SmallMLP(rngs=nnx.Rngs(0)), **args)

    return make


def _inside_run(env, what):
    """A host operation called inside the step: refused as TensorFlow's cross-replica ones."""
    strategy, path = env["strategy"], _path(env, "inside")
    (batch,) = list(strategy.experimental_distribute_dataset(X[:16], batch_size=16))
    steps = {
        "reduce": lambda model, x: strategy.reduce("SUM", x.sum(), axis=None),
        "gather": lambda model, x: strategy.gather(x, axis=0),
        "save": lambda model, x: mirrored.save_checkpoint(path, model),
    }
    strategy.run(steps[what], args=(env["trainer"].model, batch))


def _keras_loss(**options):
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **options)


def _fit(**kwargs):
    def call(env):
        arguments = {"x": X, "y": Y, "verbose": 0, **kwargs}
        return env["trainer"].fit(**arguments)

    return call


def _checked_fit(**kwargs):
    """fit under check_numerics (switched off again afterwards)."""

    def call(env):
        mirrored.debug.enable_check_numerics()
        try:
            return _fit(**kwargs)(env)
        finally:
            mirrored.debug.disable_check_numerics()

    return call


def _with(array, row, value):
    changed = np.array(array, np.float32)
    changed[row] = value
    return changed


def _path(env, name):
    return str(env["tmp"] / name)


def _inside_another_scope(call):
    with mirrored.OneDeviceStrategy("/cpu:0").scope():
        return call()


def _first_batch(env):
    ((x, _),) = env["strategy"].experimental_distribute_dataset([(X[:8], Y[:8])])
    return x


T, V, F, K, R = TypeError, ValueError, FileNotFoundError, FileExistsError, RuntimeError
CASES = [
    # -- fit: arguments ------------------------------------------------------------------------
    ("fit-y-none", _fit(y=None), V, ["labels y", "y=None"]),
    ("fit-epochs-float", _fit(epochs=2.5), T, ["epochs", "2.5"]),
    ("fit-epochs-negative", _fit(epochs=-1), V, ["epochs", "-1"]),
    ("fit-epochs-str", _fit(epochs="3"), T, ["epochs"]),
    ("fit-initial-epoch-negative", _fit(initial_epoch=-2), V, ["initial_epoch"]),
    ("fit-steps-per-epoch-zero", _fit(steps_per_epoch=0), V, ["steps_per_epoch", "0"]),
    ("fit-steps-per-epoch-negative", _fit(steps_per_epoch=-3), V, ["steps_per_epoch", "-3"]),
    ("fit-steps-per-epoch-float", _fit(steps_per_epoch=2.0), T, ["steps_per_epoch"]),
    ("fit-batch-size-zero", _fit(batch_size=0), V, ["batch_size", "0"]),
    ("fit-batch-size-float", _fit(batch_size=2.5), T, ["batch_size", "2.5"]),
    ("fit-batch-size-negative", _fit(batch_size=-8), V, ["batch_size", "-8"]),
    ("fit-shuffle-str", _fit(shuffle="yes"), T, ["shuffle", "'yes'"]),
    ("fit-verbose-5", _fit(verbose=5), V, ["verbose", "5"]),
    ("fit-verbose-str", _fit(verbose="loud"), V, ["verbose", "'loud'"]),
    ("fit-validation-split-1.5", _fit(validation_split=1.5), V, ["validation_split", "1.5"]),
    ("fit-validation-split-negative", _fit(validation_split=-0.1), V, ["validation_split"]),
    (
        "fit-validation-split-and-data",
        _fit(validation_split=0.1, validation_data=(X, Y)),
        V,
        ["validation_data", "validation_split"],
    ),
    ("fit-validation-data-1-tuple", _fit(validation_data=(X,)), V, ["validation_data", "of 1"]),
    (
        "fit-validation-data-4-tuple",
        _fit(validation_data=(X, Y, np.ones(40), Y)),
        V,
        ["validation_data", "of 4"],
    ),
    (
        "fit-validation-lengths",
        _fit(validation_data=(X, Y[:30])),
        V,
        ["validation_data", "x_val 40", "y_val 30"],
    ),
    (
        "fit-validation-weight-length",
        _fit(validation_data=(X, Y, np.ones(7))),
        V,
        ["val_sample_weight 7"],
    ),
    ("fit-x-none", _fit(x=None), T, ["NoneType"]),
    ("fit-x-list", _fit(x=[[1.0, 2.0]]), T, ["list"]),
    ("fit-lengths", _fit(y=Y[:30]), V, ["[30, 40]"]),
    ("fit-sample-weight-length", _fit(sample_weight=np.ones(30)), V, ["sample_weight", "(30,)"]),
    ("fit-wrong-features", _fit(x=X[:, :11]), V, ["x", "(11,)", "SmallMLP", "dot_general"]),
    ("fit-wrong-rank", _fit(x=X[:, :, None]), V, ["(12, 1)", "SmallMLP"]),
    ("fit-float-labels", _fit(y=Y.astype(np.float32) + 0.5), V, ["class indices", ".5 (float32)"]),
    ("fit-labels-out-of-range", _fit(y=Y + 10), V, ["[0, 5)", "14"]),
    (
        "fit-class-weight-and-sample-weight",
        _fit(class_weight={0: 2.0}, sample_weight=np.ones(40)),
        V,
        ["class_weight", "sample_weight"],
    ),
    ("fit-class-weight-list", _fit(class_weight=[1.0, 2.0]), T, ["class_weight", "dict"]),
    ("fit-class-weight-str-keys", _fit(class_weight={"cat": 2.0}), T, ["class_weight"]),
    ("fit-callbacks-str", _fit(callbacks="csv"), T, ["callbacks", "str"]),
    ("fit-callbacks-object", _fit(callbacks=[object()]), T, ["callbacks", "object"]),
    (
        "fit-csvlogger-missing-folder",
        lambda env: env["trainer"].fit(
            X, Y, verbose=0, callbacks=[mirrored.callbacks.CSVLogger(_path(env, "no/log.csv"))]
        ),
        F,
        ["CSVLogger", "makedirs"],
    ),
    (
        "fit-csvlogger-directory",
        lambda env: env["trainer"].fit(
            X, Y, verbose=0, callbacks=[mirrored.callbacks.CSVLogger(str(env["tmp"]))]
        ),
        IsADirectoryError,
        ["CSVLogger", "directory"],
    ),
    # -- fit: non-finite input (check_numerics, TerminateOnNaN) ---------------------------------
    (
        "fit-nan-input-checked",
        _checked_fit(x=_with(X, 3, np.nan), batch_size=8, shuffle=False),
        mirrored.debug.NonFiniteError,
        ["epoch 1, batch 0", "first in the input x", "replica(s) [3]", "not applied"],
    ),
    (
        "fit-inf-sample-weight-checked",
        _checked_fit(sample_weight=_with(np.ones(40), 0, np.inf), batch_size=8, shuffle=False),
        mirrored.debug.NonFiniteError,
        ["batch 0", "first in the input sample_weight"],
    ),
    (
        "fit-nan-input-terminate-on-nan-raises",
        _fit(x=_with(X, 0, np.nan), callbacks=[mirrored.callbacks.TerminateOnNaN(True)]),
        RuntimeError,
        ["batch 0 of epoch 1", "was not applied", "input x"],
    ),
    # -- evaluate / predict --------------------------------------------------------------------
    ("evaluate-y-none", lambda env: env["trainer"].evaluate(X), V, ["labels y", "evaluate"]),
    (
        "evaluate-batch-size-zero",
        lambda env: env["trainer"].evaluate(X, Y, batch_size=0),
        V,
        ["batch_size"],
    ),
    ("evaluate-verbose-3", lambda env: env["trainer"].evaluate(X, Y, verbose=3), V, ["verbose"]),
    (
        "evaluate-wrong-features",
        lambda env: env["trainer"].evaluate(X[:, :5], Y),
        V,
        ["evaluate", "(5,)"],
    ),
    ("evaluate-lengths", lambda env: env["trainer"].evaluate(X, Y[:9]), V, ["[9, 40]"]),
    (
        "evaluate-sample-weight-without-y",
        lambda env: env["trainer"].evaluate(X, None, sample_weight=np.ones(40)),
        V,
        ["y", "sample_weight"],
    ),
    (
        "predict-batch-size-negative",
        lambda env: env["trainer"].predict(X, batch_size=-1),
        V,
        ["batch_size", "-1"],
    ),
    (
        "predict-wrong-features",
        lambda env: env["trainer"].predict(X[:, :11]),
        V,
        ["predict", "(11,)"],
    ),
    (
        "predict-callbacks-int",
        lambda env: env["trainer"].predict(X, callbacks=3),
        T,
        ["callbacks", "int"],
    ),
    # -- Trainer(...) --------------------------------------------------------------------------
    (
        "trainer-optimizer-unknown-name",
        _trainer(optimizer="adamz"),
        V,
        ["optimizer name", "'adamz'", "adam"],
    ),
    ("trainer-optimizer-int", _trainer(optimizer=42), T, ["optimizer", "42"]),
    ("trainer-metrics-str", _trainer(metrics="accuracy"), T, ["metrics", "['accuracy']"]),
    (
        "trainer-weighted-metrics-str",
        _trainer(weighted_metrics="accuracy"),
        T,
        ["weighted_metrics"],
    ),
    ("trainer-metric-unknown", _trainer(metrics=["acurracy"]), V, ["metric name", "'acurracy'"]),
    ("trainer-loss-unknown", _trainer(loss="nope"), V, ["loss name", "'nope'"]),
    ("trainer-loss-none", _trainer(loss=None), T, ["loss", "None"]),
    (
        "trainer-steps-per-execution-zero",
        _trainer(steps_per_execution=0),
        V,
        ["steps_per_execution"],
    ),
    ("trainer-run-eagerly-str", _trainer(run_eagerly="yes"), T, ["run_eagerly"]),
    (
        "trainer-accumulation-zero",
        _trainer(gradient_accumulation_steps=0),
        V,
        ["gradient_accumulation_steps"],
    ),
    ("trainer-rngs-int", _trainer(rngs=3), T, ["rngs", "nnx.Rngs"]),
    ("trainer-policy-unknown", _trainer(policy="float8"), V, ["policy", "'float8'"]),
    ("trainer-duplicate-metric-names", _trainer(metrics=["accuracy", "accuracy"]), V, ["distinct"]),
    (
        "trainer-keras-loss-reduction-none",
        lambda env: _trainer(loss=_keras_loss(reduction="none"))(env),
        V,
        ["one number", "reduction='none'", "sum_over_batch_size"],
    ),
    # -- callbacks -----------------------------------------------------------------------------
    (
        "modelcheckpoint-empty",
        lambda env: mirrored.callbacks.ModelCheckpoint(""),
        V,
        ["ModelCheckpoint", "''"],
    ),
    (
        "modelcheckpoint-file",
        lambda env: mirrored.callbacks.ModelCheckpoint(_path(env, "a_file")),
        K,
        ["directory", "a_file"],
    ),
    (
        "modelcheckpoint-max-to-keep-zero",
        lambda env: mirrored.callbacks.ModelCheckpoint("c", max_to_keep=0),
        V,
        ["max_to_keep"],
    ),
    ("backup-empty", lambda env: mirrored.callbacks.BackupAndRestore(""), V, ["BackupAndRestore"]),
    (
        "backup-file",
        lambda env: mirrored.callbacks.BackupAndRestore(_path(env, "a_file")),
        V,
        ["a file"],
    ),
    (
        "backup-save-freq-zero",
        lambda env: mirrored.callbacks.BackupAndRestore("b", save_freq=0),
        V,
        ["save_freq"],
    ),
    (
        "backup-save-freq-false",
        lambda env: mirrored.callbacks.BackupAndRestore("b", save_freq=False),
        V,
        ["save_before_preemption"],
    ),
    ("csvlogger-empty", lambda env: mirrored.callbacks.CSVLogger(""), V, ["CSVLogger"]),
    (
        "earlystopping-mode",
        lambda env: mirrored.callbacks.EarlyStopping(mode="bigger"),
        V,
        ["mode", "'bigger'"],
    ),
    (
        "reducelronplateau-factor",
        lambda env: mirrored.callbacks.ReduceLROnPlateau(factor=2.0),
        V,
        ["factor"],
    ),
    # -- checkpoints ---------------------------------------------------------------------------
    (
        "save-step-negative",
        lambda env: mirrored.save_checkpoint(_path(env, "s1"), env["trainer"].model, step=-1),
        V,
        ["step", "-1"],
    ),
    (
        "save-step-str",
        lambda env: mirrored.save_checkpoint(_path(env, "s2"), env["trainer"].model, step="best"),
        V,
        ["step", "'best'"],
    ),
    (
        "save-step-float",
        lambda env: mirrored.save_checkpoint(_path(env, "s3"), env["trainer"].model, step=2.5),
        V,
        ["step", "2.5"],
    ),
    (
        "save-max-to-keep-zero",
        lambda env: mirrored.save_checkpoint(_path(env, "s4"), env["trainer"].model, max_to_keep=0),
        V,
        ["max_to_keep"],
    ),
    (
        "save-extras-object",
        lambda env: mirrored.save_checkpoint(
            _path(env, "s5"), env["trainer"].model, extras={"f": object()}
        ),
        T,
        ["extras['f']"],
    ),
    (
        "restore-another-model",
        lambda env: mirrored.restore_checkpoint(_path(env, "ok"), env["other"]),
        V,
        ["3 of another shape", "model/hidden/bias", "target (16,)"],
    ),
    (
        "restore-model-only-into-optimizer",
        lambda env: mirrored.restore_checkpoint(
            _path(env, "model_only"), env["trainer"].model, env["trainer"].optimizer
        ),
        V,
        ["missing", "optimizer/"],
    ),
    (
        "restore-truncated",
        lambda env: mirrored.restore_checkpoint(
            _path(env, "truncated"), env["trainer"].model, env["trainer"].optimizer
        ),
        V,
        ["checkpoint 1", "truncated", "damaged", "Nothing was restored"],
    ),
    (
        "restore-missing",
        lambda env: mirrored.restore_checkpoint(_path(env, "none"), env["trainer"].model),
        F,
        ["none"],
    ),
    (
        "restore-missing-step",
        lambda env: mirrored.restore_checkpoint(_path(env, "ok"), env["trainer"].model, step=7),
        F,
        ["checkpoint 7", "[1]"],
    ),
    # -- strategy ------------------------------------------------------------------------------
    ("run-not-callable", lambda env: env["strategy"].run(42), T, ["strategy.run(fn)", "int"]),
    ("reduce-inside-run", lambda env: _inside_run(env, "reduce"), R, ["all_reduce('SUM'"]),
    ("gather-inside-run", lambda env: _inside_run(env, "gather"), R, ["all_gather(value, 0)"]),
    ("checkpoint-inside-run", lambda env: _inside_run(env, "save"), R, ["save_checkpoint"]),
    (
        "values-from-function-not-callable",
        lambda env: env["strategy"].experimental_distribute_values_from_function(42),
        T,
        ["value_fn"],
    ),
    (
        "reduce-op-unknown",
        lambda env: env["strategy"].reduce("AVG", 1.0, axis=None),
        V,
        ["'AVG'", "SUM"],
    ),
    (
        "reduce-axis-out-of-range",
        lambda env: env["strategy"].reduce("SUM", _first_batch(env), axis=3),
        V,
        ["axis", "3"],
    ),
    (
        "gather-axis-out-of-range",
        lambda env: env["strategy"].gather(_first_batch(env), axis=5),
        V,
        ["axis", "5"],
    ),
    (
        "gather-per-replica-scalars",
        lambda env: env["strategy"].gather(
            env["strategy"].run(lambda x: jnp.mean(x), args=(_first_batch(env),)), axis=0
        ),
        V,
        ["rank 1 or more", "scalar", "experimental_local_results", "value[None]"],
    ),
    (
        "all-gather-scalars-in-run",
        lambda env: env["strategy"].run(
            lambda x: mirrored.get_replica_context().all_gather(jnp.mean(x), axis=0),
            args=(_first_batch(env),),
        ),
        V,
        ["rank 1 or more", "scalar", "value[None]"],
    ),
    (
        "all-gather-axis-out-of-range",
        lambda env: env["strategy"].run(
            lambda x: mirrored.get_replica_context().all_gather(x, axis=2),
            args=(_first_batch(env),),
        ),
        V,
        ["axis", "[-2, 2)", "found 2"],
    ),
    (
        "run-inside-another-strategys-scope",
        lambda env: _inside_another_scope(
            lambda: env["strategy"].run(lambda x: x * 2, args=(_first_batch(env),))
        ),
        ValueError,  # StrategyMixError: a RuntimeError and a ValueError
        ["strategy.run of MirroredStrategy", "inside the scope of", "leaving"],
    ),
    (
        "reduce-inside-another-strategys-scope",
        lambda env: _inside_another_scope(lambda: env["strategy"].reduce("SUM", 1.0, None)),
        ValueError,
        ["strategy.reduce", "inside the scope of OneDeviceStrategy"],
    ),
    ("strategy-no-devices", lambda env: mirrored.MirroredStrategy([]), V, ["device", "empty"]),
    (
        "strategy-unknown-device",
        lambda env: mirrored.MirroredStrategy(["/gpu:0"]),
        V,
        ["/gpu:0", "/cpu:0"],
    ),
    (
        "distribute-generator-with-batch-size",
        lambda env: env["strategy"].experimental_distribute_dataset(
            ((X[i : i + 8], Y[i : i + 8]) for i in range(0, 16, 8)), batch_size=8
        ),
        V,
        ["generator of batches", "drop batch_size="],
    ),
    (
        "distribute-list-of-batches-with-batch-size",
        lambda env: env["strategy"].experimental_distribute_dataset(
            [(X[:8], Y[:8]), (X[8:16], Y[8:16])], batch_size=8
        ),
        V,
        ["list of batches", "drop batch_size="],
    ),
    (
        "distribute-dataset-int",
        lambda env: env["strategy"].experimental_distribute_dataset(42),
        T,
        ["int", "batch_size"],
    ),
    (
        "distribute-dataset-arrays-without-batch-size",
        lambda env: env["strategy"].experimental_distribute_dataset((X, Y)),
        T,
        ["batch_size"],
    ),
    (
        "distribute-dataset-batch-size-zero",
        lambda env: env["strategy"].experimental_distribute_dataset((X, Y), batch_size=0),
        V,
        ["batch_size", "0"],
    ),
    (
        "distribute-dataset-ragged-leaves",
        lambda env: list(env["strategy"].experimental_distribute_dataset([(X[:8], Y[:7])])),
        V,
        ["[7, 8]"],
    ),
    # -- metrics -------------------------------------------------------------------------------
    (
        "metric-shapes",
        lambda env: _metric("SparseCategoricalAccuracy")(env).update_state(
            np.zeros(4, np.int32), np.zeros((5, 3))
        ),
        V,
        ["y_true of shape (4,)", "y_pred of shape (5, 3)"],
    ),
    (
        "metric-weight-rows",
        lambda env: _metric("Mean")(env).update_state(np.ones(4), sample_weight=np.ones(3)),
        V,
        ["sample_weight of shape (3,)"],
    ),
    (
        "metric-auc-shapes",
        lambda env: _metric("AUC")(env).update_state(np.zeros(6), np.zeros(4)),
        V,
        ["y_true of shape (6,)"],
    ),
    # -- the cluster ---------------------------------------------------------------------------
    (
        "tf-config-worker-string",
        _tf_config(
            {"cluster": {"worker": "localhost:12345"}, "task": {"type": "worker", "index": 0}}
        ),
        V,
        ["cluster.worker", "list"],
    ),
    (
        "tf-config-no-port",
        _tf_config({"cluster": {"worker": ["a", "b:2"]}, "task": {"type": "worker", "index": 0}}),
        V,
        ["'a'", "host:port"],
    ),
    ("tf-config-json", _tf_config("{not json"), V, ["malformed JSON"]),
    (
        "tf-config-index",
        _tf_config({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 5}}),
        V,
        ["index 5", "2 entries"],
    ),
    ("tf-config-no-task", _tf_config({"cluster": {"worker": ["a:1"]}}), V, ["task"]),
    (
        "tf-config-ps",
        _tf_config({"cluster": {"worker": ["a:1"]}, "task": {"type": "ps", "index": 0}}),
        V,
        ["'ps'"],
    ),
    (
        "tf-config-ps-in-cluster",
        _tf_config(
            {"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, "task": {"type": "worker", "index": 0}}
        ),
        V,
        ["['ps']", "parameter servers"],
    ),
    (
        "tf-config-two-chiefs",
        _tf_config({"cluster": {"chief": ["a:1", "b:2"]}, "task": {"type": "chief", "index": 0}}),
        V,
        ["2 entries in cluster.chief"],
    ),
    (
        "tf-config-same-address-twice",
        _tf_config(
            {
                "cluster": {"chief": ["a:1"], "worker": ["b:2", "a:1"]},
                "task": {"type": "worker", "index": 0},
            }
        ),
        V,
        ["['a:1']", "own host:port"],
    ),
    (
        "tf-config-index-negative",
        _tf_config(
            {"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": -1}}
        ),
        V,
        ["index -1"],
    ),
    (
        "termination-grace-negative",
        lambda env: mirrored.TerminationConfig(grace_period=-1),
        V,
        ["grace_period", "-1"],
    ),
    ("termination-exit-fn-int", lambda env: mirrored.TerminationConfig(exit_fn=3), T, ["exit_fn"]),
]


@pytest.mark.parametrize(
    ("make", "error", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_bad_input_is_a_clear_error_and_changes_nothing(env, make, error, words):
    before = _state(env)
    with pytest.raises(error) as raised:
        make(env)
    message = str(raised.value)
    assert "Expected" in message or "expected" in message, message
    assert "found" in message.lower(), message
    assert "Fix" in message or "fix" in message, message
    for word in words:
        assert word in message, (word, message)
    after = _state(env)
    assert len(before) == len(after)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


RUNNER = CliRunner()
CLI = [
    ("launch-grace-negative", ["launch", "-n", "2", "--grace", "-1", "x.py"], "--grace"),
    ("launch-no-such-program", ["launch", "-n", "2", "no_such_program"], "no_such_program"),
    ("launch-no-script", ["launch", "-n", "2"], "expected a script"),
    ("launch-zero-processes", ["launch", "-n", "0", "x.py"], "-n"),
    (
        "launch-max-restarts-negative",
        ["launch", "-n", "1", "--max-restarts", "-1", "x.py"],
        "--max-restarts",
    ),
    ("demo-unknown-loop", ["demo", "--loop", "keras"], "--loop fit"),
    ("demo-learning-rate-zero", ["demo", "--learning-rate", "0"], "--learning-rate > 0"),
    ("doctor-step-no-function", ["doctor", "--step", "train.py"], "FILE.py:FUNCTION"),
    ("doctor-step-missing-file", ["doctor", "--step", "no_such.py:make"], "does not exist"),
    ("doctor-plot-missing-folder", ["doctor", "--plot", "no/such/plot.png"], "--plot"),
    ("doctor-profile-a-file", ["doctor", "--profile", "{file}"], "--profile DIR"),
    ("bench-unknown-model", ["bench", "--models", "resnet"], "'resnet'"),
    ("bench-no-model", ["bench", "--models", ","], "--models"),
    ("bench-plot-a-folder", ["bench", "--plot", "{folder}"], "a folder"),
]


@pytest.mark.parametrize(("argv", "word"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_a_bad_command_line_is_one_message_and_exit_code_2(argv, word, tmp_path):
    """Refused before any work (no device is set up): one line with the fix, exit code 2."""
    from mirrored.cli import app

    (tmp_path / "a_file").write_text("")
    paths = {"file": str(tmp_path / "a_file"), "folder": str(tmp_path)}
    result = RUNNER.invoke(app, [arg.format(**paths) for arg in argv])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert word in result.output, result.output
    if result.output.startswith("error:"):
        assert result.output.count("\n") == 1 and "Fix" in result.output, result.output


def test_what_keras_accepts_is_accepted(env):
    """Keras' behaviour, kept: epochs=0 and initial_epoch >= epochs train nothing (an empty
    History), one callback alone is a list of one, and a Keras optimizer name is its Keras
    defaults."""
    before = _state(env)
    trainer = env["trainer"]
    assert trainer.fit(X, Y, epochs=0, verbose=0).history == {}
    assert trainer.fit(X, Y, initial_epoch=3, epochs=2, verbose=0).history == {}
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(env), strict=True))
    history = trainer.fit(X, Y, epochs=1, verbose=0, callbacks=mirrored.callbacks.History())
    assert len(history.history["loss"]) == 1
    assert len(CASES) + len(CLI) >= 80


def test_the_model_input_check_traces_once_per_call_and_input_shape(env, monkeypatch):
    """Issue 39: the check that x fits the model (a trace of the model on one example, ~5 ms)
    runs once per trainer, kind of call and input shape, not at every fit; an x of another
    shape is still checked, and a wrong feature count is still the clear error."""
    with env["strategy"].scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(1)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            from_logits=True,
        )
    traced = []
    eval_shape = jax.eval_shape

    def counted(function, *args, **kwargs):
        if function.__module__ == "mirrored._train.arguments":  # the check's trace
            traced.append(function)
        return eval_shape(function, *args, **kwargs)

    monkeypatch.setattr(jax, "eval_shape", counted)
    for _ in range(3):
        trainer.fit(X, Y, batch_size=16, verbose=0)
    assert len(traced) == 1
    trainer.evaluate(X, Y, batch_size=16)
    trainer.evaluate(X[:17], Y[:17], batch_size=16)  # fewer examples: the same example shape
    trainer.predict(X, batch_size=16)
    assert len(traced) == 3  # fit, evaluate, predict: once each
    with pytest.raises(ValueError, match=r"found examples of x: \(11,\)"):
        trainer.fit(X[:, :11], Y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"found examples of x: \(11,\)"):
        trainer.fit(X[:, :11], Y, batch_size=16, verbose=0)  # a failed check is not kept
    assert len(traced) == 5


def _fitted(env, optimizer, **fit_kwargs):
    with env["strategy"].scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(1)),
            optimizer,
            "sparse_categorical_crossentropy",
            from_logits=True,
        )
    trainer.fit(X, Y, batch_size=16, verbose=0, shuffle=False, **fit_kwargs)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]


def test_a_keras_optimizer_name_and_class_weight_mean_what_they_mean_in_keras(env):
    """ "adam" is Adam with Keras' defaults (learning rate 1e-3, epsilon 1e-7); class_weight
    weighs each example by its class, 1.0 for classes it leaves out (Keras'
    class_weight_to_sample_weights)."""
    named = _fitted(env, "adam")
    explicit = _fitted(env, optax.adam(1e-3, b1=0.9, b2=0.999, eps=1e-7))
    assert all(np.array_equal(a, b) for a, b in zip(named, explicit, strict=True))
    weights = {0: 2.0, 3: 0.25}
    by_class = _fitted(env, optax.sgd(0.1), class_weight=weights)
    per_example = np.asarray([weights.get(int(label), 1.0) for label in Y], np.float32)
    by_example = _fitted(env, optax.sgd(0.1), sample_weight=per_example)
    assert all(np.array_equal(a, b) for a, b in zip(by_class, by_example, strict=True))
    one_hot = np.eye(5, dtype=np.float32)[Y]
    assert np.array_equal(
        mirrored._train.arguments.class_sample_weights(one_hot, weights, None), per_example
    )


def _sgd_trainer(env, seed, **options):
    """The SmallMLP Trainer (SGD 0.1, sparse cross-entropy of logits) of `env`'s strategy."""
    with env["strategy"].scope():
        return mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(seed)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            from_logits=True,
            **options,
        )


def test_class_weight_weighs_the_training_batches_only_with_validation_split(env):
    """Keras applies class_weight to the training data alone: with validation_split, the
    held-out rows are validated unweighted (val_loss = evaluate on them), and training is
    validation_data's on the same rows (before: the held-out rows carried the class weights,
    val_loss 1.99 for 1.31)."""
    weights = {0: 2.0, 3: 0.25}
    split, given = [
        _sgd_trainer(env, 1, metrics=["accuracy"], weighted_metrics=["accuracy"]) for _ in range(2)
    ]
    kwargs = {"batch_size": 16, "verbose": 0, "shuffle": False, "class_weight": weights}
    by_split = split.fit(X, Y, validation_split=0.25, **kwargs).history
    cut = int(len(X) * 0.75)
    by_data = given.fit(X[:cut], Y[:cut], validation_data=(X[cut:], Y[cut:]), **kwargs).history
    assert by_split == by_data
    held_out = split.evaluate(X[cut:], Y[cut:], batch_size=16)
    assert by_split["val_loss"][-1] == pytest.approx(held_out["loss"], rel=1e-6)
    assert by_split["val_weighted_accuracy"] == by_split["val_accuracy"]


@pytest.mark.parametrize("per_execution", [1, 3])
def test_check_numerics_in_fit_names_the_epoch_and_batch_and_keeps_the_batches_before(
    env, per_execution
):
    """Infinity in the last batch of the data, which with steps_per_epoch=3 of 5 batches is
    batch 1 of epoch 2: the error says so (found a few steps late, the steps after it changed
    nothing), and the model is the one the four batches before it trained."""

    def trainer():
        return _sgd_trainer(env, 2, steps_per_execution=per_execution)

    bad, checked = _with(X, 37, np.inf), trainer()
    mirrored.debug.enable_check_numerics()
    try:
        with pytest.raises(mirrored.debug.NonFiniteError) as raised:
            checked.fit(bad, Y, batch_size=8, epochs=3, steps_per_epoch=3, shuffle=False, verbose=0)
    finally:
        mirrored.debug.disable_check_numerics()
    error = raised.value
    assert (error.epoch, error.batch, error.inputs) == (1, 1, ["x"]), str(error)
    assert "epoch 2, batch 1" in str(error) and "replica(s) [5]" in str(error)
    reference = trainer()
    reference.fit(X[:32], Y[:32], batch_size=8, shuffle=False, verbose=0)
    got = jax.tree.leaves(nnx.state(checked.model, nnx.Param))
    want = jax.tree.leaves(nnx.state(reference.model, nnx.Param))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
