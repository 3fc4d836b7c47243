"""`mirrored bench`: weak and strong scaling of the seed and wide MLPs on the available devices."""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import mirrored
from mirrored._demo import train_step  # the README's step works for any classifier


class MLP(nnx.Module):
    """784 → hidden… → 10 with ReLU: the seed MLP is (128,), the wide MLP (2048, 2048)."""

    def __init__(self, hidden: tuple[int, ...], *, rngs: nnx.Rngs) -> None:
        sizes = (784, *hidden, 10)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


MODELS = {"seed_mlp": ((128,), 256), "wide_mlp": ((2048, 2048), 512)}


def _rate(devices: list[Any], hidden: tuple[int, ...], batch: int, steps: int) -> float:
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        model = MLP(hidden, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    host = [
        (rng.normal(size=(batch, 784)).astype(np.float32), rng.integers(0, 10, batch))
        for _ in range(2)
    ]
    placed = list(strategy.experimental_distribute_dataset(host))
    for x, y in placed:  # compile, warm up
        loss = strategy.run(train_step, args=(model, optimizer, x, y))
    jax.block_until_ready(loss.global_value)
    start = time.perf_counter()
    for i in range(steps):
        x, y = placed[i % 2]
        loss = strategy.run(train_step, args=(model, optimizer, x, y))
    jax.block_until_ready(loss.global_value)
    return steps * batch / (time.perf_counter() - start)


def scaling(models: list[str], *, steps: int = 20) -> dict[str, Any]:
    """Examples/s and efficiency for 1, 2, 4 … N replicas, weak (fixed per-replica batch) and
    strong (fixed global batch) scaling, for each model."""
    devices = jax.devices()
    n = len(devices)
    counts = sorted({1, *(2**k for k in range(1, n.bit_length()) if 2**k < n), n})
    out: dict[str, Any] = {"platform": devices[0].platform, "devices": n, "models": {}}
    for name in models:
        hidden, global_batch = MODELS[name]
        per_replica = max(1, global_batch // n)
        runs = steps if name == "seed_mlp" else max(3, steps // 5)
        weak = [_rate(devices[:c], hidden, per_replica * c, runs) for c in counts]
        strong = [_rate(devices[:c], hidden, global_batch, runs) for c in counts]
        out["models"][name] = {
            "replicas": counts,
            "weak": {
                "per_replica_batch": per_replica,
                "examples_per_s": weak,
                "efficiency": [w / (c * weak[0]) for w, c in zip(weak, counts, strict=True)],
            },
            "strong": {
                "global_batch": global_batch,
                "examples_per_s": strong,
                "efficiency": [s / (c * strong[0]) for s, c in zip(strong, counts, strict=True)],
            },
        }
    return out


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mirrored bench — {report['devices']} {report['platform']} device(s)")
    for column in ("model", "replicas", "weak ex/s", "weak eff.", "strong ex/s", "strong eff."):
        table.add_column(column, justify="right")
    for name, data in report["models"].items():
        for i, count in enumerate(data["replicas"]):
            table.add_row(
                name,
                str(count),
                f"{data['weak']['examples_per_s'][i]:,.0f}",
                f"{data['weak']['efficiency'][i]:.0%}",
                f"{data['strong']['examples_per_s'][i]:,.0f}",
                f"{data['strong']['efficiency'][i]:.0%}",
            )
    Console().print(table)
    if report["platform"] == "cpu":
        Console().print(
            "Simulated CPU devices share the host's cores: these numbers test the machinery, "
            "not speed-up."
        )


def plot_report(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, data in report["models"].items():
        for ax, kind in zip(axes, ("weak", "strong"), strict=True):
            ax.plot(data["replicas"], data[kind]["efficiency"], "o-", label=name)
    for ax, kind in zip(axes, ("Weak", "Strong"), strict=True):
        ax.set(xlabel="replicas", ylabel="efficiency", ylim=(0, 1.1), title=f"{kind} scaling")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
