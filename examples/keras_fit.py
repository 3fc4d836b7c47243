"""Keras' own `model.fit` on mirrored: TensorFlow's MirroredStrategy + Keras code with
`tf.keras` → `keras` and `tf.distribute` → `mirrored`.

The model, optimizer and metrics are created and compiled inside `strategy.scope()`, so
their variables are mirrored on every device; `fit` splits each global batch of 64 over the
replicas (the last one ragged: exact), with Keras' callbacks, progress bar and History.
Data: scikit-learn's 8×8 digits (no download).

    python examples/keras_fit.py [--epochs 5] [--checkpoint-dir DIR]
"""

import argparse
import os
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")  # before the first `import keras`

import keras
import numpy as np
from sklearn.datasets import load_digits

import mirrored

mirrored.simulate_cpu_devices(8)  # CPU only; harmless where GPUs are present


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
    parser.add_argument("--checkpoint-dir", default=None)
    args = parser.parse_args(argv)
    (x_train, y_train), (x_test, y_test) = load_data()
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="keras-fit-")

    strategy = mirrored.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dropout(0.1),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(checkpoint_dir, "ckpt.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=3),
    ]
    history = model.fit(
        x_train,
        y_train,
        batch_size=64,  # GLOBAL: 8 per replica on 8 devices
        epochs=args.epochs,
        validation_split=0.1,
        callbacks=callbacks,
        verbose=2,
    )
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
    print(f"Test loss: {loss:.4f}, test accuracy: {accuracy:.4f}")
    path = os.path.join(checkpoint_dir, "model.keras")
    model.save(path)
    restored = keras.models.load_model(path)  # outside any strategy: one device
    same = np.allclose(
        restored.predict(x_test, verbose=0), model.predict(x_test, verbose=0), atol=1e-5
    )
    print(f"Restored outside the strategy, same predictions: {same}")
    return history.history, accuracy


if __name__ == "__main__":
    main()
