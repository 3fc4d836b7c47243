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
from mirrored._cli.demo import train_step  # the README's step works for any classifier


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


def _point(devices: list[Any], hidden: tuple[int, ...], batch: int, steps: int) -> dict[str, float]:
    """One configuration: examples/s, the seconds to its first finished step (strategy, model,
    compile and one step), and the FLOPs of one step (XLA's cost analysis, all devices)."""
    start = time.perf_counter()
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
    loss = strategy.run(train_step, args=(model, optimizer, *placed[0]))
    jax.block_until_ready(loss.global_value)
    first_step = time.perf_counter() - start
    loss = strategy.run(train_step, args=(model, optimizer, *placed[1]))  # warm up
    jax.block_until_ready(loss.global_value)
    lowered = strategy._lowered(train_step, (model, optimizer, *placed[0]), {})
    cost = lowered.cost_analysis()  # one device's program; every device runs one
    flops = float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)) * len(devices)
    start = time.perf_counter()
    for i in range(steps):
        x, y = placed[i % 2]
        loss = strategy.run(train_step, args=(model, optimizer, x, y))
    jax.block_until_ready(loss.global_value)
    seconds = (time.perf_counter() - start) / steps
    # The step all-reduces one gradient per parameter (float32), plus the loss.
    gradient_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "examples_per_s": batch / seconds,
        "first_step_s": first_step,
        "step_flops": flops,
        "flop_per_s": flops / seconds,
        "all_reduce_bytes": float(gradient_bytes) if len(devices) > 1 else 0.0,
        "step_s": seconds,
    }


PEAK_MATMUL_SIZE = 1024  # the square float32 matmul that measures the peak


def matmul_peak(devices: list[Any], *, size: int = PEAK_MATMUL_SIZE, repeats: int = 5) -> float:
    """FLOP/s of a large float32 matmul on every device at once: the machine's peak as this
    run can reach it (simulated CPU devices share the host's cores, so their sum does too)."""
    from jax.sharding import PartitionSpec

    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    split = jax.sharding.NamedSharding(mesh, PartitionSpec("d"))
    rng = np.random.default_rng(0)
    a = jax.device_put(rng.normal(size=(len(devices) * size, size)).astype(np.float32), split)
    b = jax.device_put(rng.normal(size=(len(devices) * size, size)).astype(np.float32), split)
    spec = PartitionSpec("d")
    matmul = jax.jit(jax.shard_map(jnp_matmul, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    jax.block_until_ready(matmul(a, b))  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 * len(devices) / best


def jnp_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return a @ b


PEAK_PSUM_BYTES = {"cpu": 16 << 20, "gpu": 256 << 20}  # per device; TPUs as GPUs


def bus_bandwidth(count: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: what each link carries, comparable across
    replica counts (a ring moves 2 (N - 1) / N of the buffer through every device)."""
    return nbytes / seconds * 2 * (count - 1) / count


def psum_peak(devices: list[Any], *, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bus bandwidth (bytes/s) of a large float32 ``psum`` over ``devices``: the all-reduce
    peak this run can reach (0 for one device: there is nothing to reduce)."""
    if len(devices) < 2:
        return 0.0
    from jax.sharding import PartitionSpec

    nbytes = nbytes or _psum_bytes(devices[0].platform)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    spec = PartitionSpec("d")
    rows = nbytes // 4
    x = jax.device_put(
        np.ones((len(devices) * rows,), np.float32), jax.sharding.NamedSharding(mesh, spec)
    )
    total = jax.jit(jax.shard_map(_psum, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    jax.block_until_ready(total(x))  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(total(x))
        best = min(best, time.perf_counter() - start)
    return bus_bandwidth(len(devices), rows * 4, best)


def _psum_bytes(platform: str) -> int:
    return PEAK_PSUM_BYTES.get(platform, PEAK_PSUM_BYTES["gpu"])


def _psum(x: jax.Array) -> jax.Array:
    return jax.lax.psum(x, "d")


def scaling(models: list[str], *, steps: int = 20) -> dict[str, Any]:
    """Examples/s and efficiency for 1, 2, 4 … N replicas, weak (fixed per-replica batch) and
    strong (fixed global batch) scaling, for each model; per point also the time to its first
    step and its FLOP/s against the measured matmul peak of the same devices."""
    devices = jax.devices()
    n = len(devices)
    counts = sorted({1, *(2**k for k in range(1, n.bit_length()) if 2**k < n), n})
    peaks = [matmul_peak(devices[:c]) for c in counts]
    bandwidths = [psum_peak(devices[:c]) for c in counts]
    out: dict[str, Any] = {
        "platform": devices[0].platform,
        "devices": n,
        "peak_flop_per_s": peaks,
        "peak_bus_bytes_per_s": bandwidths,
        "models": {},
    }
    for name in models:
        hidden, global_batch = MODELS[name]
        per_replica = max(1, global_batch // n)
        runs = steps if name == "seed_mlp" else max(3, steps // 5)
        weak = [_point(devices[:c], hidden, per_replica * c, runs) for c in counts]
        strong = [_point(devices[:c], hidden, global_batch, runs) for c in counts]
        out["models"][name] = {
            "replicas": counts,
            "weak": {
                "per_replica_batch": per_replica,
                **_columns(weak, counts, peaks, bandwidths),
            },
            "strong": {
                "global_batch": global_batch,
                **_columns(strong, counts, peaks, bandwidths),
            },
        }
    return out


def _columns(
    points: list[dict[str, float]], counts: list[int], peaks: list[float], buses: list[float]
) -> dict[str, list[float]]:
    rates = [p["examples_per_s"] for p in points]
    # The step's all-reduce at the measured peak bandwidth: the least time communication can
    # take, as a share of the measured step (near 1: the model is too small for N devices).
    floor = [
        p["all_reduce_bytes"] * 2 * (c - 1) / c / bus / p["step_s"] if bus else 0.0
        for p, c, bus in zip(points, counts, buses, strict=True)
    ]
    return {
        "all_reduce_bytes": [p["all_reduce_bytes"] for p in points],
        "all_reduce_share_at_peak": floor,
        "examples_per_s": rates,
        "efficiency": [r / (c * rates[0]) for r, c in zip(rates, counts, strict=True)],
        "first_step_s": [p["first_step_s"] for p in points],
        "step_flops": [p["step_flops"] for p in points],
        "flop_per_s": [p["flop_per_s"] for p in points],
        "peak_fraction": [p["flop_per_s"] / peak for p, peak in zip(points, peaks, strict=True)],
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mirrored bench — {report['devices']} {report['platform']} device(s)")
    table.add_column("model", no_wrap=True)
    columns = ("N", "weak ex/s", "eff.", "strong ex/s", "eff.", "1st step", "GFLOP/s", "peak")
    for column in (*columns, "all-reduce"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, data in report["models"].items():
        weak, strong = data["weak"], data["strong"]
        for i, count in enumerate(data["replicas"]):
            table.add_row(
                name,
                str(count),
                f"{weak['examples_per_s'][i]:,.0f}",
                f"{weak['efficiency'][i]:.0%}",
                f"{strong['examples_per_s'][i]:,.0f}",
                f"{strong['efficiency'][i]:.0%}",
                f"{strong['first_step_s'][i]:.2f} s",
                f"{strong['flop_per_s'][i] / 1e9:,.1f}",
                f"{strong['peak_fraction'][i]:.0%}",
                _all_reduce_cell(strong, i),
            )
    console = Console()
    console.width = max(console.width, 118)  # ten columns: wider than a default 80
    console.print(table)
    peaks = _by_replicas(report, "peak_flop_per_s", "{:,.0f}")
    buses = _by_replicas(report, "peak_bus_bytes_per_s", "{:,.1f}")
    if buses:
        console.print(
            f"All-reduce peak (a {_psum_bytes(report['platform']) >> 20} MiB psum "
            f"per device), bus GB/s by replicas: {buses}. The all-reduce column is the step's "
            "gradient bytes and the share of the step they take at that peak: near 100% the "
            "model is too small for this many devices (raise the per-replica batch)."
        )
    console.print(
        f"Peak (a {PEAK_MATMUL_SIZE}² float32 matmul on every device at once), GFLOP/s by "
        f"replicas: {peaks}. "
        "The last three columns are the strong-scaling runs (the model's global batch): time "
        "from creating the strategy to the first finished step, and FLOP/s from XLA's cost "
        "analysis of the compiled step."
    )
    if report["platform"] == "cpu":
        console.print(
            "Simulated CPU devices share the host's cores: these numbers test the machinery, "
            "not speed-up."
        )


def _by_replicas(report: dict[str, Any], key: str, form: str) -> str:
    """`report[key]` (one value per replica count, in units of 1e9) as "N: value, ...";
    zeros (nothing measured at that count) left out."""
    counts = next(iter(report["models"].values()))["replicas"]
    return ", ".join(
        f"{c}: {form.format(v / 1e9)}" for c, v in zip(counts, report[key], strict=True) if v
    )


def _all_reduce_cell(columns: dict[str, Any], i: int) -> str:
    nbytes = columns["all_reduce_bytes"][i]
    if not nbytes:
        return "—"
    return f"{nbytes / 2**20:,.1f} MiB {columns['all_reduce_share_at_peak'][i]:.0%}"


def plot_report(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, data in report["models"].items():
        for ax, kind in zip(axes[:2], ("weak", "strong"), strict=True):
            ax.plot(data["replicas"], data[kind]["efficiency"], "o-", label=name)
        axes[2].plot(data["replicas"], data["strong"]["peak_fraction"], "o-", label=name)
    for ax, kind in zip(axes[:2], ("Weak", "Strong"), strict=True):
        ax.set(xlabel="replicas", ylabel="efficiency", ylim=(0, 1.1), title=f"{kind} scaling")
    axes[2].set(
        xlabel="replicas", ylabel="fraction", ylim=(0, 1.1), title="FLOP/s of the matmul peak"
    )
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
