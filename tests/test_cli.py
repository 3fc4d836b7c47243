"""The demo and the examples run end to end, as a user would start them."""

import json
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from _helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = subprocess_env()
    return subprocess.run(
        ["timeout", "-k", "10", str(timeout), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("loop", "last_epoch"), [("fit", "epoch 20/20 "), ("custom", "epoch  20/20")]
)
def test_demo_trains_to_high_accuracy(loop, last_epoch):
    result = _run([sys.executable, "-m", "mirrored.cli", "demo", "--devices", "8", "--loop", loop])
    assert result.returncode == 0, result.stderr
    assert "8 replica(s) on /cpu:0" in result.stdout
    assert "global batch 128 = 8 replicas × 16 per replica" in result.stdout
    assert last_epoch in result.stdout
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.9


def test_demo_pads_an_indivisible_batch_and_rejects_a_too_small_one():
    result = _run([sys.executable, "-m", "mirrored.cli", "demo", "--devices", "3", "--epochs", "1"])
    assert result.returncode == 0, result.stderr
    assert "global batch 129 = 3 replicas × 43 per replica (padded from 128" in result.stdout
    result = _run([sys.executable, "-m", "mirrored.cli", "demo", "--batch-size", "4"])
    assert result.returncode == 2
    assert "gives each of the 8 replicas 0 examples" in result.stderr


@pytest.mark.parametrize("example", ["custom_loop.py", "fit.py"])
def test_examples(example):
    result = _run([sys.executable, f"examples/{example}"])
    assert result.returncode == 0, result.stderr
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.9


def test_bench_reports_weak_and_strong_scaling(tmp_path):
    plot = tmp_path / "bench.png"
    result = _run(
        [
            sys.executable,
            "-m",
            "mirrored.cli",
            "bench",
            "--devices",
            "2",
            "--models",
            "seed_mlp",
            "--steps",
            "2",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    seed = report["models"]["seed_mlp"]
    assert report["devices"] == 2 and seed["replicas"] == [1, 2]
    assert seed["weak"]["per_replica_batch"] == 128 and seed["strong"]["global_batch"] == 256
    assert seed["weak"]["efficiency"][0] == 1.0 and all(
        r > 0 for r in seed["strong"]["examples_per_s"]
    )
    # FLOPs of one step from XLA's cost analysis: ~4 × batch × weights (forward and weight
    # gradients; no input gradient), summed over the devices; against a measured peak.
    weights = 784 * 128 + 128 * 10
    assert 3.5 * 128 * weights < seed["weak"]["step_flops"][0] < 5 * 128 * weights
    assert seed["weak"]["step_flops"][1] > 1.9 * seed["weak"]["step_flops"][0]  # 2 × 128 rows
    assert all(0 < f < 1.5 for f in seed["weak"]["peak_fraction"])
    assert all(p > 1e8 for p in report["peak_flop_per_s"])
    assert all(0 < s < 60 for s in seed["weak"]["first_step_s"])
    # The all-reduce: one float32 gradient per parameter at N = 2, none at N = 1, against the
    # bus bandwidth of a large psum measured in the same run.
    assert seed["strong"]["all_reduce_bytes"] == [0.0, 4.0 * (weights + 128 + 10)]
    assert report["peak_bus_bytes_per_s"][0] == 0.0 and report["peak_bus_bytes_per_s"][1] > 1e7
    assert 0 < seed["strong"]["all_reduce_share_at_peak"][1] < 1
    assert plot.read_bytes()[:4] == b"\x89PNG"
    bad = _run([sys.executable, "-m", "mirrored.cli", "bench", "--models", "resnet"])
    assert bad.returncode == 2 and "found 'resnet'" in bad.stderr


@pytest.mark.parametrize(
    "script",
    [
        [
            "step_overhead.py",
            "--devices",
            "2",
            "--steps",
            "3",
            "--repeats",
            "1",
            "--models",
            "seed_mlp",
        ],
        ["input_pipeline.py", "--devices", "2", "--rows", "2048", "--repeats", "1"],
        [
            "fit_throughput.py",
            "--devices",
            "2",
            "--steps",
            "3",
            "--steps-per-execution",
            "2",
            "--repeats",
            "1",
            "--models",
            "seed_mlp",
        ],
        [
            "real_models.py",
            "--devices",
            "1",
            "--steps",
            "2",
            "--steps-per-execution",
            "2",
            "--repeats",
            "1",
            "--models",
            "cnn_digits",
            "--auto-warmup-epochs",
            "1",
        ],
        ["flax_tutorial.py", "--devices", "1", "--steps", "1", "--repeats", "1"],
        ["keras_models.py", "--devices", "1", "--steps", "2", "--repeats", "1"],
        ["time_to_first_step.py", "--models", "seed_mlp", "--scripts", "run", "--repeats", "1"],
        ["gpu_checks.py", "--allow-cpu"],  # benchmarks/gpu.sh's checks, on 8 CPU devices
        ["zero.py", "--rounds", "1", "--steps", "2", "--models", "seed_mlp"],  # gpu.sh's too
        ["fit_memory.py", "--devices", "1", "--rows", "1024"],  # a process per case
        [
            "debugging.py",
            "--devices",
            "2",
            "--steps",
            "3",
            "--eager-steps",
            "0",  # eager steps: tests/test_debugging.py
            "--repeats",
            "1",
            "--models",
            "seed_mlp",
        ],
    ],
    ids=lambda s: s[0],
)
def test_benchmark_scripts_run(script, monkeypatch, capsys):
    """Not a timing test: the benchmarks must keep working as the code changes.

    Run in this process (no interpreter start, programs shared through the compilation
    cache): the scripts take `jax.devices()[:n]` of the suite's 8 simulated devices.
    """
    import mirrored

    monkeypatch.setattr(mirrored, "simulate_cpu_devices", lambda n: None)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [script[0], *script[1:]])
    with warnings.catch_warnings():  # run as scripts are: deprecations are not errors here
        warnings.simplefilter("ignore", DeprecationWarning)
        runpy.run_path(str(ROOT / "benchmarks" / script[0]), run_name="__main__")
    assert json.loads(capsys.readouterr().out)["benchmark"] == script[0].removesuffix(".py")
