"""All-reduce time and seed-MLP training throughput: 2 processes × 1 device vs 1 process × 2.

The driver starts each configuration with `mirrored launch` (it re-runs this file as the
workers) and prints JSON. Processes talk over gloo on 127.0.0.1.

    python benchmarks/multiworker.py [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def worker(out: str, steps: int) -> None:
    import mirrored

    strategy = mirrored.MultiWorkerMirroredStrategy()
    import jax
    import numpy as np
    import optax
    from _models import MLP, synthetic_batches
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    mesh = strategy.mesh
    size = 784 * 128 + 128 + 128 * 10 + 10  # the seed MLP's gradient
    allreduce = jax.jit(
        jax.shard_map(
            lambda g: jax.lax.psum(g, mirrored.REPLICA_AXIS),
            mesh=mesh,
            in_specs=P(mirrored.REPLICA_AXIS),
            out_specs=P(),
        )
    )
    n = strategy.num_replicas_in_sync
    grads = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones(size, np.float32)
    ).global_value.reshape(n * size)
    jax.block_until_ready(allreduce(grads))
    start = time.perf_counter()
    for _ in range(steps):
        result = allreduce(grads)
        result.block_until_ready()  # latency of one all-reduce, not pipelined
    allreduce_us = (time.perf_counter() - start) / steps * 1e6

    with strategy.scope():
        model = MLP((128,), rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset(synthetic_batches(256, count=4)))

    def step(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    for x, y in batches:
        strategy.run(step, args=(model, optimizer, x, y))
    jax.block_until_ready(nnx.state(model))
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        strategy.run(step, args=(model, optimizer, x, y))
    jax.block_until_ready(nnx.state(model))
    examples_per_s = steps * 256 / (time.perf_counter() - start)
    if strategy.is_chief:
        with open(out, "w") as f:
            json.dump(
                {
                    "processes": jax.process_count(),
                    "devices_per_process": len(jax.local_devices()),
                    "allreduce_us": round(allreduce_us, 1),
                    "seed_mlp_examples_per_s": round(examples_per_s),
                },
                f,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--worker-out", default="")
    args = parser.parse_args()
    if args.worker_out:
        worker(args.worker_out, args.steps)
        return
    from mirrored._cluster.launch import launch

    rows = []
    for processes, devices in ((2, 1), (1, 2)):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            command = [sys.executable, __file__, "--steps", str(args.steps), "--worker-out", out]
            code = launch(command, num_processes=processes, devices_per_process=devices)
            if code:
                raise SystemExit(f"workers failed with exit code {code}")
            with open(out) as f:
                rows.append(json.load(f))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    ratio = rows[0]["seed_mlp_examples_per_s"] / rows[1]["seed_mlp_examples_per_s"]
    print(
        json.dumps(
            {"benchmark": "multiworker", "results": rows, "throughput_2x1_vs_1x2": round(ratio, 3)},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
