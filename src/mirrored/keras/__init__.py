"""Keras 3 models on mirrored (JAX backend): `tf.keras` code with `tf.keras` → `keras`.

Imported on demand (`import mirrored` never imports Keras); installed automatically when a
script imports Keras with the JAX backend. Inside `strategy.scope()` Keras variables are
mirrored on the strategy's devices; `model.fit` / `evaluate` / `predict` of a model created
or compiled there train data-parallel; and `strategy.run` finds the Keras objects a step
captures, as TensorFlow's custom loops are written:

    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dense(10)])
        optimizer = keras.optimizers.Adam()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(inputs, labels):
        def compute_loss():
            return loss_fn(labels, model(inputs, training=True))
        loss, grads = mirrored.keras.value_and_grad(compute_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for x, y in strategy.experimental_distribute_dataset(batches):
        loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)), axis=None)
"""

from __future__ import annotations

from mirrored.keras._bridge import keras_backend_error

_error = keras_backend_error()
if _error is not None:
    raise _error

from mirrored.keras import _install  # noqa: E402
from mirrored.keras._grad import value_and_grad  # noqa: E402

_install.install()

__all__ = ["value_and_grad"]
