"""Examples/second of `Trainer.fit` vs a `strategy.run` loop vs a hand-written plain-JAX step.

Same model, data and Adam in one process, 1 and N simulated devices. `fit` runs with loss
tracking (exact global sums, read once per epoch) on (a) batches already on the devices, like
the other two, (b) in-memory arrays through the input fast path with `steps_per_execution=1`,
(c) the same arrays with `steps_per_execution=K` (K steps per compiled program, one dispatch
per K; the arrays kept on the devices, and again (d) read from the host, K batches gathered
at once), and (e) the default `steps_per_execution="auto"` after a warm-up fit long enough
for it to build its K-step program; and `evaluate` over the same arrays, one step per program
against "auto" (after a warm-up evaluate that builds its K-step program). Prints JSON;
ratios are against plain JAX (its batches already on the devices), and the `*_over_hand`
ratios against a hand-written plain-JAX loop fed from the same NumPy arrays (issue 39's
bar: per step it shuffles, gathers the batch rows, `device_put`s them and calls the step,
two steps in flight), with the noise band: the spread of the hand loop's own rounds.

    python benchmarks/fit_throughput.py [--devices 8] [--steps 200] [--steps-per-execution 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import mirrored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default="seed_mlp,wide_mlp")
    parser.add_argument("--steps-per-execution", type=int, default=32)
    parser.add_argument("--auto-warmup-epochs", type=int, default=20)
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

            hand_step, hand_params, hand_opt, hand_sharding = plain_jax_step(devices, hidden)
            hand = {"params": hand_params, "opt": hand_opt, "epoch": 0}

            def run_hand(
                hand=hand, step=hand_step, x=x_all, y=y_all, batch=batch, n=n, to=hand_sharding
            ) -> float:
                """The hand loop from NumPy arrays, one shuffled epoch (as fit's default)."""
                start = time.perf_counter()
                hand["epoch"] += 1
                order = np.random.default_rng(hand["epoch"]).permutation(len(x))

                def once(index: int) -> object:
                    rows = order[index * batch : (index + 1) * batch]
                    xb, yb = jax.device_put(x[rows], to), jax.device_put(y[rows], to)
                    hand["params"], hand["opt"], loss = step(hand["params"], hand["opt"], xb, yb)
                    return loss

                jax.block_until_ready(run_bounded(len(x) // batch, once, n))
                return time.perf_counter() - start

            strategy = mirrored.MirroredStrategy(devices)
            with strategy.scope():
                model = MLP(hidden, rngs=nnx.Rngs(0))
                trainer = mirrored.Trainer(
                    model,
                    optax.adam(1e-3),
                    "sparse_categorical_crossentropy",
                    from_logits=True,
                    steps_per_execution=1,
                )
                auto = mirrored.Trainer(  # steps_per_execution="auto", the default
                    MLP(hidden, rngs=nnx.Rngs(0)),
                    optax.adam(1e-3),
                    "sparse_categorical_crossentropy",
                    from_logits=True,
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

            def run_fit_multi(
                trainer=multi, x=x_all, y=y_all, batch=batch, keep=str(2**30)
            ) -> float:
                # The arrays kept on the devices (the default on accelerators; asked for here).
                os.environ["MIRRORED_DEVICE_DATA_BYTES"] = keep
                try:
                    return run_fit_arrays(trainer, x, y, batch)
                finally:
                    del os.environ["MIRRORED_DEVICE_DATA_BYTES"]

            def run_fit_multi_host(trainer=multi, x=x_all, y=y_all, batch=batch) -> float:
                # Nothing kept on the devices (the default on CPU; several processes, data
                # over the budget): each execution's K batches gathered on the host at once.
                return run_fit_multi(trainer, x, y, batch, keep="0")

            def run_fit_auto(trainer=auto, x=x_all, y=y_all, batch=batch) -> float:
                return run_fit_arrays(trainer, x, y, batch)

            def run_evaluate(trainer=trainer, x=x_all, y=y_all, batch=batch) -> float:
                start = time.perf_counter()
                trainer.evaluate(x, y, batch_size=batch)
                return time.perf_counter() - start

            def run_evaluate_auto(trainer=auto, x=x_all, y=y_all, batch=batch) -> float:
                return run_evaluate(trainer, x, y, batch)

            # A training run long enough for "auto" to build its K-step program (it does when
            # the steps left take 10x the first step's compile); later fits reuse it.
            auto.fit(x_all, y_all, batch_size=batch, epochs=args.auto_warmup_epochs, verbose=0)
            chosen = [m.built for m in auto._auto_measured.values()]
            auto.evaluate(x_all, y_all, batch_size=batch)  # measures, builds its K program
            chosen_eval = [m.built for k, m in auto._auto_measured.items() if not k[0]]

            runs = {
                "plain": run_plain,
                "hand": run_hand,
                "loop": run_loop,
                "fit": run_fit_placed,
                "fit_arrays": run_fit_arrays,
                "fit_multi": run_fit_multi,
                "fit_multi_host": run_fit_multi_host,
                "fit_auto": run_fit_auto,
                "evaluate": run_evaluate,
                "evaluate_auto": run_evaluate_auto,
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
                "hand_loop_examples_per_s": round(eps["hand"]),
                "fit_from_arrays_over_hand": round(eps["fit_arrays"] / eps["hand"], 3),
                "fit_multi_step_over_hand": round(eps["fit_multi"] / eps["hand"], 3),
                "fit_multi_step_from_host_over_hand": round(eps["fit_multi_host"] / eps["hand"], 3),
                "fit_auto_over_hand": round(eps["fit_auto"] / eps["hand"], 3),
                "auto_chose_steps_per_execution": chosen,
                "evaluate_auto_over_one_step": round(eps["evaluate_auto"] / eps["evaluate"], 3),
                "evaluate_auto_chose": chosen_eval,
                "hand_noise_band": [
                    round(min(times["hand"]) / statistics.median(times["hand"]) - 1, 3),
                    round(max(times["hand"]) / statistics.median(times["hand"]) - 1, 3),
                ],
                "rounds": args.repeats,
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "fit_throughput", "results": results}, indent=2))


if __name__ == "__main__":
    main()
