"""ZeRO stages 1 and 2 (`mirrored.ShardedOptimizer`, `shard_gradients=True`) against the
mirrored `nnx.Optimizer`: Adam state bytes per device, the compiled step's temporary bytes,
and step time, for the seed MLP (784-128-10, batch 256) and the wide MLP (784-2048-2048-10,
batch 512) on N simulated CPU devices in one process. Rounds alternate; times are medians.
Prints JSON.

    python benchmarks/zero.py [--devices 8] [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mirrored


def _bytes_on(device, tree) -> int:
    import jax

    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for s in getattr(leaf, "addressable_shards", [])
        if s.device == device
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="seed_mlp,wide_mlp")
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import jax
    import optax
    from _models import MLP, MODELS, synthetic_batches, train_step
    from flax import nnx

    strategy = mirrored.MirroredStrategy()
    device = jax.devices()[0]
    rows = []
    for name in args.models.split(","):
        hidden, batch = MODELS[name]
        runs = {}
        for kind in ("replicated", "zero1", "zero2"):
            with strategy.scope():
                model = MLP(hidden, rngs=nnx.Rngs(0))
                optimizer = (
                    nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
                    if kind == "replicated"
                    else mirrored.ShardedOptimizer(
                        model, optax.adam(1e-3), shard_gradients=kind == "zero2"
                    )
                )
            batches = list(strategy.experimental_distribute_dataset(synthetic_batches(batch)))
            x, y = batches[0]
            compiled = strategy._runner.lowered(train_step, (model, optimizer, x, y), {})
            memory = compiled.compile().memory_analysis()

            def steps(k, model=model, optimizer=optimizer, batches=batches):
                for i in range(k):
                    x, y = batches[i % len(batches)]
                    strategy.run(train_step, args=(model, optimizer, x, y))
                jax.block_until_ready(nnx.state(model))

            steps(3)
            runs[kind] = {
                "steps": steps,
                "state_bytes": _bytes_on(device, nnx.state(optimizer.opt_state)),
                "whole_state_bytes": sum(
                    leaf.nbytes for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state))
                ),
                "temp_bytes": int(getattr(memory, "temp_size_in_bytes", -1)),
                "times": [],
            }
        for _ in range(args.rounds):
            for run in runs.values():
                start = time.perf_counter()
                run["steps"](args.steps)
                run["times"].append((time.perf_counter() - start) / args.steps)
        kinds = list(runs)
        step = {kind: statistics.median(runs[kind]["times"]) for kind in kinds}
        rows.append(
            {
                "model": name,
                "devices": args.devices,
                "adam_state_bytes_per_device": {
                    **{kind: runs[kind]["state_bytes"] for kind in kinds},
                    "replicated_over_n": runs["replicated"]["whole_state_bytes"] // args.devices,
                },
                "compiled_temp_bytes": {kind: runs[kind]["temp_bytes"] for kind in kinds},
                "step_ms": {kind: round(step[kind] * 1e3, 3) for kind in kinds},
                **{
                    f"speed_{kind}_over_replicated": round(step["replicated"] / step[kind], 3)
                    for kind in ("zero1", "zero2")
                },
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "zero", "results": rows}, indent=2))


if __name__ == "__main__":
    main()
