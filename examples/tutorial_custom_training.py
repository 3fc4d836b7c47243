"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", ported to mirrored.

The tutorial (tensorflow/docs, site/en/tutorials/distribute/custom_training.ipynb) section by
section, with its names: the strategy, the input pipeline, `create_model()`, `compute_loss`
with L2 regularization, Keras-named metrics updated inside `strategy.run`, `train_step`,
`test_step`, checkpoints, restoring into a model outside any strategy, and iterating with
`iter`. Fashion-MNIST is replaced by scikit-learn's 8×8 digits upsampled to 28×28 (no
download); docs/tutorial-custom-training.md puts each section beside TensorFlow's.

    python examples/tutorial_custom_training.py [--epochs 3] [--checkpoint-dir DIR]
"""

import argparse
import tempfile
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

# Only affects the CPU backend, so harmless where GPUs are present. Must come before JAX work.
mirrored.simulate_cpu_devices(8)

# The tutorial's 64 per replica suits 60,000 images; 1,440 digits on 8 replicas need smaller
# batches to take enough steps per epoch.
BATCH_SIZE_PER_REPLICA = 8
EPOCHS = 3  # the tutorial trains 10 epochs on 60,000 images
L2 = 1e-5  # tf.keras.regularizers.L2(1e-5): 1e-5 * sum(kernel ** 2), on every kernel


# -- Download the Fashion MNIST dataset (here: the digits, 28×28) -------------------------------


def load_data():
    """The 1,797 digits as (N, 28, 28, 1) float32 images in [0, 1]: 1,440 train, 357 test.

    Each 8×8 image is upsampled 3× (24×24) and padded by 2 pixels, Fashion-MNIST's 28×28.
    """
    digits = load_digits()  # ships inside scikit-learn: no download
    images = np.kron(digits.images, np.ones((3, 3)))  # (N, 24, 24)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None]  # (N, 28, 28, 1)
    images = (images / np.float32(16)).astype(np.float32)  # digits' pixels are 0..16
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    return (images[:1440], labels[:1440]), (images[1440:], labels[1440:])


# -- Create the model ---------------------------------------------------------------------------


def max_pooling_2d(x):  # Keras' MaxPooling2D(): 2×2 windows, stride 2, 'valid'
    return nnx.max_pool(x, (2, 2), strides=(2, 2))


def flatten(x):
    return x.reshape(x.shape[0], -1)


def create_model(seed=0):
    """The tutorial's Keras Sequential model in NNX, with Keras' defaults spelled out.

    Keras' Conv2D pads 'valid' (NNX: 'SAME') and Keras initializes kernels glorot_uniform
    (NNX: lecun_normal); both are passed explicitly so that the shapes and the starting
    distribution are the tutorial's. 28×28 → 26 → 13 → 11 → 5: 5·5·64 features.
    """
    rngs = nnx.Rngs(seed)
    glorot = nnx.initializers.glorot_uniform()
    return nnx.Sequential(
        nnx.Conv(1, 32, (3, 3), padding="VALID", kernel_init=glorot, rngs=rngs),
        nnx.relu,
        max_pooling_2d,
        nnx.Conv(32, 64, (3, 3), padding="VALID", kernel_init=glorot, rngs=rngs),
        nnx.relu,
        max_pooling_2d,
        flatten,
        nnx.Linear(5 * 5 * 64, 64, kernel_init=glorot, rngs=rngs),
        nnx.relu,
        nnx.Linear(64, 10, kernel_init=glorot, rngs=rngs),
    )


def model_losses(model):
    """Keras' `model.losses`: the L2 penalty of every kernel (`kernel_regularizer`)."""
    return [
        L2 * jnp.sum(jnp.square(layer.kernel[...]))
        for _, layer in nnx.iter_graph(model)
        if isinstance(layer, nnx.Conv | nnx.Linear)
    ]


# -- Define the loss function -------------------------------------------------------------------

# Per-example losses, Keras' `reduction=NONE`: you do the reduction yourself.
loss_object = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)


def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)
    # ÷ the global batch's real examples: gradients are summed over replicas.
    loss = mirrored.compute_average_loss(per_example_loss)
    if model_losses:
        loss += mirrored.scale_regularization_loss(sum(model_losses))  # ÷ replicas
    return loss


# -- Training loop: the per-replica steps -------------------------------------------------------


def train_step(model, optimizer, train_accuracy, images, labels):
    """One replica's step. State (model, optimizer, metric) arrives as arguments."""

    def loss_fn(model):
        predictions = model(images)
        return compute_loss(labels, predictions, model_losses(model)), predictions

    (loss, predictions), gradients = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, gradients)  # apply_gradients: gradients already summed

    train_accuracy.update_state(labels, predictions)
    return loss


def test_step(model, test_loss, test_accuracy, images, labels):
    predictions = model(images)
    t_loss = loss_object(labels, predictions)

    test_loss.update_state(t_loss)
    test_accuracy.update_state(labels, predictions)


class Results(NamedTuple):
    """What `main` measured, for tests: per-epoch logs and the two evaluated models."""

    history: list[dict[str, float]]
    saved_epochs: list[int]
    test_accuracy: float
    restored_accuracy: float
    model: Any
    new_model: Any


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--checkpoint-dir", help="default: a new temporary directory")
    parser.add_argument(
        "--iterator-steps",
        type=int,
        default=0,
        help="then train this many more steps per epoch with iter()/next(), as the "
        "tutorial's 'Using iterators' section (0: skip it)",
    )
    args = parser.parse_args(argv)

    (train_images, train_labels), (test_images, test_labels) = load_data()

    # -- Create a strategy to distribute the variables and the graph ---------------------------
    # If the list of devices is not given, every local device is used.
    strategy = mirrored.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # -- Setup input pipeline ----------------------------------------------------------------
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    # Arrays plus the GLOBAL batch size; shuffle=True reshuffles the whole training set every
    # epoch (the tutorial's .shuffle(BUFFER_SIZE=len(train_images))). The last batch is
    # ragged: it is padded and masked, so each epoch holds every example exactly once.
    train_dist_dataset = strategy.experimental_distribute_dataset(
        (train_images, train_labels), batch_size=GLOBAL_BATCH_SIZE, shuffle=True, seed=0
    )
    test_dist_dataset = strategy.experimental_distribute_dataset(
        (test_images, test_labels), batch_size=GLOBAL_BATCH_SIZE
    )

    # Create a checkpoint directory to store the checkpoints.
    checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="training_checkpoints_")

    # -- Define the metrics to track loss and accuracy -----------------------------------------
    with strategy.scope():
        test_loss = mirrored.metrics.Mean(name="test_loss")

        train_accuracy = mirrored.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = mirrored.metrics.SparseCategoricalAccuracy(name="test_accuracy")

    # -- Training loop -------------------------------------------------------------------------
    # A model and an optimizer must be created under `strategy.scope`.
    with strategy.scope():
        model = create_model()

        # Keras' Adam(learning_rate=0.001) has epsilon=1e-7 (optax: 1e-8).
        optimizer = nnx.Optimizer(model, optax.adam(learning_rate=0.001, eps=1e-7), wrt=nnx.Param)

    # `run` replicates the computation and runs it on the distributed input; compiled once
    # per input signature, so no @tf.function. Model, optimizer and metrics are arguments.
    def distributed_train_step(dataset_inputs):
        images, labels = dataset_inputs
        per_replica_losses = strategy.run(
            train_step, args=(model, optimizer, train_accuracy, images, labels)
        )
        return strategy.reduce(mirrored.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        images, labels = dataset_inputs
        return strategy.run(test_step, args=(model, test_loss, test_accuracy, images, labels))

    history, saved_epochs = [], []
    for epoch in range(args.epochs):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:
            # tf.train.Checkpoint.save keeps every checkpoint: max_to_keep=None.
            mirrored.save_checkpoint(
                checkpoint_dir,
                model,
                optimizer,
                step=epoch + 1,
                max_to_keep=None,
                extras={"epoch": epoch + 1},
            )
            saved_epochs.append(epoch + 1)

        logs = {
            "loss": float(train_loss),
            "accuracy": float(train_accuracy.result()),
            "test_loss": float(test_loss.result()),
            "test_accuracy": float(test_accuracy.result()),
        }
        history.append(logs)
        template = "Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, Test Accuracy: {}"
        print(
            template.format(
                epoch + 1,
                logs["loss"],
                logs["accuracy"] * 100,
                logs["test_loss"],
                logs["test_accuracy"] * 100,
            )
        )

        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()

    # -- Restore the latest checkpoint and test ------------------------------------------------
    # A model checkpointed under a strategy restores with or without one: here, without.
    eval_accuracy = mirrored.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

    new_model = create_model()
    new_optimizer = nnx.Optimizer(new_model, optax.adam(learning_rate=0.001), wrt=nnx.Param)

    @nnx.jit
    def eval_step(model, eval_accuracy, images, labels):
        predictions = model(images)
        eval_accuracy(labels, predictions)

    path = mirrored.latest_checkpoint(checkpoint_dir)
    mirrored.restore_checkpoint(path, new_model, new_optimizer)
    print(f"restored {path} (after epoch {mirrored.checkpoint_extras(path)['epoch']})")

    for start in range(0, len(test_images), GLOBAL_BATCH_SIZE):
        images = test_images[start : start + GLOBAL_BATCH_SIZE]
        labels = test_labels[start : start + GLOBAL_BATCH_SIZE]
        eval_step(new_model, eval_accuracy, images, labels)

    restored_accuracy = float(eval_accuracy.result())
    print(f"Accuracy after restoring the saved model without strategy: {restored_accuracy * 100}")

    # -- Alternate ways of iterating over a dataset: using iterators ---------------------------
    for epoch in range(args.epochs if args.iterator_steps else 0):
        total_loss = 0.0
        num_batches = 0
        train_iter = iter(train_dist_dataset)

        for _ in range(args.iterator_steps):
            total_loss += distributed_train_step(next(train_iter))
            num_batches += 1
        average_train_loss = total_loss / num_batches

        template = "Epoch {}, Loss: {}, Accuracy: {}"
        print(
            template.format(
                epoch + 1, float(average_train_loss), float(train_accuracy.result()) * 100
            )
        )
        train_accuracy.reset_state()

    accuracy = history[-1]["test_accuracy"]
    print(f"test accuracy: {accuracy:.4f}")
    return Results(history, saved_epochs, accuracy, restored_accuracy, model, new_model)


if __name__ == "__main__":
    main()
