"""keras-io's guide "Multi-GPU distributed training with JAX", ported to mirrored.

The guide trains a Keras 3 model with a functional step: `model.stateless_call` inside
`jax.value_and_grad`, `optimizer.stateless_apply`, and the state (trainable, non-trainable and
optimizer arrays) passed in and returned by a `jax.jit` step whose batch is sharded by hand
(`Mesh`, `NamedSharding`, `jax.device_put`). Here the same functions, with the guide's names,
run under `strategy.run`: the mesh and the shardings go, the batch comes from a distributed
dataset (ragged last batches included), and the loss is averaged over the global batch.
MNIST is replaced by scikit-learn's 8×8 digits (no download); docs/coming-from-keras-jax.md
puts each part beside the guide's.

    python examples/keras_jax_guide.py [--epochs 4] [--one-device]
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before the first `import keras`

import jax
import keras
import numpy as np
from sklearn.datasets import load_digits

import mirrored

mirrored.simulate_cpu_devices(8)  # CPU only; harmless where GPUs are present
BATCH_SIZE = 64
LEARNING_RATE = 1e-2  # the guide: 1e-3 for 60,000 MNIST images; 1,440 digits take fewer steps
MOMENTUM = 0.9  # BatchNormalization; the guide keeps 0.99, which needs its ~1,900 steps


def get_model(*, synchronized=False, dropout=0.5):
    """The guide's convolutional model on 8×8 digits. `synchronized=True` computes the batch
    statistics over the global batch (the guide's `jax.jit` over one sharded batch does);
    by default each replica normalises with its own rows, as TensorFlow's MirroredStrategy."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Rescaling(1.0 / 16.0)(inputs)
    x = keras.layers.Conv2D(filters=12, kernel_size=3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization(
        scale=False, center=True, momentum=MOMENTUM, synchronized=synchronized
    )(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters=24, kernel_size=3, use_bias=False, strides=2)(x)
    x = keras.layers.BatchNormalization(
        scale=False, center=True, momentum=MOMENTUM, synchronized=synchronized
    )(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    if dropout:
        x = keras.layers.Dropout(dropout)(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def get_datasets():
    """The digits as (N, 8, 8, 1) images with values 0..16: 1,440 to train, 357 to evaluate."""
    digits = load_digits()
    x = digits.images.astype("float32")[..., None]
    y = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1440], y[:1440]), (x[1440:], y[1440:])


def functional_step(model, optimizer, loss):
    """The guide's `compute_loss`, `compute_gradients` and `train_step`, as written."""

    def compute_loss(trainable_variables, non_trainable_variables, x, y):
        y_pred, updated_non_trainable_variables = model.stateless_call(
            trainable_variables, non_trainable_variables, x, training=True
        )
        loss_value = loss(y, y_pred)
        return loss_value, updated_non_trainable_variables

    compute_gradients = jax.value_and_grad(compute_loss, has_aux=True)

    def train_step(train_state, x, y):
        trainable_variables, non_trainable_variables, optimizer_variables = train_state
        (loss_value, non_trainable_variables), grads = compute_gradients(
            trainable_variables, non_trainable_variables, x, y
        )
        trainable_variables, optimizer_variables = optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )
        return loss_value, (trainable_variables, non_trainable_variables, optimizer_variables)

    return train_step


def train(x, y, *, epochs, strategy=None, **model_options):
    """The guide's loop: on `strategy` (mirrored), or with `strategy=None` on one device with
    `jax.jit`, as the guide runs it on a mesh of one. Returns (model, per-epoch losses)."""
    scope = strategy.scope() if strategy is not None else keras.name_scope("one_device")
    with scope:
        model = get_model(**model_options)
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        # Initialize all state with .build()
        model.build((None, 8, 8, 1))
        optimizer.build(model.trainable_variables)
    train_step = functional_step(model, optimizer, loss)
    # The guide's train state: the variables' own arrays (mirrored already: made in the scope).
    train_state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    batches = [(x[i : i + BATCH_SIZE], y[i : i + BATCH_SIZE]) for i in range(0, len(x), BATCH_SIZE)]
    if strategy is None:
        step = jax.jit(train_step)
    else:
        dataset = strategy.experimental_distribute_dataset(batches)

        def step(train_state, x, y):
            loss_value, train_state = strategy.run(train_step, args=(train_state, x, y))
            return strategy.reduce("SUM", loss_value, axis=None), train_state

    losses = []
    for epoch in range(epochs):
        for x_batch, y_batch in batches if strategy is None else dataset:
            loss_value, train_state = step(train_state, x_batch, y_batch)
        losses.append(float(loss_value))
        print("Epoch", epoch, "loss:", losses[-1])
    # Post-processing model state update to write them back into the model
    trainable_variables, non_trainable_variables, optimizer_variables = train_state
    for variable, value in zip(model.trainable_variables, trainable_variables, strict=True):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable_variables, strict=True):
        if isinstance(value, mirrored.PerReplica):  # BatchNorm's moving statistics, per replica
            value = strategy.reduce("MEAN", value, axis=None)  # read as TensorFlow's ON_READ
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_variables, strict=True):
        variable.assign(value)
    return model, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--one-device", action="store_true", help="the guide's jax.jit loop")
    args = parser.parse_args(argv)
    (x_train, y_train), (x_test, y_test) = get_datasets()
    strategy = None if args.one_device else mirrored.MirroredStrategy()
    if strategy is not None:
        print(f"Number of devices: {strategy.num_replicas_in_sync}")
    model, losses = train(x_train, y_train, epochs=args.epochs, strategy=strategy)
    accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
    print(f"test accuracy: {accuracy:.4f}")
    return losses, accuracy


if __name__ == "__main__":
    main()
