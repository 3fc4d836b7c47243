"""Flax's MNIST tutorial step: as written on one device vs under `strategy.run`, in one process.

Rows: the tutorial's own `@nnx.jit` `train_step` called directly on one device (no mirrored);
the same step under `strategy.run` on 1 and on N replicas, `nnx.MultiMetric` updated inside the
step; and the workaround a user needed before Flax metrics worked inside `run` (return the
logits, update the metrics on the host after every step). Batches are pre-staged on the
devices; global batch 32 as in the tutorial. Prints JSON; ratio = examples/s / the tutorial's.

    python benchmarks/flax_tutorial.py [--devices 8] [--steps 150] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import mirrored

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flax_mnist_tutorial.py"


def _load_tutorial():
    spec = importlib.util.spec_from_file_location("flax_mnist_tutorial", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)  # shorter windows: ±10% noise
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import jax
    import optax
    from _models import timed
    from flax import nnx

    tutorial = _load_tutorial()
    train, _ = tutorial.load_dataset()
    host_batches = tutorial.batches(train, tutorial.batch_size, steps=4)
    batch = tutorial.batch_size

    def state():
        model = tutorial.CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        view = nnx.view(model, deterministic=False, use_running_average=False)
        return view, optimizer, metrics, nnx.Rngs(0)

    def run_direct(k, s, staged):
        for i in range(k):
            tutorial.train_step(*s, staged[i % len(staged)])
        return jax.tree.leaves(nnx.state(s[1]))

    runners = {}
    device = jax.devices()[0]
    with jax.default_device(device):
        direct = state()
    staged = [jax.device_put(b, device) for b in host_batches]
    runners["tutorial, 1 device (no mirrored)"] = (lambda k: run_direct(k, direct, staged), 1)

    @nnx.jit
    def logits_step(model, optimizer, rngs, batch):  # the workaround: metrics off the device
        grad_fn = nnx.value_and_grad(tutorial.loss_fn, has_aux=True)
        (_, (logits, per_example)), grads = grad_fn(model, rngs, batch)
        optimizer.update(model, grads)
        return logits, per_example

    for n in sorted({1, args.devices}):
        strategy = mirrored.MirroredStrategy(jax.devices()[:n])
        with strategy.scope():
            s = state()
        dist = list(strategy.experimental_distribute_dataset(host_batches))

        def run_mirrored(k, strategy=strategy, s=s, dist=dist):
            for i in range(k):
                strategy.run(tutorial.train_step, args=(*s, dist[i % len(dist)]))
            return jax.tree.leaves(nnx.state(s[1]))

        runners[f"strategy.run, {n} replica(s), metrics inside"] = (run_mirrored, n)
        if n == args.devices and n > 1:  # the workaround is about N replicas
            with strategy.scope():
                w = state()
            host = nnx.MultiMetric(
                accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
            )

            def run_workaround(k, strategy=strategy, w=w, dist=dist, host=host):
                for i in range(k):
                    b = dist[i % len(dist)]
                    logits, per_example = strategy.run(logits_step, args=(w[0], w[1], w[3], b))
                    host.update(
                        logits=strategy.gather(logits, 0),
                        labels=strategy.gather(b["label"], 0),
                        loss=strategy.gather(per_example, 0),
                    )
                return jax.tree.leaves(nnx.state(w[1]))

            runners[f"strategy.run, {n} replicas, metrics on the host"] = (run_workaround, n)

    times: dict[str, list[float]] = {name: [] for name in runners}
    # One device's rows first, then N replicas': on 2 cores, the threads of 8 simulated
    # devices linger after a step and slowed the next one-device row by ~5%. Within each
    # phase the rows are interleaved, so drift hits them alike.
    for phase in (1, args.devices) if args.devices > 1 else (1,):
        for _ in range(args.repeats):
            for name, (run, n) in runners.items():
                if (n == 1) == (phase == 1):
                    times[name].append(timed(run, args.steps, warmup=3))
    baseline = args.steps * batch / statistics.median(times[next(iter(runners))])
    rows = []
    for name, (_, n) in runners.items():
        eps = args.steps * batch / statistics.median(times[name])
        rows.append(
            {
                "row": name,
                "replicas": n,
                "examples_per_s": round(eps, 1),
                "ratio": round(eps / baseline, 3),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "benchmark": "flax_tutorial",
                "backend": jax.default_backend(),
                "global_batch": batch,
                "results": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
