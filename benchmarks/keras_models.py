"""Keras 3 on mirrored vs Keras' own DataParallel vs mirrored's NNX path, in one process.

The seed MLP (784-128-10, global batch 256, Adam) at 1 and N devices. Rows, examples/s of an
epoch of `steps` batches from NumPy arrays (after a warm-up epoch; repeats interleaved):
- `keras fit, mirrored`: Keras' own `model.fit`, model compiled in `strategy.scope()`;
- `keras fit, DataParallel`: the same model under `keras.distribution.DataParallel` on the
  same devices (Keras' native data parallelism on JAX);
- `nnx Trainer.fit`: mirrored's NNX `Trainer` on the same model in Flax;
- `keras custom loop` / `nnx custom loop`: `strategy.run` over pre-distributed batches,
  TensorFlow's loop with the Keras model captured vs the NNX step taking it as arguments;
  and the Keras loop as `strategy.run_steps` of K steps a program over `iter(dataset)` of the
  same arrays (K batches gathered at once), against the loop over batches already placed.
Ratios: Keras fit (mirrored) / DataParallel and / NNX Trainer; Keras loop / NNX loop.

    python benchmarks/keras_models.py [--devices 8] [--steps 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import mirrored


def _seeds_step(model, optimizer, loss_fn):
    """TensorFlow's train_step with the tape block as mirrored.keras.value_and_grad."""

    def train_step(inputs, labels):
        def compute_loss():
            return loss_fn(labels, model(inputs, training=True))

        loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps-per-execution", type=int, default=32)
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import jax
    import keras
    import numpy as np
    import optax
    from _models import MLP, synthetic_batches, train_step
    from flax import nnx

    batch = 256
    host = synthetic_batches(batch, count=args.steps)
    x = np.concatenate([b[0] for b in host])
    y = np.concatenate([b[1] for b in host])

    spe = args.steps_per_execution

    def keras_model(steps_per_execution=1):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
        return model

    def timed_fit(fit):
        def run() -> float:
            start = time.perf_counter()
            fit()
            return time.perf_counter() - start

        return run

    results = []
    for n in sorted({1, args.devices}):
        devices = jax.devices()[:n]
        runners = {}
        strategy = mirrored.MirroredStrategy(devices)
        for k, tag in ((1, ""), (spe, f" spe={spe}")):
            with strategy.scope():
                ours = keras_model(k)
            runners[f"keras fit{tag}, mirrored"] = timed_fit(
                lambda m=ours: m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            )
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
            try:
                native = keras_model(k)
            finally:
                keras.distribution.set_distribution(None)

            def fit_native(m=native, devices=devices):
                keras.distribution.set_distribution(
                    keras.distribution.DataParallel(devices=devices)
                )
                try:
                    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
                finally:
                    keras.distribution.set_distribution(None)

            runners[f"keras fit{tag}, DataParallel"] = timed_fit(fit_native)
        with strategy.scope():
            trainer = mirrored.Trainer(
                MLP((128,), rngs=nnx.Rngs(0)),
                optax.adam(1e-3),
                "sparse_categorical_crossentropy",
                from_logits=True,
            )
        runners["nnx Trainer.fit"] = timed_fit(
            lambda t=trainer: t.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        )
        placed = list(strategy.experimental_distribute_dataset(host))
        with strategy.scope():
            loop_model = keras_model()
            loop_optimizer = keras.optimizers.Adam(1e-3)
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        keras_step = _seeds_step(loop_model, loop_optimizer, loss_fn)

        def keras_loop(strategy=strategy, placed=placed, step=keras_step):
            for inputs, labels in placed:
                loss = strategy.run(step, args=(inputs, labels))
            jax.block_until_ready(loss.global_value)

        def nnx_loop(strategy=strategy, placed=placed, trainer=trainer):
            for inputs, labels in placed:
                loss = strategy.run(
                    train_step, args=(trainer.model, trainer.optimizer, inputs, labels)
                )
            jax.block_until_ready(loss.global_value)

        with strategy.scope():
            steps_model = keras_model()
            steps_optimizer = keras.optimizers.Adam(1e-3)
        steps_step = _seeds_step(steps_model, steps_optimizer, loss_fn)

        arrays = strategy.experimental_distribute_dataset((x, y), batch_size=batch)

        def keras_steps(strategy=strategy, arrays=arrays, step=steps_step):
            iterator = iter(arrays)  # the same arrays, K batches gathered at once on the host
            while (out := strategy.run_steps(step, iterator, steps=spe)) is not None:
                loss = out
            jax.block_until_ready(loss.global_value)

        runners["keras custom loop"] = timed_fit(keras_loop)
        runners[f"keras custom loop run_steps={spe}"] = timed_fit(keras_steps)
        runners["nnx custom loop"] = timed_fit(nnx_loop)
        for run in runners.values():
            run()  # warm-up: compile
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.repeats):
            for name, run in runners.items():
                times[name].append(run())
        eps = {name: args.steps * batch / statistics.median(t) for name, t in times.items()}
        row = {
            "model": "seed_mlp",
            "devices": n,
            "global_batch": batch,
            **{f"{name} examples/s": round(v) for name, v in eps.items()},
            "keras_fit_vs_data_parallel": round(
                eps["keras fit, mirrored"] / eps["keras fit, DataParallel"], 3
            ),
            f"keras_fit_spe{spe}_vs_data_parallel_spe{spe}": round(
                eps[f"keras fit spe={spe}, mirrored"] / eps[f"keras fit spe={spe}, DataParallel"],
                3,
            ),
            f"keras_fit_spe{spe}_vs_spe1": round(
                eps[f"keras fit spe={spe}, mirrored"] / eps["keras fit, mirrored"], 3
            ),
            "keras_fit_vs_nnx_trainer": round(
                eps["keras fit, mirrored"] / eps["nnx Trainer.fit"], 3
            ),
            "keras_loop_vs_nnx_loop": round(eps["keras custom loop"] / eps["nnx custom loop"], 3),
            f"keras_run_steps{spe}_vs_keras_loop": round(
                eps[f"keras custom loop run_steps={spe}"] / eps["keras custom loop"], 3
            ),
        }
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "keras_models", "results": results}, indent=2))


if __name__ == "__main__":
    main()
