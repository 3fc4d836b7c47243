"""Small models and training loops shared by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import mirrored
from mirrored._core.leaves import raw_array

# XLA flags of the suite and of every script it starts (set by conftest before JAX starts).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def subprocess_env() -> dict[str, str]:
    """The environment for a script a test starts: its own device count and thread pool (no
    inherited NPROC or device-count flag); the suite's compilation cache and its XLA
    optimisation level (`TEST_XLA_FLAGS`) are kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["XLA_FLAGS"] = TEST_XLA_FLAGS
    return env


def job_env(**extra: str) -> dict[str, str]:
    """A 2-process job of 1 device each, started without a launcher: the variables `mirrored
    launch` sets, on a free 127.0.0.1 port (each worker adds its MIRRORED_PROCESS_ID)."""
    from mirrored._cluster.launch import free_port

    env = subprocess_env()
    env.update(
        MIRRORED_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
        MIRRORED_NUM_PROCESSES="2",
        MIRRORED_LOCAL_DEVICES="1",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def start_worker(
    command: list[str], env: dict[str, str], rank: int, id_variable: str = "MIRRORED_PROCESS_ID"
) -> subprocess.Popen[str]:
    """Worker `rank` of `command` (bound it with `timeout` in the command), output captured."""
    return subprocess.Popen(
        command,
        env={**env, id_variable: str(rank)},
        cwd=Path(__file__).resolve().parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_two_workers(
    command: list[str],
    env: dict[str, str],
    id_variable: str = "MIRRORED_PROCESS_ID",
    timeout: float = 150,
) -> tuple[list[int], list[str]]:
    """Workers 0 and 1 of `command`, to the end: their exit codes and outputs."""
    workers = [start_worker(command, env, rank, id_variable) for rank in range(2)]
    outputs = [worker.communicate(timeout=timeout)[0] for worker in workers]
    return [worker.returncode for worker in workers], outputs


def per_rank_tails(output: str, chars: int = 2500) -> str:
    """A launched job's output for a failure message: the end of each worker's own lines (one
    worker's long traceback must not hide the other's first error) and the launcher's."""
    ranks: dict[str, list[str]] = {}
    for line in output.splitlines():
        rank = line[: line.index("]") + 1] if line.startswith("[rank ") else "launcher"
        ranks.setdefault(rank, []).append(line)
    return "\n".join(
        f"--- {rank} ---\n" + "\n".join(lines)[-chars:] for rank, lines in sorted(ranks.items())
    )


class SmallMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(12, 32, rngs=rngs)
        self.out = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.tanh(self.hidden(x)))


def global_batches(count: int, batch: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(batch, 12)).astype(np.float32),
            rng.integers(0, 5, batch).astype(np.int32),
        )
        for _ in range(count)
    ]


def train_step(
    model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
) -> jax.Array:
    """One SGD/Adam step of any classifier `model` (sparse cross-entropy of its logits)."""

    def loss_fn(model: nnx.Module) -> jax.Array:
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def adam_trainer(replicas: int = 8, **options: object) -> mirrored.Trainer:
    """The SmallMLP Trainer (Adam 0.01, sparse cross-entropy of logits, accuracy) on the first
    `replicas` devices; `options`: its other arguments (`steps_per_execution`, `run_eagerly`)."""
    strategy = mirrored.MirroredStrategy(jax.devices()[:replicas])
    with strategy.scope():
        return mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            optax.adam(0.01),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
            **options,  # type: ignore[arg-type]
        )


def params_of(model: nnx.Module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): np.asarray(var.get_value()) for path, var in flat}


def train_single_device(
    batches: list[tuple[np.ndarray, np.ndarray]],
    make_tx: Callable[[], optax.GradientTransformation],
) -> dict[str, np.ndarray]:
    """The reference: plain NNX on one device, mean loss over each global batch."""
    model = SmallMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model: SmallMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> None:
        def loss_fn(model: SmallMLP) -> jax.Array:
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    for x, y in batches:
        step(model, optimizer, x, y)
    return params_of(model)


def train_mirrored(
    strategy: mirrored.Strategy,
    batches: list[tuple[np.ndarray, np.ndarray]],
    make_tx: Callable[[], optax.GradientTransformation],
) -> tuple[SmallMLP, nnx.Optimizer]:
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(train_step, args=(model, optimizer, x, y))
    return model, optimizer


def max_relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def assert_bit_identical_on_devices(tree: object) -> None:
    """Every addressable shard of every mirrored array holds exactly the same bits."""
    for leaf in jax.tree.leaves(nnx.state(tree) if isinstance(tree, nnx.Module) else tree):
        shards = [np.asarray(raw_array(s.data)) for s in leaf.addressable_shards]
        first = shards[0].tobytes()
        assert all(s.tobytes() == first for s in shards[1:]), "replicas diverged"


def keras_reference(out, *options):
    """Run _keras_reference.py (plain Keras, with mirrored only if asked); its JSON results."""
    here = Path(__file__).resolve().parent
    env = {**subprocess_env(), "KERAS_BACKEND": "jax"}
    # With mirrored: the one this process tests, wherever the subprocess starts.
    tested = str(Path(mirrored.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([tested, *filter(None, [env.get("PYTHONPATH")])])
    command = ["timeout", "-k", "10", "300", sys.executable, str(here / "_keras_reference.py")]
    result = subprocess.run(
        [*command, str(out), *options], capture_output=True, text=True, cwd=here, env=env
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(Path(out).read_text())
