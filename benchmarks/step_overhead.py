"""Examples/second of a `strategy.run` training loop vs a hand-written plain-JAX step.

Both loops train the same model on the same pre-staged device batches with Adam, in the same
process, with the same in-flight bound (mirrored's default: 2 steps with several replicas,
none with one). Prints JSON; ratio = mirrored / plain JAX.

    python benchmarks/step_overhead.py [--devices 8] [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="seed_mlp,wide_mlp")
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import jax
    import optax
    from _models import (
        MLP,
        MODELS,
        plain_jax_step,
        run_bounded,
        synthetic_batches,
        timed,
        train_step,
    )
    from flax import nnx

    results = []
    for name in args.models.split(","):
        hidden, batch = MODELS[name]
        steps = args.steps if name == "seed_mlp" else max(20, args.steps // 10)
        for n in sorted({1, args.devices}):
            devices = jax.devices()[:n]
            host_batches = synthetic_batches(batch)

            # plain JAX
            step, params, opt_state, data_sharding = plain_jax_step(devices, hidden)
            staged = [tuple(jax.device_put(a, data_sharding) for a in b) for b in host_batches]
            plain = {"params": params, "opt": opt_state}

            def run_plain(k: int, plain=plain, staged=staged, step=step, n=n) -> object:
                def once(i: int) -> object:
                    x, y = staged[i % len(staged)]
                    plain["params"], plain["opt"], loss = step(plain["params"], plain["opt"], x, y)
                    return loss

                return run_bounded(k, once, n)

            # mirrored
            strategy = mirrored.MirroredStrategy(devices)
            with strategy.scope():
                model = MLP(hidden, rngs=nnx.Rngs(0))
                optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
            dist = list(strategy.experimental_distribute_dataset(host_batches))

            def run_mirrored(
                k: int,
                model=model,
                optimizer=optimizer,
                dist=dist,
                strategy=strategy,
                train_step=train_step,
            ) -> object:
                loss = None
                for i in range(k):
                    x, y = dist[i % len(dist)]
                    loss = strategy.run(train_step, args=(model, optimizer, x, y))
                return loss.global_value

            plain_t, ours_t = [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                plain_t.append(timed(run_plain, steps, warmup=5))
                ours_t.append(timed(run_mirrored, steps, warmup=5))
            plain_eps = steps * batch / statistics.median(plain_t)
            ours_eps = steps * batch / statistics.median(ours_t)
            row = {
                "model": name,
                "devices": n,
                "global_batch": batch,
                "plain_jax_examples_per_s": round(plain_eps),
                "mirrored_run_examples_per_s": round(ours_eps),
                "ratio": round(ours_eps / plain_eps, 3),
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {"benchmark": "step_overhead", "backend": jax.default_backend(), "results": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
