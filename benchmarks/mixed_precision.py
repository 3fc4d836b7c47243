"""Step throughput of the wide MLP under float32 vs mixed_bfloat16 (and mixed_float16).

`Trainer.fit` on batches already on the device(s), Adam; prints JSON with the ratio to
float32. On CPUs bfloat16 matmuls are emulated, so expect no gain there; on GPUs/TPUs expect
one.

    python benchmarks/mixed_precision.py [--devices 1] [--steps 10]
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
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="float32,mixed_bfloat16,mixed_float16")
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(max(args.devices, 1))

    import jax
    import optax
    from _models import MLP, MODELS, synthetic_batches
    from flax import nnx

    hidden, batch = MODELS["wide_mlp"]
    devices = jax.devices()[: args.devices]
    strategy = mirrored.MirroredStrategy(devices)
    placed = list(strategy.experimental_distribute_dataset(synthetic_batches(batch, count=4)))
    epoch = [placed[i % len(placed)] for i in range(args.steps)]
    trainers = {}
    for policy in args.policies.split(","):
        with strategy.scope():
            trainers[policy] = mirrored.Trainer(
                MLP(hidden, rngs=nnx.Rngs(0)),
                optax.adam(1e-3),
                "sparse_categorical_crossentropy",
                from_logits=True,
                policy=policy,
            )
        trainers[policy].fit(epoch[:2], verbose=0)  # compile
    times: dict[str, list[float]] = {p: [] for p in trainers}
    for _ in range(args.repeats):
        for policy, trainer in trainers.items():
            start = time.perf_counter()
            trainer.fit(epoch, verbose=0)
            times[policy].append(time.perf_counter() - start)
    eps = {p: args.steps * batch / statistics.median(t) for p, t in times.items()}
    result = {
        "benchmark": "mixed_precision",
        "model": "wide_mlp",
        "backend": jax.default_backend(),
        "devices": len(devices),
        "examples_per_s": {p: round(v) for p, v in eps.items()},
        "ratio_to_float32": {p: round(v / eps["float32"], 3) for p, v in eps.items()},
    }
    print(json.dumps(result), file=sys.stderr)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
