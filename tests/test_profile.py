"""Where the time goes (issue 16): `mirrored.profile`, `TensorBoard(profile_batch=...)` and
`mirrored doctor --profile` trace a few steps with `jax.profiler`, read the trace back with
jaxlib's `ProfileData` and break each step down into compute, collectives, input and idle."""

import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import SmallMLP, global_batches, params_of, train_step
from mirrored._proof import trace

ROOT = Path(__file__).resolve().parents[1]
BATCHES = global_batches(8, 64)
PARTS = ("compute", "collectives", "input", "idle")


def _state(strategy):
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.fixture(scope="module")
def correct(tmp_path_factory):
    """One profile of a correct step on 8 replicas, shared by the tests that read it."""
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy)
    logdir = tmp_path_factory.mktemp("profile")
    report = mirrored.profile(
        strategy, train_step, args=(model, optimizer), data=BATCHES, steps=5, logdir=logdir
    )
    return report, logdir, model


def test_a_correct_step_finds_the_all_reduce_and_a_plausible_breakdown(correct):
    report, logdir, model = correct
    assert report.ok and report.replicas == 8
    assert len(report.steps) == 5
    for step in report.steps:  # per device the four parts are the whole step
        assert step["wall_s"] > 0
        assert sum(step[p] for p in PARTS) == pytest.approx(1.0, abs=1e-6)
        assert all(0 <= step[p] <= 1 for p in PARTS)
    assert report.breakdown["collectives"] > 0 and report.breakdown["compute"] > 0
    (reduce,) = [c for c in report.collectives if c["kind"] == "all-reduce"]
    # The gradients of every parameter, all-reduced once per step (float32).
    weights = sum(v.size for v in params_of(model).values())
    assert reduce["calls_per_step"] == 1 and reduce["bytes"] == 4 * weights
    assert reduce["transfer_s"] > 0 and reduce["bus_bytes_per_s"] > 0
    assert reduce["waiting_for_replicas_s"] + reduce["transfer_s"] == pytest.approx(
        reduce["mean_s"], rel=1e-6
    )
    assert len(report.devices) == 8 and all(0 < f <= 1 for f in report.devices.values())
    assert report["All-reduce in the trace"].status == "PASS"
    assert report["Work per device"].status in ("PASS", "WARN")
    # The trace: TensorBoard's layout, non-empty files for its profile plugin and Perfetto.
    files = sorted((logdir / "plugins" / "profile").glob("*/*"))
    assert any(f.name.endswith(".xplane.pb") and f.stat().st_size > 1000 for f in files)
    perfetto = [f for f in files if f.name.endswith(".trace.json.gz")]
    assert perfetto and json.loads(gzip.decompress(perfetto[0].read_bytes()))
    as_json = json.loads(report.to_json())
    assert as_json["ok"] and set(as_json["breakdown"]) == set(PARTS)
    assert [c["name"] for c in as_json["checks"]] == [
        "All-reduce in the trace",
        "Communication",
        "Input",
        "Work per device",
    ]


def test_the_report_prints_the_breakdown_the_collectives_and_the_verdicts(correct, capsys):
    from rich.console import Console

    correct[0].print(Console(width=120))
    out = capsys.readouterr().out
    for text in ("where the time goes", "all-reduce", "Busy fraction per device", "verdicts"):
        assert text in out
    assert "tensorboard --logdir" in out


def _nosync_step(model, optimizer, x, y):
    """Planted: the loss is computed but the model is never updated from gradients."""
    del optimizer
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_a_step_without_synchronization_is_reported_as_no_all_reduce(tmp_path):
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy)
    report = mirrored.profile(
        strategy, _nosync_step, args=(model, optimizer), data=BATCHES, steps=3, logdir=tmp_path
    )
    check = report["All-reduce in the trace"]
    assert check.status == "FAIL" and not report.ok
    assert "no all-reduce in the trace: gradients are not synchronized" in check.summary
    assert "Fix:" in check.explanation and report.breakdown["collectives"] == 0


def test_one_device_strategy_is_reported_as_no_all_reduce_on_one_device(tmp_path):
    strategy = mirrored.OneDeviceStrategy(jax.devices()[0])
    model, optimizer = _state(strategy)
    report = mirrored.profile(
        strategy, train_step, args=(model, optimizer), data=BATCHES, steps=3, logdir=tmp_path
    )
    check = report["All-reduce in the trace"]
    assert check.status == "WARN"
    assert "no all-reduce in the trace" in check.summary
    assert "OneDeviceStrategy" in check.explanation
    work = report["Work per device"]
    assert work.status == "WARN" and "one device does all the work" in work.summary
    assert list(report.devices) == [str(jax.devices()[0])]


def test_a_slow_input_is_reported_as_input_bound(tmp_path):
    def slow():  # a Python iterable that sleeps: the host cannot keep the devices busy
        for batch in BATCHES:
            time.sleep(0.05)
            yield batch

    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy)
    report = mirrored.profile(
        strategy, train_step, args=(model, optimizer), data=slow(), steps=4, logdir=tmp_path
    )
    check = report["Input"]
    assert check.status == "WARN" and "waiting for input" in check.summary
    assert report.breakdown["input"] > 0.5
    assert "docs/where-does-the-time-go.md#input" in check.explanation


def test_profile_errors_say_what_to_do(tmp_path):
    strategy = mirrored.MirroredStrategy()
    model, optimizer = _state(strategy)
    with pytest.raises(ValueError, match="positive int"):
        mirrored.profile(strategy, train_step, args=(model, optimizer), steps=0)
    with pytest.raises(TypeError, match="args=\\(model, optimizer\\)"):
        mirrored.profile(strategy, train_step, args=model, data=BATCHES)
    with pytest.raises(ValueError, match="at least 2 batches"):
        mirrored.profile(
            strategy, train_step, args=(model, optimizer), data=BATCHES[:1], logdir=tmp_path
        )


def test_tensorboard_profile_batch_profiles_fit_as_keras(tmp_path):
    x = np.concatenate([b[0] for b in BATCHES])
    y = np.concatenate([b[1] for b in BATCHES])
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            from_logits=True,
        )
    tb = mirrored.callbacks.TensorBoard(tmp_path, profile_batch=(2, 4))
    trainer.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tb])
    report = tb.profile_report
    assert report is not None and report["All-reduce in the trace"].status == "PASS"
    assert len(report.steps) >= 3  # batches 2..4 (and one the devices were still running)
    assert list((tmp_path / "train" / "plugins" / "profile").glob("*/*.xplane.pb"))
    for bad in (-1, (3, 2), (0, 4), "a,b", 1.5):
        with pytest.raises(ValueError, match="profile_batch"):
            mirrored.callbacks.TensorBoard(tmp_path, profile_batch=bad)
    assert mirrored.callbacks.TensorBoard(tmp_path, profile_batch="3,5")._profile == (3, 5)


def test_collective_sizes_and_interval_arithmetic():
    hlo = (
        "  %all-reduce.1 = (f32[784,128]{1,0}, f32[128]{0}) all-reduce(%a, %b), "
        "replica_groups={}\n"
        "  ROOT %all-gather-start = bf16[8,16]{1,0} all-gather-start(%c)\n"
        "  %add.3 = f32[4]{0} add(%d, %e)\n"
    )
    assert trace.collective_bytes(hlo) == {
        "all-reduce.1": 4 * (784 * 128 + 128),
        "all-gather-start": 2 * 8 * 16,
    }
    assert trace.kind_of("all-reduce.7") == "all-reduce"
    assert trace.kind_of("all-gather-start") == "all-gather"
    assert trace.kind_of("ynn_fusion.3") is None
    assert trace._union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert trace._minus([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]


def test_doctor_profile_writes_the_trace_and_reports_the_breakdown(tmp_path):
    result = subprocess.run(
        [
            "timeout",
            "-k",
            "10",
            "240",
            sys.executable,
            "-m",
            "mirrored.cli",
            "doctor",
            "--devices",
            "8",
            "--no-scaling",
            "--json",
            "--profile",
            str(tmp_path),
            "--profile-steps",
            "3",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    profiled = out["profile"]
    assert out["ok"] and profiled["ok"] and len(profiled["steps"]) == 3
    assert sum(profiled["breakdown"].values()) == pytest.approx(1.0, abs=1e-6)
    assert profiled["collectives"][0]["kind"] == "all-reduce"
    assert {c["name"] for c in profiled["checks"]} >= {"All-reduce in the trace", "Input"}
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))
