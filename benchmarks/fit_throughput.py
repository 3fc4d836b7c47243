"""Examples/second of `Trainer.fit` vs a `strategy.run` loop vs a hand-written plain-JAX step.

Same model, data and Adam in one process, 1 and N simulated devices. `fit` runs with loss
tracking (exact global sums, read once per epoch) on (a) batches already on the devices, like
the other two, (b) in-memory arrays through the input fast path, and (c) the same arrays with
`steps_per_execution=K` (K steps per compiled program, one dispatch per K). Prints JSON;
ratios are against plain JAX (its batches already on the devices).

    python benchmarks/fit_throughput.py [--devices 8] [--steps 200] [--steps-per-execution 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="seed_mlp,wide_mlp")
    parser.add_argument("--steps-per-execution", type=int, default=32)
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from _models import MLP, MODELS, plain_jax_step, run_bounded, synthetic_batches, train_step
    from flax import nnx

    results = []
    for name in args.models.split(","):
        hidden, batch = MODELS[name]
        steps = args.steps if name == "seed_mlp" else max(20, args.steps // 10)
        host = synthetic_batches(batch, count=steps)
        x_all = np.concatenate([b[0] for b in host])
        y_all = np.concatenate([b[1] for b in host])
        for n in sorted({1, args.devices}):
            devices = jax.devices()[:n]
            step, params, opt_state, data_sharding = plain_jax_step(devices, hidden)
            staged = [tuple(jax.device_put(a, data_sharding) for a in b) for b in host[:8]]
            plain = {"params": params, "opt": opt_state}

            def run_plain(plain=plain, staged=staged, step=step, steps=steps, n=n) -> float:
                def once(index: int) -> object:
                    x, y = staged[index % len(staged)]
                    plain["params"], plain["opt"], loss = step(plain["params"], plain["opt"], x, y)
                    return loss

                start = time.perf_counter()
                jax.block_until_ready(run_bounded(steps, once, n))
                return time.perf_counter() - start

            strategy = mirrored.MirroredStrategy(devices)
            with strategy.scope():
                model = MLP(hidden, rngs=nnx.Rngs(0))
                trainer = mirrored.Trainer(
                    model, optax.adam(1e-3), "sparse_categorical_crossentropy", from_logits=True
                )
            placed = list(strategy.experimental_distribute_dataset(host[:8]))
            placed_epoch = [placed[i % len(placed)] for i in range(steps)]

            def run_loop(strategy=strategy, trainer=trainer, placed=placed_epoch) -> float:
                start = time.perf_counter()
                for x, y in placed:
                    loss = strategy.run(train_step, args=(trainer.model, trainer.optimizer, x, y))
                jax.block_until_ready(loss.global_value)
                return time.perf_counter() - start

            def run_fit_placed(trainer=trainer, placed=placed_epoch) -> float:
                start = time.perf_counter()
                trainer.fit(placed, epochs=1, verbose=0)  # reads the loss at epoch end: a sync
                return time.perf_counter() - start

            def run_fit_arrays(trainer=trainer, x=x_all, y=y_all, batch=batch) -> float:
                start = time.perf_counter()
                trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0)
                return time.perf_counter() - start

            with strategy.scope():
                multi = mirrored.Trainer(
                    MLP(hidden, rngs=nnx.Rngs(0)),
                    optax.adam(1e-3),
                    "sparse_categorical_crossentropy",
                    from_logits=True,
                    steps_per_execution=args.steps_per_execution,
                )

            def run_fit_multi(trainer=multi, x=x_all, y=y_all, batch=batch) -> float:
                return run_fit_arrays(trainer, x, y, batch)

            runs = {
                "plain": run_plain,
                "loop": run_loop,
                "fit": run_fit_placed,
                "fit_arrays": run_fit_arrays,
                "fit_multi": run_fit_multi,
            }
            for warm in runs.values():
                warm()
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.repeats):  # interleaved, so drift hits all alike
                for key, run in runs.items():
                    times[key].append(run())
            eps = {k: steps * batch / statistics.median(v) for k, v in times.items()}
            row = {
                "model": name,
                "devices": n,
                "global_batch": batch,
                "plain_jax_examples_per_s": round(eps["plain"]),
                "run_loop_examples_per_s": round(eps["loop"]),
                "fit_examples_per_s": round(eps["fit"]),
                "fit_from_arrays_examples_per_s": round(eps["fit_arrays"]),
                "run_loop_ratio": round(eps["loop"] / eps["plain"], 3),
                "fit_ratio": round(eps["fit"] / eps["plain"], 3),
                "fit_from_arrays_ratio": round(eps["fit_arrays"] / eps["plain"], 3),
                "steps_per_execution": args.steps_per_execution,
                "fit_from_arrays_multi_step_examples_per_s": round(eps["fit_multi"]),
                "fit_from_arrays_multi_step_ratio": round(eps["fit_multi"] / eps["plain"], 3),
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "fit_throughput", "results": results}, indent=2))


if __name__ == "__main__":
    main()
