"""Checks that need a real accelerator, for `benchmarks/gpu.sh` (the suite runs on simulated
CPU devices): training on the GPUs equals training on one of them, bfloat16 mixed precision
trains, K steps in one program equal K steps, and the all-reduce is NCCL's on the devices.

    python benchmarks/gpu_checks.py [--allow-cpu]

Prints JSON with one entry per check (`ok`, numbers); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--allow-cpu", action="store_true", help="Run on CPU devices (a dry run).")
    args = parser.parse_args()
    if args.allow_cpu:
        mirrored.simulate_cpu_devices(2)  # a dry run still has replicas to compare
    import jax
    import numpy as np
    import optax
    from _models import MLP, train_step
    from flax import nnx

    devices = jax.devices()
    platform = devices[0].platform
    if platform == "cpu" and not args.allow_cpu:
        sys.exit(
            "error: expected an accelerator; found only CPU devices. Fix: install the CUDA "
            "extra (pip install -e '.[cuda]'), or pass --allow-cpu for a dry run."
        )
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(64, 784)).astype(np.float32), rng.integers(0, 10, 64)) for _ in range(3)
    ]
    batches.append((batches[0][0][:37], batches[0][1][:37]))  # a ragged last batch

    def train(subset: list[Any], tx: Any, steps_per_program: int = 1) -> Any:
        strategy = mirrored.MirroredStrategy(subset)
        with strategy.scope():
            model = MLP((128,), rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        iterator = iter(strategy.experimental_distribute_dataset(batches))
        if steps_per_program == 1:
            for x, y in iterator:
                strategy.run(train_step, args=(model, optimizer, x, y))
        else:
            while (
                strategy.run_steps(
                    train_step, iterator, steps=steps_per_program, args=(model, optimizer)
                )
                is not None
            ):
                pass
        return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))

    def difference(a: Any, b: Any) -> float:
        return max(
            float(np.max(np.abs(u - v))) for u, v in zip(*map(jax.tree.leaves, (a, b)), strict=True)
        )

    checks: dict[str, Any] = {"platform": platform, "devices": [str(d) for d in devices]}
    one = train(devices[:1], optax.sgd(0.1))
    all_devices = train(devices, optax.sgd(0.1))
    checks["replicas_equal_one_device"] = {
        "replicas": len(devices),
        "max_abs_difference": difference(one, all_devices),
        "ok": difference(one, all_devices) <= 1e-5,
    }
    scanned = train(devices, optax.adam(1e-3), steps_per_program=2)
    stepped = train(devices, optax.adam(1e-3))
    checks["run_steps_equal_steps"] = {
        "max_abs_difference": difference(scanned, stepped),
        "ok": difference(scanned, stepped) <= 1e-6,
    }
    strategy = mirrored.MirroredStrategy(devices)
    x = np.concatenate([b[0] for b in batches[:3]])
    y = np.concatenate([b[1] for b in batches[:3]])
    with strategy.scope():
        trainer = mirrored.Trainer(
            MLP((128,), rngs=nnx.Rngs(0)),
            optax.adam(1e-3),
            "sparse_categorical_crossentropy",
            from_logits=True,
            policy="mixed_bfloat16",
        )
    start = time.perf_counter()
    losses = trainer.fit(x, y, batch_size=64, epochs=3, verbose=0).history["loss"]
    checks["mixed_bfloat16_fit"] = {
        "losses": losses,
        "seconds": time.perf_counter() - start,
        "ok": bool(np.all(np.isfinite(losses)) and losses[-1] < losses[0]),
    }
    first = next(iter(strategy.experimental_distribute_dataset(batches)))
    program = strategy._runner.lowered(
        train_step, (trainer.model, trainer.optimizer, *first), {}
    ).compile()
    checks["all_reduce_in_program"] = {
        "ok": len(devices) == 1 or "all-reduce" in program.as_text(),
        "replicas": len(devices),
    }
    checks["ok"] = all(c["ok"] for c in checks.values() if isinstance(c, dict))
    print(json.dumps({"benchmark": "gpu_checks", **checks}, indent=2))
    if not checks["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
