"""The per-step cost of `PreemptionCheckpointHandler.run` (issue 35): the seed MLP's training
step (batch 256, Adam) under `handler.run` against the same loop without it, at 2 and 4
processes × 1 device on 127.0.0.1 (gloo). Rounds alternate; the ratio is of medians.

The driver starts each configuration with `mirrored launch` (re-running this file as the
workers) and prints JSON.

    python benchmarks/preemption_overhead.py [--steps 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def worker(out: str, steps: int, rounds: int) -> None:
    import mirrored

    strategy = mirrored.MultiWorkerMirroredStrategy()
    import jax
    import optax
    from _models import MLP, synthetic_batches
    from flax import nnx

    with strategy.scope():
        model = MLP((128,), rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset(synthetic_batches(256, count=4)))
    handler = mirrored.PreemptionCheckpointHandler(
        None, {"model": model, "optimizer": optimizer}, os.path.join(os.path.dirname(out), "p")
    )

    def step(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example)

        optimizer.update(model, nnx.grad(loss_fn)(model))

    def train_step(i):
        x, y = batches[i % len(batches)]
        strategy.run(step, args=(model, optimizer, x, y))

    def timed(under_handler: bool) -> float:
        jax.block_until_ready(nnx.state(model))
        start = time.perf_counter()
        for i in range(steps):
            if under_handler:
                handler.run(train_step, i)
            else:
                train_step(i)
        jax.block_until_ready(nnx.state(model))
        return (time.perf_counter() - start) / steps

    timed(False), timed(True)  # compiled, warm
    # The check alone: what run adds before each step (JAX's preemption sync point query).
    notice = handler._notice
    start = time.perf_counter()
    for _ in range(1000):
        notice.reached(handler.total_run_calls)
    check_us = (time.perf_counter() - start) / 1000 * 1e6
    plain, handled = [], []
    for _ in range(rounds):
        plain.append(timed(False))
        handled.append(timed(True))
    if strategy.is_chief:
        with open(out, "w") as f:
            json.dump(
                {
                    "processes": jax.process_count(),
                    "plain_step_ms": round(statistics.median(plain) * 1e3, 3),
                    "handler_step_ms": round(statistics.median(handled) * 1e3, 3),
                    "overhead": round(statistics.median(handled) / statistics.median(plain) - 1, 4),
                    "check_us": round(check_us, 2),
                    "check_share_of_step": round(check_us / 1e6 / statistics.median(plain), 6),
                },
                f,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker-out", default="")
    args = parser.parse_args()
    if args.worker_out:
        worker(args.worker_out, args.steps, args.rounds)
        return
    from mirrored._cluster.launch import launch

    rows = []
    for processes in args.processes:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            command = [sys.executable, __file__, "--steps", str(args.steps)]
            command += ["--rounds", str(args.rounds), "--worker-out", out]
            code = launch(command, num_processes=processes, devices_per_process=1)
            if code:
                raise SystemExit(f"workers failed with exit code {code}")
            with open(out) as f:
                rows.append(json.load(f))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "preemption_overhead", "results": rows}, indent=2))


if __name__ == "__main__":
    main()
