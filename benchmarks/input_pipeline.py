"""Examples/second the input distributor delivers, and whether it ever starves a training step.

(a) the in-memory fast path (shuffled NumPy index gather on a background thread), (b) a Grain
per-record pipeline over the same arrays, (c) tf.data when installed — each delivering 784-float
rows at global batch 256 to the simulated devices; then the seed MLP's training throughput fed
by the fast path vs by pre-staged device arrays (ratio); then a custom loop of
`strategy.run_steps(steps=32)` over `iter(dataset)` (K batches gathered at once) vs over the
same batches one at a time (ratio). Prints JSON.

    python benchmarks/input_pipeline.py [--devices 8] [--rows 60000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import grain
    import jax
    import optax
    from _models import MLP, timed, train_step
    from flax import nnx

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, 784)).astype(np.float32)
    y = rng.integers(0, 10, args.rows).astype(np.int32)
    strategy = mirrored.MirroredStrategy(jax.devices()[: args.devices])

    def delivered(dist) -> float:
        """Examples/second over one epoch, every batch waited for on its devices."""
        best = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            last = None
            for batch in dist:
                last = batch
            jax.block_until_ready([leaf.global_value for leaf in jax.tree.leaves(last)])
            best.append(args.rows / (time.perf_counter() - start))
        return statistics.median(best)

    results: dict[str, object] = {"devices": args.devices, "global_batch": args.batch}
    fast = strategy.experimental_distribute_dataset(
        (x, y), batch_size=args.batch, shuffle=True, seed=0
    )
    results["fast_path_examples_per_s"] = round(delivered(fast))

    source = grain.MapDataset.source(list(range(args.rows))).shuffle(seed=0)
    per_record = source.map(lambda i: (x[i], y[i])).batch(args.batch)
    results["grain_per_record_examples_per_s"] = round(
        delivered(strategy.experimental_distribute_dataset(per_record))
    )
    try:
        import tensorflow as tf
    except ImportError:
        results["tf_data_examples_per_s"] = "tensorflow not installed"
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10_000, seed=0).batch(args.batch)
        results["tf_data_examples_per_s"] = round(
            delivered(strategy.experimental_distribute_dataset(ds))
        )
    print(json.dumps(results), file=sys.stderr, flush=True)

    # Issue 39: the input path alone (no compute), CPU seconds (all threads) and wall seconds
    # of one epoch: fit's per-batch path and its K-at-once chunks (steps_per_execution=32)
    # against a hand loop's input (per step: gather the batch's rows, device_put them).
    input_only = []
    for n in sorted({1, args.devices}):
        sub = mirrored.MirroredStrategy(jax.devices()[:n])
        data = sub.experimental_distribute_dataset((x, y), batch_size=args.batch, shuffle=True)
        order = np.random.default_rng(1).permutation(args.rows)

        def hand(sub=sub, order=order) -> None:
            last = None
            for start in range(0, args.rows, args.batch):
                rows = order[start : start + args.batch]
                last = jax.device_put((x[rows], y[rows]), sub._split)
            jax.block_until_ready(last)

        def per_batch(data=data) -> None:
            last = None
            for batch in data.epoch_iterator(1):  # only the last kept, as a training loop
                last = batch[0].global_value
            jax.block_until_ready(last)

        def chunked(data=data) -> None:
            last = None
            for chunk in data.epoch_chunks(1, 32):
                last = chunk.leaves
            jax.block_until_ready(last)

        costs = {}
        for name, run in {"hand": hand, "per_batch": per_batch, "chunks": chunked}.items():
            rounds = []
            for _ in range(args.repeats + 1):
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                rounds.append((time.process_time() - cpu, time.perf_counter() - wall))
            costs[name] = statistics.median(r[0] for r in rounds[1:])  # the first warms up
            costs[name + "_wall"] = statistics.median(r[1] for r in rounds[1:])
        row = {"devices": n, **{k: round(v, 4) for k, v in costs.items()}}
        row["per_batch_cpu_over_hand"] = round(costs["per_batch"] / costs["hand"], 3)
        row["chunks_cpu_over_hand"] = round(costs["chunks"] / costs["hand"], 3)
        input_only.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    results["input_only_epoch_seconds"] = input_only

    # Training fed by the fast path vs by batches already on the devices.

    training = []
    for n in sorted({1, args.devices}):
        sub = mirrored.MirroredStrategy(jax.devices()[:n])
        with sub.scope():
            model = MLP((128,), rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        steps = args.rows // args.batch
        feed = sub.experimental_distribute_dataset((x, y), batch_size=args.batch, shuffle=True)
        staged = list(
            sub.experimental_distribute_dataset((x[:4096], y[:4096]), batch_size=args.batch)
        )

        starved = []

        def fed(
            k: int, sub=sub, model=model, optimizer=optimizer, feed=feed, starved=starved
        ) -> object:
            loss = None
            batches = iter(feed)
            start = time.perf_counter()
            for i, (xb, yb) in enumerate(batches):
                if i == k:
                    break
                loss = sub.run(train_step, args=(model, optimizer, xb, yb))
            starved.append(batches.starved_s / (time.perf_counter() - start))
            return loss.global_value

        def prestaged(k: int, sub=sub, model=model, optimizer=optimizer, staged=staged) -> object:
            loss = None
            for i in range(k):
                xb, yb = staged[i % len(staged)]
                loss = sub.run(train_step, args=(model, optimizer, xb, yb))
            return loss.global_value

        fed_t, staged_t = [], []
        for _ in range(args.repeats):
            staged_t.append(timed(prestaged, steps, warmup=5))
            fed_t.append(timed(fed, steps, warmup=5))
        fed_eps = steps * args.batch / statistics.median(fed_t)
        staged_eps = steps * args.batch / statistics.median(staged_t)
        row = {
            "devices": n,
            "prestaged_examples_per_s": round(staged_eps),
            "fast_path_fed_examples_per_s": round(fed_eps),
            "ratio": round(fed_eps / staged_eps, 3),
            # Share of the fed loop spent waiting for a batch (0: input never starved a step;
            # the remaining gap is CPU the input copies take from XLA on a small host).
            "starved_fraction": round(statistics.median(starved), 4),
        }
        training.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    results["seed_mlp_training"] = training

    # A custom loop of strategy.run_steps(steps=32) over iter(dataset) of in-memory arrays:
    # K batches gathered at once (since 2026-12-07) vs one at a time through the prefetch
    # queue (`epoch_iterator`, the path before), alternating, one epoch per round.
    run_steps_rows = []
    for n in sorted({1, args.devices}):
        sub = mirrored.MirroredStrategy(jax.devices()[:n])
        with sub.scope():
            model = MLP((128,), rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        feed = sub.experimental_distribute_dataset((x, y), batch_size=args.batch, shuffle=True)

        def epoch(iterator, sub=sub, model=model, optimizer=optimizer) -> float:
            start, last = time.perf_counter(), None
            while (
                out := sub.run_steps(train_step, iterator, steps=32, args=(model, optimizer))
            ) is not None:
                last = out
            jax.block_until_ready(last)
            return time.perf_counter() - start

        times: dict[str, list[float]] = {"at_once": [], "one_at_a_time": []}
        for round_ in range(args.repeats + 1):
            at_once = epoch(iter(feed))
            one = epoch(feed.epoch_iterator(round_ + 1))
            if round_:  # the first compiles
                times["at_once"].append(at_once)
                times["one_at_a_time"].append(one)
        at_once_s = statistics.median(times["at_once"])
        one_s = statistics.median(times["one_at_a_time"])
        row = {
            "devices": n,
            "at_once_examples_per_s": round(args.rows / at_once_s),
            "one_at_a_time_examples_per_s": round(args.rows / one_s),
            "ratio": round(one_s / at_once_s, 3),
        }
        run_steps_rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    results["run_steps_over_arrays"] = run_steps_rows
    one_device = next(r for r in training if r["devices"] == 1)
    results["fast_path_vs_1_device_step_consumption"] = round(
        results["fast_path_examples_per_s"] / one_device["prestaged_examples_per_s"], 2
    )
    print(json.dumps({"benchmark": "input_pipeline", "results": results}, indent=2))


if __name__ == "__main__":
    main()
