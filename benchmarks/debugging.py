"""What the debugging modes cost: a `strategy.run` step with `mirrored.debug.
enable_check_numerics()` and with `mirrored.config.run_functions_eagerly(True)`, against the
same compiled, unchecked step, in one process (seed MLP 784-128-10, batch 256, and wide MLP
784-2048-2048-10, batch 512; Adam, batches on the devices). Prints JSON; ratio = mode /
compiled (examples per second).

    python benchmarks/debugging.py [--devices 8] [--steps 200] [--eager-steps 5] [--repeats 3]
                                   [--models seed_mlp,wide_mlp]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eager-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="seed_mlp,wide_mlp")
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)
    logging.getLogger("mirrored").setLevel(logging.ERROR)  # the eager mode's warning

    import jax
    import optax
    from _models import MLP, MODELS, synthetic_batches, timed, train_step
    from flax import nnx

    results = []
    for name, n in [(m, n) for m in args.models.split(",") for n in sorted({1, args.devices})]:
        hidden, batch = MODELS[name]
        steps = args.steps if name == "seed_mlp" else max(10, args.steps // 10)
        strategy = mirrored.MirroredStrategy(jax.devices()[:n])
        with strategy.scope():
            model = MLP(hidden, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        placed = list(strategy.experimental_distribute_dataset(synthetic_batches(batch)))

        def run(
            k: int, model=model, optimizer=optimizer, placed=placed, strategy=strategy
        ) -> object:
            loss = None
            for i in range(k):
                x, y = placed[i % len(placed)]
                loss = strategy.run(train_step, args=(model, optimizer, x, y))
            return loss.global_value

        def rate(steps: int, warmup: int, run=run, batch=batch) -> float:
            seconds = statistics.median(
                timed(run, steps, warmup=warmup) for _ in range(args.repeats)
            )
            return steps * batch / seconds

        compiled = rate(steps, 5)
        mirrored.debug.enable_check_numerics()
        checked = rate(steps, 5)
        mirrored.debug.disable_check_numerics()
        eager = float("nan")  # --eager-steps 0: not measured
        if args.eager_steps:
            mirrored.config.run_functions_eagerly(True)
            eager = rate(args.eager_steps, 2)
            mirrored.config.run_functions_eagerly(False)
        row = {
            "model": name,
            "devices": n,
            "global_batch": batch,
            "compiled_examples_per_s": round(compiled),
            "check_numerics_examples_per_s": round(checked),
            "check_numerics_ratio": round(checked / compiled, 3),
            "eager_examples_per_s": round(eager, 1),
            "eager_ratio": round(eager / compiled, 5),
            "eager_slowdown": round(compiled / eager, 1),
        }
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "debugging", "results": results}, indent=2))


if __name__ == "__main__":
    main()
