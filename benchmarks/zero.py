"""ZeRO stages 1 and 2 (`mirrored.ShardedOptimizer`, `shard_gradients=True`) against the
mirrored `nnx.Optimizer`: Adam state bytes per device, the compiled step's temporary bytes,
step time (`strategy.run` and `Trainer.fit`), for the seed MLP (784-128-10, batch 256) and
the wide MLP (784-2048-2048-10, batch 512) on N simulated CPU devices in one process (or the
machine's accelerators with --accelerator, as benchmarks/gpu.sh runs it). Rounds alternate;
times are medians. ZeRO-1's parameters and state are checked bitwise against the mirrored
run's after the same steps. Prints JSON.

    python benchmarks/zero.py [--devices 8] [--steps 30] [--rounds 5] [--accelerator]
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
    parser.add_argument("--accelerator", action="store_true", help="The machine's devices.")
    args = parser.parse_args()
    if not args.accelerator:
        mirrored.simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from _models import MLP, MODELS, synthetic_batches, train_step
    from flax import nnx

    strategy = mirrored.MirroredStrategy()
    args.devices = strategy.num_replicas_in_sync
    device = jax.devices()[0]
    rows = []
    for name in args.models.split(","):
        hidden, batch = MODELS[name]
        runs = {}
        fits = _fitter(strategy, MLP, hidden, batch, {"zero1": True, "zero2": "gradients"})
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
                "fit": fits[kind],
                "objects": (model, optimizer),
                "state_bytes": _bytes_on(device, nnx.state(optimizer.opt_state)),
                "whole_state_bytes": sum(
                    leaf.nbytes for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state))
                ),
                "temp_bytes": int(getattr(memory, "temp_size_in_bytes", -1)),
                "times": [],
                "fit_times": [],
            }
        for _ in range(args.rounds):
            for run in runs.values():
                start = time.perf_counter()
                run["steps"](args.steps)
                run["times"].append((time.perf_counter() - start) / args.steps)
                run["fit_times"].append(run["fit"]())
        kinds = list(runs)
        step = {kind: statistics.median(runs[kind]["times"]) for kind in kinds}
        fit_step = {kind: statistics.median(runs[kind]["fit_times"]) for kind in kinds}
        arrays = {
            kind: [np.asarray(a) for a in jax.tree.leaves(nnx.state(runs[kind]["objects"]))]
            for kind in kinds
        }
        stats = device.memory_stats() or {}
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
                "fit_step_ms": {kind: round(fit_step[kind] * 1e3, 3) for kind in kinds},
                **{
                    f"fit_speed_{kind}_over_replicated": round(
                        fit_step["replicated"] / fit_step[kind], 3
                    )
                    for kind in ("zero1", "zero2")
                },
                "zero1_equals_replicated_bitwise": all(
                    np.array_equal(a, b)
                    for a, b in zip(arrays["zero1"], arrays["replicated"], strict=True)
                ),
                "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "zero", "results": rows}, indent=2))


def _fitter(strategy, mlp, hidden, batch, shards):
    """For each kind, a function that runs one epoch of `Trainer.fit` (8 batches, Adam) and
    returns the seconds per step; the first epoch (compiling) runs here."""
    import numpy as np
    import optax
    from _models import synthetic_batches
    from flax import nnx

    data = synthetic_batches(batch, count=8, seed=1)
    x, y = np.concatenate([b[0] for b in data]), np.concatenate([b[1] for b in data])
    fits = {}
    for kind, shard in (("replicated", False), *shards.items()):
        with strategy.scope():
            trainer = mirrored.Trainer(
                mlp(hidden, rngs=nnx.Rngs(0)),
                optax.adam(1e-3),
                "sparse_categorical_crossentropy",
                from_logits=True,
                shard_optimizer_state=shard,
            )

        def epoch(trainer=trainer):
            start = time.perf_counter()
            trainer.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            return (time.perf_counter() - start) / len(data)

        epoch()
        fits[kind] = epoch
    return fits


if __name__ == "__main__":
    main()
