"""`Trainer(steps_per_execution="auto")`, the default (issue 39): `fit` times its first steps
and, when nothing reads every batch and the steps left pay for one more program, runs K steps
per program; the same batches, masks and numbers as one step per program."""

import logging

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import adam_trainer, params_of
from mirrored._train import auto_steps
from mirrored.callbacks import Callback

ROWS = 1003  # batch 16: 63 steps an epoch, the last of 11 rows (ragged on 8 replicas)
_rng = np.random.default_rng(3)
X = _rng.normal(size=(ROWS, 12)).astype(np.float32)
Y = _rng.integers(0, 4, ROWS).astype(np.int32)
W = _rng.uniform(0.2, 2.0, ROWS).astype(np.float32)


@pytest.fixture
def always_worth_it(monkeypatch):
    """Any fit long enough to measure is long enough to pay for the K-step program, and the
    K-step execution is never timed slower than a step alone (a loaded machine made it so once,
    and the rest of that fit went back to one step per program)."""
    monkeypatch.setattr(auto_steps, "PAYBACK", 0)
    monkeypatch.setattr(auto_steps, "SLOWER", float("inf"))


class BatchRecorder(Callback):
    def __init__(self):
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def _fit(trainer, **options):
    return _fit_on(trainer, x=X, y=Y, **options)


def _fit_on(trainer, x, y, **options):
    options = {"sample_weight": W, "batch_size": 16, "epochs": 2, "verbose": 0, **options}
    return trainer.fit(x, y, validation_data=(X[:40], Y[:40]), **options).history


def _assert_same_logs(auto, one):
    """The logs: the same sums, added in another order over an execution's steps."""
    assert auto.keys() == one.keys()
    for key, values in auto.items():
        np.testing.assert_allclose(values, one[key], rtol=1e-6, err_msg=key)


def _assert_same(auto, one):
    expected = params_of(one.model)
    for name, value in params_of(auto.model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize("replicas", [8, 1])
def test_auto_runs_k_steps_a_program_with_the_numbers_of_one_step_a_program(
    replicas, always_worth_it, caplog, monkeypatch
):
    """Ragged last batch (run one batch a chunk), sample weights, validation, a second fit
    reusing the measured step (chunks from the epoch's start), 1 and 8 replicas."""
    auto, one = adam_trainer(replicas), adam_trainer(replicas, steps_per_execution=1)
    with caplog.at_level(logging.INFO, logger="mirrored"):
        logs = _fit(auto)
    _assert_same_logs(logs, _fit(one))
    (measured,) = auto._auto_measured.values()
    assert measured.built > 1 and measured.checked and measured.step_s > 0
    assert f"fit: {measured.built} steps per program (steps_per_execution='auto'" in caplog.text
    _assert_same(auto, one)
    asked = []  # a fit under MIN_STEPS still runs the K-step program built already
    epoch_batches = auto_steps._epoch_batches
    monkeypatch.setattr(
        auto_steps, "_epoch_batches", lambda *a: asked.append(a[3]) or epoch_batches(*a)
    )
    short = _fit(auto, epochs=1, verbose=1)  # the progress bar too
    assert asked == [measured.built, 0]  # and its validation (3 steps) one at a time
    _assert_same_logs(short, _fit(one, epochs=1))
    _assert_same(auto, one)


def test_auto_keeps_one_step_a_program_for_a_callback_that_reads_every_batch(always_worth_it):
    recorder = BatchRecorder()
    trainer = adam_trainer(8)
    _fit(trainer, callbacks=[recorder])
    assert recorder.ends == list(range(63)) * 2  # every batch, as Keras' default
    assert trainer._auto_measured == {}  # nothing measured: one step a program


def test_auto_leaves_short_fits_and_an_explicit_one_alone(always_worth_it):
    short = adam_trainer(8)
    short.fit(X[:160], Y[:160], batch_size=16, epochs=2, verbose=0)
    assert short._auto_measured == {}  # 20 steps: under MIN_STEPS, not measured
    explicit = adam_trainer(8, steps_per_execution=1)
    _fit(explicit)
    assert explicit._auto_measured == {}


def test_choose_pays_for_the_program_only_when_the_steps_left_do():
    fast = auto_steps.Measured(step_s=0.001, compile_s=0.5)
    assert auto_steps.choose(fast, 10_000, epoch_steps=200) == 28  # 7 x 28, 4 left
    assert auto_steps.choose(fast, 10_000, epoch_steps=64) == 32
    assert auto_steps.choose(fast, 10_000, epoch_steps=20) == 20  # one execution an epoch
    assert auto_steps.choose(fast, 1_999, epoch_steps=200) == 1  # 2 s left < 4 x 0.5 s
    assert auto_steps.choose(fast, 2_000, epoch_steps=200) == 28  # 2 s: pays at a 25% gain
    slow = auto_steps.Measured(step_s=0.3, compile_s=0.0)
    assert auto_steps.choose(slow, 10_000, epoch_steps=20) == 5  # room for 6 (2 s): 4 x 5
    assert auto_steps.choose(auto_steps.Measured(1.5, 0.0), 10_000, 20) == 1  # 2 steps: 3 s
    built = auto_steps.Measured(step_s=0.001, compile_s=9.0, built=16)
    assert auto_steps.choose(built, steps_left=5, epoch_steps=200) == 16  # nothing to pay
    assert auto_steps.choose(built, steps_left=5, epoch_steps=10) == 1  # too long, not paid


def test_steps_per_execution_names_auto_in_its_error():
    with pytest.raises(ValueError, match=r"or 'auto'; found 'fast'.*leave it unset"):
        adam_trainer(1, steps_per_execution="fast")


@pytest.mark.parametrize("rows", [ROWS, 320])  # epochs of 63 steps; of 20, one execution
def test_auto_goes_back_to_one_step_a_program_when_k_steps_time_slower(
    rows, always_worth_it, monkeypatch, caplog
):
    """The K-step execution after the one that built the program is timed against a step
    alone (here any time counts as slower): the rest of the fit, and later fits, run one step
    per program; the same numbers."""
    monkeypatch.setattr(auto_steps, "SLOWER", 0.0)
    auto, one = adam_trainer(8), adam_trainer(8, steps_per_execution=1)
    options = {"x": X[:rows], "y": Y[:rows], "sample_weight": W[:rows], "epochs": 4}
    with caplog.at_level(logging.INFO, logger="mirrored"):
        logs = _fit_on(auto, **options)
    _assert_same_logs(logs, _fit_on(one, **options))
    (measured,) = auto._auto_measured.values()
    assert (measured.slower, measured.checked) == (True, True)
    assert "fit: one step per program after all" in caplog.text
    _assert_same(auto, one)
    assert auto_steps.choose(measured, steps_left=10**6, epoch_steps=63) == 1


def test_auto_reads_the_next_epoch_ahead_and_rechooses_for_shorter_epochs(
    always_worth_it, monkeypatch
):
    """The next epoch's chunks are asked for before this epoch's end is logged; a later fit
    of epochs shorter than the K built chooses a K that fits them (the same numbers); a list
    of sample weights is measured as an array."""
    from mirrored._data.input import DistributedDataset

    events = []
    chunks = DistributedDataset.epoch_chunks

    def recorded(self, epoch, steps, *, skip=0, whole=False):
        events.append(("chunks", epoch, steps))
        return chunks(self, epoch, steps, skip=skip, whole=whole)

    class Ends(Callback):
        def on_epoch_end(self, epoch, logs=None):
            events.append(("end", epoch + 1))

    monkeypatch.setattr(DistributedDataset, "epoch_chunks", recorded)
    auto, one = adam_trainer(8), adam_trainer(8, steps_per_execution=1)
    _fit(auto, epochs=3, callbacks=[Ends()])
    k = auto._auto_measured[next(iter(auto._auto_measured))].built
    assert events == [
        ("chunks", 1, k),
        ("chunks", 2, k),
        ("end", 1),
        ("chunks", 3, k),
        ("end", 2),
        ("end", 3),
    ]
    _fit(one, epochs=3)
    events.clear()
    short = {"x": X[:320], "y": Y[:320], "sample_weight": list(W[:320]), "epochs": 2}
    _assert_same_logs(_fit_on(auto, **short), _fit_on(one, **short))
    assert ("chunks", 1, 20) in events  # 20-step epochs: one execution each
    _assert_same(auto, one)


class Noisy(nnx.Module):
    """BatchNorm's statistics and call-time Dropout draws: state a K-step program carries."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(12, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.out = nnx.Linear(16, 5, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x))), rngs=rngs))


def test_auto_carries_dropout_draws_and_batch_statistics_as_one_step_a_program(always_worth_it):
    def trained(steps_per_execution):
        strategy = mirrored.MirroredStrategy(jax.devices()[:8])
        with strategy.scope():
            trainer = mirrored.Trainer(
                Noisy(nnx.Rngs(0)),
                optax.adam(0.01),
                "sparse_categorical_crossentropy",
                from_logits=True,
                rngs=nnx.Rngs(dropout=1),
                steps_per_execution=steps_per_execution,
            )
        trainer.fit(X, Y, batch_size=16, epochs=2, verbose=0)
        assert bool(trainer._auto_measured) == (steps_per_execution == "auto")
        state = nnx.state((trainer.model, trainer.rngs))
        return [
            np.asarray(
                jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
            )
            for a in jax.tree.leaves(state)
        ]

    for auto, one in zip(trained("auto"), trained(1), strict=True):
        np.testing.assert_array_equal(auto, one)


def test_auto_over_the_chunk_bytes_reads_one_batch_at_a_time(always_worth_it, monkeypatch):
    """K batches over the chunks' byte limit come one at a time: the same numbers."""
    from mirrored._data import chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1)
    auto, one = adam_trainer(8), adam_trainer(8, steps_per_execution=1)
    _assert_same_logs(_fit(auto, epochs=3), _fit(one, epochs=3))
    _assert_same(auto, one)


def test_backup_and_restore_saving_each_epoch_leaves_auto_on(always_worth_it, tmp_path):
    """Its batch hook does nothing unless it saves every N steps or watches for preemption:
    K steps per program then; with save_freq=N, one step per program (it counts batches)."""
    from mirrored.callbacks import BackupAndRestore

    auto, one = adam_trainer(8), adam_trainer(8, steps_per_execution=1)
    _fit(auto, epochs=3, callbacks=[BackupAndRestore(tmp_path / "a")])
    _fit(one, epochs=3, callbacks=[BackupAndRestore(tmp_path / "b")])
    assert next(iter(auto._auto_measured.values())).built > 1
    _assert_same(auto, one)
    every = adam_trainer(8)
    _fit(every, epochs=3, callbacks=[BackupAndRestore(tmp_path / "c", save_freq=50)])
    assert every._auto_measured == {}


@pytest.mark.parametrize("replicas", [8, 1])
def test_auto_evaluates_k_steps_a_program_with_the_numbers_of_one_step_a_program(
    replicas, always_worth_it, caplog
):
    """evaluate (126 steps of 8, the last of 3 rows: ragged on 8 replicas; sample weights)
    measures its own step and builds its own K-step program; a second evaluate reuses it."""
    auto, one = adam_trainer(replicas), adam_trainer(replicas, steps_per_execution=1)
    with caplog.at_level(logging.INFO, logger="mirrored"):
        passes = [auto.evaluate(X, Y, sample_weight=W, batch_size=8) for _ in range(2)]
    expected = one.evaluate(X, Y, sample_weight=W, batch_size=8)
    for logs in passes:
        assert logs.keys() == expected.keys()
        for key, value in logs.items():
            np.testing.assert_allclose(value, expected[key], rtol=1e-6, err_msg=key)
    (measured,) = auto._auto_measured.values()
    assert measured.built > 1 and measured.checked and not measured.slower
    assert f"evaluate: {measured.built} steps per program (steps_per_execution='auto'" in (
        caplog.text
    )
    assert one._auto_measured == {}


def test_auto_validation_passes_are_measured_as_one_run(always_worth_it):
    """fit's validation (65 steps of 8 a pass, one pass an epoch) builds its K-step program in
    the first pass and runs it in the next; a 20-step training run stays one step a program;
    the val_ logs are one step per program's."""
    options = {"batch_size": 32, "epochs": 2, "verbose": 0, "validation_batch_size": 8}
    data = (X[:516], Y[:516], W[:516])  # 64 batches of 8 and one of 4: ragged on 8 replicas
    auto, one = adam_trainer(8), adam_trainer(8, steps_per_execution=1)
    logs = auto.fit(X[:320], Y[:320], validation_data=data, **options).history
    _assert_same_logs(logs, one.fit(X[:320], Y[:320], validation_data=data, **options).history)
    (measured,) = auto._auto_measured.values()  # validation's alone: training is too short
    assert measured.built > 1 and measured.checked
    _assert_same(auto, one)
