"""Keras-style training with mirrored.Trainer — copy this file to start.

Uses every local accelerator; where there is none, 8 simulated CPU devices.

    python examples/fit.py
"""

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

mirrored.simulate_cpu_devices(8)  # only affects the CPU backend; call before JAX work


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def main():
    digits = load_digits()  # ships inside scikit-learn: no download
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1440], y[:1440], x[1440:], y[1440:]

    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = MLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            from_logits=True,  # the model returns logits
        )
    trainer.fit(
        x_train,
        y_train,
        batch_size=128,  # GLOBAL: 16 per replica on 8 devices
        epochs=15,
        validation_split=0.1,
        callbacks=[mirrored.callbacks.EarlyStopping(monitor="val_loss", patience=3)],
    )
    results = trainer.evaluate(x_test, y_test)
    print(f"test loss: {results['loss']:.4f}")
    print(f"test accuracy: {results['accuracy']:.4f}")
    predictions = trainer.predict(x_test)  # (357, 10), in input order, no padding
    assert predictions.shape == (len(x_test), 10)


if __name__ == "__main__":
    main()
