"""The persistent compilation cache (issue 15): on by default in a per-user directory, a second
run loads its programs instead of compiling them, an off switch, the user's own JAX setting
kept, and processes writing one cache at once leave it readable."""

import json
import os
import subprocess
import sys

import jax
import pytest

import mirrored
from mirrored._core import settings

SCRIPT = """
import json, sys
import jax, numpy as np, optax
from flax import nnx
import mirrored

hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None
)
strategy = mirrored.MirroredStrategy()
with strategy.scope():
    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

def step(model, optimizer, x):
    loss_fn = lambda m: mirrored.compute_average_loss((m(x) ** 2).sum(axis=1))
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

(x,) = next(iter(strategy.experimental_distribute_dataset([(np.ones((8, 6), np.float32),)])))
loss = float(strategy.reduce("SUM", strategy.run(step, args=(model, optimizer, x)), axis=None))
print(json.dumps({"dir": mirrored.config.compilation_cache_dir(), "hits": len(hits),
                  "loss": loss}))
"""


def _env(tmp_path, **extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "XLA_FLAGS"))
        and k not in ("NPROC", "MIRRORED_COMPILATION_CACHE")
    }
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env.update(extra)
    return env


def _start(tmp_path, **extra):
    return subprocess.Popen(
        ["timeout", "-k", "5", "120", sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=_env(tmp_path, **extra),
    )


def _result(process):
    out, err = process.communicate()
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _run(tmp_path, **extra):
    return _result(_start(tmp_path, **extra))


def test_a_second_run_loads_its_programs_from_the_default_per_user_cache(tmp_path):
    default = str(tmp_path / "xdg" / "mirrored" / "xla")
    # Two processes fill one empty cache at the same moment (a multi-worker job's start).
    first = [_start(tmp_path), _start(tmp_path)]
    results = [_result(p) for p in first]
    assert all(r["dir"] == default for r in results), results
    assert os.listdir(default)
    again = _run(tmp_path)
    fresh = _run(tmp_path, MIRRORED_COMPILATION_CACHE=str(tmp_path / "fresh"))
    assert again["hits"] > fresh["hits"]  # loaded, not compiled
    assert again["loss"] == results[0]["loss"] == results[1]["loss"]


def test_the_cache_can_be_moved_or_turned_off_and_a_users_jax_setting_is_kept(tmp_path):
    moved = _run(tmp_path, MIRRORED_COMPILATION_CACHE=str(tmp_path / "mine"))
    assert moved["dir"] == str(tmp_path / "mine") and os.listdir(tmp_path / "mine")
    off = _run(tmp_path, MIRRORED_COMPILATION_CACHE="0")
    assert off["dir"] is None and off["hits"] == 0
    assert not (tmp_path / "xdg").exists()
    theirs = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "theirs"))
    assert theirs["dir"] == str(tmp_path / "theirs")
    assert not (tmp_path / "xdg").exists()


def test_set_compilation_cache_in_process(tmp_path):
    before = mirrored.config.compilation_cache_dir()  # the suite's own cache (conftest)
    size = jax.config.jax_compilation_cache_max_size
    assert before is not None
    try:
        mirrored.config.set_compilation_cache(tmp_path / "here")
        assert mirrored.config.compilation_cache_dir() == str(tmp_path / "here")
        assert jax.config.jax_compilation_cache_max_size == mirrored.config.MAX_CACHE_BYTES
        mirrored.config.set_compilation_cache(None)
        assert mirrored.config.compilation_cache_dir() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        jax.config.update("jax_compilation_cache_max_size", size)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_a_bounded_cache_scans_its_directory_only_when_it_may_be_full(tmp_path, monkeypatch):
    # JAX's bounded cache scanned every entry before each write (1.5 s at 10,000 entries).
    from jax._src import lru_cache

    settings._scan_only_when_full()  # the suite's cache (conftest) has installed it already
    scans = []
    scan = settings._jax_scan
    monkeypatch.setattr(settings, "_jax_scan", lambda *a, **k: (scans.append(1), scan(*a, **k)))
    for i in range(200):  # entries written before this process started
        (tmp_path / f"old{i}{lru_cache._CACHE_SUFFIX}").write_bytes(b"o" * 1000)
        (tmp_path / f"old{i}{lru_cache._ATIME_SUFFIX}").write_bytes(i.to_bytes(8, "little"))
    cache = lru_cache.LRUCache(str(tmp_path), max_size=250_000)
    for i in range(40):  # fills the room left without a scan
        cache.put(f"new{i}", b"n" * 1000)
    assert scans == []
    for i in range(40, 200):  # past the bound: scans, and evicts the oldest entries first
        cache.put(f"new{i}", b"n" * 1000)
        entries = list(tmp_path.glob(f"*{lru_cache._CACHE_SUFFIX}"))
        assert sum(e.stat().st_size for e in entries) <= 250_000
    assert 1 <= len(scans) <= 10, len(scans)  # each scan evicts down to 90% of the bound
    assert not (tmp_path / f"old0{lru_cache._CACHE_SUFFIX}").exists()
    assert cache.get("new199") == b"n" * 1000 and cache.get("new0") is not None


@pytest.mark.parametrize("value", ["off", "0", "none"])
def test_off_values(value, monkeypatch):
    monkeypatch.setattr(settings, "_decided", False)
    monkeypatch.setenv("MIRRORED_COMPILATION_CACHE", value)
    calls = []
    monkeypatch.setattr(settings, "set_compilation_cache", calls.append)
    settings.use_default_compilation_cache()
    assert calls == []
