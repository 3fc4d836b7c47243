"""Models and a plain-JAX data-parallel baseline shared by the benchmarks."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mirrored._cli.bench import MLP as MLP  # one definition of the models, re-exported
from mirrored._cli.bench import MODELS as MODELS
from mirrored._cli.bench import train_step as train_step


def synthetic_batches(batch: int, count: int = 4, seed: int = 0) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(batch, 784)).astype(np.float32),
            rng.integers(0, 10, batch).astype(np.int32),
        )
        for _ in range(count)
    ]


def plain_jax_step(devices: list[jax.Device], hidden: tuple[int, ...], lr: float = 1e-3):
    """A hand-written data-parallel step: shard_map, local grads, explicit pmean, Adam.

    Parameters are plain dicts of arrays (not nnx.State) so that the baseline's per-step
    dispatch is as cheap as JAX allows.
    """
    mesh = Mesh(np.asarray(devices), ("batch",))
    model = MLP(hidden, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.device_put(state.to_pure_dict(), NamedSharding(mesh, P()))
    tx = optax.adam(lr)
    opt_state = jax.device_put(tx.init(params), NamedSharding(mesh, P()))

    def local(params, opt_state, x, y):
        def loss_fn(p):
            nnx.replace_by_pure_dict(state, p)
            logits = nnx.merge(graphdef, state)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P("batch"), P("batch")),
            out_specs=(P(), P(), P()),
            check_vma=False,
        ),
        donate_argnums=(0, 1),
    )
    data_sharding = NamedSharding(mesh, P("batch"))
    return step, params, opt_state, data_sharding


def timed(run_steps: Callable[[int], Any], steps: int, warmup: int) -> float:
    """Seconds for `steps` steps after `warmup` steps, waiting for the device at both ends."""
    jax.block_until_ready(run_steps(warmup))
    start = time.perf_counter()
    jax.block_until_ready(run_steps(steps))
    return time.perf_counter() - start


def run_bounded(k: int, step_once: Callable[[int], Any], replicas: int) -> Any:
    """`step_once(0..k-1)` with mirrored's default dispatch bound on `replicas` devices (at
    most 2 steps queued with several, none with one); returns the last step's output."""
    in_flight = 2 if replicas > 1 else None
    queue: collections.deque = collections.deque()
    out = None
    for i in range(k):
        out = step_once(i)
        if in_flight is None:
            continue
        queue.append(out)
        if len(queue) > in_flight:
            jax.block_until_ready(queue.popleft())
    return out
