"""A worker of a multi-worker Keras job, started by test_keras through `mirrored launch`.

    python _mw_keras_script.py OUT_DIR

Keras `fit` (ragged last batch; one step per program and `steps_per_execution=4`) and the
seeds' custom loop under MultiWorkerMirroredStrategy;
the chief writes the weights and losses to OUT_DIR/result.npz.
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import mirrored

# First: starts jax.distributed (imported by a test instead, the test sets its own strategy).
strategy = mirrored.MultiWorkerMirroredStrategy() if __name__ == "__main__" else None

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402


def model_fn():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )


def compiled_in_scope(steps_per_execution=1):
    with strategy.scope():
        model = model_fn()
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=steps_per_execution,
        )
    return model


def main(out=None):
    out = out or sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)  # every worker holds the same arrays, as with tf.keras
    x = rng.normal(size=(525, 20)).astype("float32")
    y = rng.integers(0, 10, 525).astype("int32")
    model = compiled_in_scope()
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    evaluation = model.evaluate(x, y, batch_size=64, verbose=0)
    # compile(steps_per_execution=4): each process places its batches, K steps one program.
    fused = compiled_in_scope(steps_per_execution=4)
    fused_history = fused.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history

    with strategy.scope():
        loop_model = model_fn()
        optimizer = keras.optimizers.SGD(0.1)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(inputs, labels):
        def compute_loss():
            return loss_fn(labels, loop_model(inputs, training=True))

        loss, grads = mirrored.keras.value_and_grad(compute_loss, loop_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, loop_model.trainable_variables, strict=True))
        return loss

    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(320, 525, 64)]  # ends ragged
    losses = []
    for inputs, labels in strategy.experimental_distribute_dataset(batches):
        per_replica = strategy.run(train_step, args=(inputs, labels))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    # Unseeded (Keras' default initializers: each process draws its own values), as
    # TensorFlow's multi-worker tutorial is written: the first step takes the chief's values.
    rank = jax.process_index()
    keras.utils.set_random_seed(1000 + rank)  # what no seed gives: each process its own draws
    with strategy.scope():
        unseeded = keras.Sequential([keras.Input((20,)), keras.layers.Dense(10)])
        unseeded.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    unseeded.fit(x, np.eye(10, dtype="float32")[y], batch_size=64, epochs=1, verbose=0)
    weights = unseeded.get_weights()
    np.savez(os.path.join(out, f"unseeded.{rank}.npz"), *weights)
    if getattr(strategy, "is_chief", True):
        arrays = {f"fit/{i}": w for i, w in enumerate(model.get_weights())}
        arrays.update({f"loop/{i}": w for i, w in enumerate(loop_model.get_weights())})
        arrays.update({f"fit_k4/{i}": w for i, w in enumerate(fused.get_weights())})
        np.savez(
            os.path.join(out, "result.npz"),
            loss=np.asarray(history["loss"]),
            accuracy=np.asarray(history["accuracy"]),
            fit_k4_loss=np.asarray(fused_history["loss"]),
            evaluation=np.asarray(evaluation),
            loop_losses=np.asarray(losses),
            **arrays,
        )
    print(f"[keras] replicas {strategy.num_replicas_in_sync} processes {jax.process_count()}")


if __name__ == "__main__":
    main()
