"""The seeds' TensorFlow custom loop, on Keras 3 + mirrored: `tf.keras` → `keras`, and the
GradientTape block → `mirrored.keras.value_and_grad`. Every other line is TensorFlow's.

A Sequential 128-relu/10 with Adam and SparseCategoricalCrossentropy(from_logits=True),
built inside the strategy's scope; a distributed dataset of global batches of 64; the step
captures `model`, `optimizer` and `loss_fn` as TensorFlow's tutorials do; the per-replica
losses are combined with `strategy.reduce("SUM")`. Data: scikit-learn's 8×8 digits (no
download). The last batch of each epoch is ragged (1,440 = 22 × 64 + 32): exact anyway.

    python examples/keras_custom_loop.py [--epochs 5]
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before the first `import keras`

import keras
import numpy as np
from sklearn.datasets import load_digits

import mirrored

mirrored.simulate_cpu_devices(8)  # CPU only; harmless where GPUs are present
GLOBAL_BATCH_SIZE = 64


def load_data():
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    (x_train, y_train), (x_test, y_test) = load_data()

    strategy = mirrored.MirroredStrategy()  # tf.distribute.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
        )
        optimizer = keras.optimizers.Adam()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    batches = [
        (x_train[i : i + GLOBAL_BATCH_SIZE], y_train[i : i + GLOBAL_BATCH_SIZE])
        for i in range(0, len(x_train), GLOBAL_BATCH_SIZE)
    ]
    dist_dataset = strategy.experimental_distribute_dataset(batches)

    def train_step(inputs, labels):
        def compute_loss():  # what the GradientTape block held
            logits = model(inputs, training=True)
            return loss_fn(labels, logits)

        loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for epoch in range(args.epochs):
        total, steps = 0.0, 0
        for batch_inputs, batch_labels in dist_dataset:
            per_replica_loss = strategy.run(train_step, args=(batch_inputs, batch_labels))
            total += float(strategy.reduce("SUM", per_replica_loss, axis=None))
            steps += 1
        print(f"Epoch {epoch + 1}, loss: {total / steps:.4f}")

    accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
    print(f"Test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
