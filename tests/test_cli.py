"""The demo and the examples run end to end, as a user would start them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
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
