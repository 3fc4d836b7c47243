"""TensorFlow's tutorial "Distributed training with Keras", ported to mirrored.

The tutorial (tensorflow/docs, site/en/tutorials/distribute/keras.ipynb) section by section,
with its names: the strategy, the input pipeline, the model created in `strategy.scope()` and
compiled (here: a `mirrored.Trainer`), the callbacks (TensorBoard, ModelCheckpoint,
LearningRateScheduler with `decay`, and `PrintLR`), `fit`, restoring the latest checkpoint,
and loading the saved model without and with a strategy. MNIST is replaced by scikit-learn's
8×8 digits upsampled to 28×28 (no download); docs/tutorial-keras.md puts each section beside
TensorFlow's.

    python examples/tutorial_keras.py [--epochs 12] [--dir DIR]
"""

import argparse
import os
import pathlib
import tempfile
from typing import NamedTuple

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

# Only affects the CPU backend, so harmless where GPUs are present. Must come before JAX work.
mirrored.simulate_cpu_devices(8)

# The tutorial's 64 per replica suits 60,000 images; 1,440 digits on 8 replicas need smaller
# batches to take enough steps per epoch (23 here).
BATCH_SIZE_PER_REPLICA = 8
EPOCHS = 12  # as the tutorial: decay() changes the rate after epochs 3 and 7


# -- Download the dataset (here: the digits, 28×28) ---------------------------------------------


def load_data():
    """The 1,797 digits as (N, 28, 28, 1) float32 images in [0, 1]: 1,440 train, 357 test.

    Each 8×8 image is upsampled 3× (24×24) and padded by 2 pixels to MNIST's 28×28. The
    digits' pixels are 0..16, so dividing by 16 is the tutorial's `scale` (÷ 255 for MNIST).
    """
    digits = load_digits()  # ships inside scikit-learn: no download
    images = np.kron(digits.images, np.ones((3, 3)))  # (N, 24, 24)
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)))[..., None]  # (N, 28, 28, 1)
    images = (images / np.float32(16)).astype(np.float32)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    return (images[:1440], labels[:1440]), (images[1440:], labels[1440:])


# -- Create the model -------------------------------------------------------------------------


def max_pooling_2d(x):  # Keras' MaxPooling2D(): 2×2 windows, stride = pool size, 'valid'
    return nnx.max_pool(x, (2, 2), strides=(2, 2))


def flatten(x):
    return x.reshape(x.shape[0], -1)


def create_model(seed=0):
    """The tutorial's Keras Sequential model in NNX, with Keras' defaults spelled out.

    Keras' Conv2D pads 'valid' (NNX: 'SAME') and Keras initializes kernels glorot_uniform
    (NNX: lecun_normal); both are passed explicitly so that the shapes and the starting
    distribution are the tutorial's. 28×28 → 26×26 → 13×13: 13·13·32 features.
    """
    rngs = nnx.Rngs(seed)
    glorot = nnx.initializers.glorot_uniform()
    return nnx.Sequential(
        nnx.Conv(1, 32, (3, 3), padding="VALID", kernel_init=glorot, rngs=rngs),
        nnx.relu,
        max_pooling_2d,
        flatten,
        nnx.Linear(13 * 13 * 32, 64, kernel_init=glorot, rngs=rngs),
        nnx.relu,
        nnx.Linear(64, 10, kernel_init=glorot, rngs=rngs),
    )


def compile_model(model):
    """`model.compile(...)`: the Trainer holds the loss, the optimizer and the metrics.

    The optimizer keeps its learning rate in its state (`optax.inject_hyperparams`), where
    LearningRateScheduler can change it between epochs without recompiling; a plain
    `optax.adam(1e-3)` compiles the rate in as a constant. Keras' Adam has epsilon=1e-7
    (optax: 1e-8). The Trainer uses the strategy whose scope it is created in (outside any
    scope: the default strategy, one device).
    """
    return mirrored.Trainer(
        model,
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-3, eps=1e-7),
        loss="sparse_categorical_crossentropy",
        from_logits=True,  # tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        metrics=["accuracy"],
    )


# -- Define the callbacks -----------------------------------------------------------------------


# Define a function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    else:
        return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(mirrored.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        # `self.model` is the Trainer (Keras: the model, whose optimizer owns the rate);
        # `learning_rate` reads the float32 rate in the optimizer state, as a Python float.
        print(f"\nLearning rate for epoch {epoch + 1} is {self.model.learning_rate}")


class Results(NamedTuple):
    """What `main` measured, for tests."""

    history: mirrored.callbacks.History
    trained: dict[str, float]  # evaluate() right after fit (not in the tutorial)
    restored: dict[str, float]  # after restoring the latest checkpoint
    unreplicated: dict[str, float]  # the saved model, loaded without a strategy
    replicated: dict[str, float]  # the saved model, loaded in strategy.scope()
    checkpoint_dir: str
    log_dir: str
    model_path: str


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--dir", help="where checkpoints, logs and the saved model go (default: a new temp dir)"
    )
    args = parser.parse_args(argv)
    work_dir = args.dir or tempfile.mkdtemp(prefix="tutorial_keras_")

    (train_images, train_labels), (test_images, test_labels) = load_data()

    # -- Define the distribution strategy ------------------------------------------------------
    strategy = mirrored.MirroredStrategy()
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    # -- Set up the input pipeline -------------------------------------------------------------
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync

    # No tf.data: the images are already scaled and in memory (the tutorial's .map(scale)
    # and .cache()). shuffle=True reshuffles the whole training set every epoch, seeded: the
    # tutorial's .shuffle(BUFFER_SIZE) with a buffer as large as the data. On 8 replicas the
    # last batch is ragged (1,440 = 22 × 64 + 32): padded and masked, so every image counts
    # exactly once.
    train_dataset = strategy.experimental_distribute_dataset(
        (train_images, train_labels), batch_size=BATCH_SIZE, shuffle=True, seed=0
    )
    # `.batch(BATCH_SIZE)` of the test set: a re-iterable list of global (x, y) batches, not
    # yet placed on devices, so any Trainer (any strategy) can evaluate it, as eval_dataset
    # is evaluated by three models in the tutorial.
    eval_dataset = [
        (test_images[i : i + BATCH_SIZE], test_labels[i : i + BATCH_SIZE])
        for i in range(0, len(test_images), BATCH_SIZE)
    ]

    # -- Create the model and instantiate the optimizer ----------------------------------------
    with strategy.scope():
        model = create_model()
        trainer = compile_model(model)

    # -- Define the callbacks ------------------------------------------------------------------
    # Define the checkpoint directory to store the checkpoints.
    checkpoint_dir = os.path.join(work_dir, "training_checkpoints")
    # Define the name of the checkpoint files: one Orbax checkpoint directory per epoch
    # (ckpt_0001, ckpt_0002, ...), as Keras writes one ckpt_{epoch:04d}.weights.h5 per epoch.
    checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}")
    log_dir = os.path.join(work_dir, "logs")

    # Put all the callbacks together.
    callbacks = [
        mirrored.callbacks.TensorBoard(log_dir=log_dir),
        mirrored.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
        mirrored.callbacks.LearningRateScheduler(decay),
        PrintLR(),
    ]

    # -- Train and evaluate --------------------------------------------------------------------
    history = trainer.fit(train_dataset, epochs=args.epochs, callbacks=callbacks)
    # Not in the tutorial: what the restored checkpoint must reproduce.
    trained = trainer.evaluate(eval_dataset)

    # Check the checkpoint directory (the tutorial's `!ls {checkpoint_dir}`).
    print(" ".join(sorted(os.listdir(checkpoint_dir))))

    # Load the latest checkpoint and evaluate on the test data. As the tutorial, pick the
    # newest per-epoch checkpoint by name; restore_checkpoint reads the newest complete save
    # in it. With save_weights_only=True it holds the model's variables, not the optimizer.
    latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob("*"))[-1]
    step = mirrored.restore_checkpoint(latest_checkpoint, model)  # the epoch it was saved at
    print(f"Restored {latest_checkpoint.name} (epoch {step})")

    restored = trainer.evaluate(eval_dataset)
    eval_loss, eval_acc = restored["loss"], restored["accuracy"]
    print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

    # The tutorial's `%tensorboard --logdir=logs` and `!ls -sh ./logs`: the event files are
    # in log_dir/train (no validation/ without validation data); view them with
    # `tensorboard --logdir <log_dir>`.
    print(" ".join(sorted(os.listdir(log_dir))))

    # -- Save the model ------------------------------------------------------------------------
    # An NNX model is Python code plus variables: there is no `.keras` archive of the
    # architecture. Save the variables (atomically, with Orbax); `create_model` is the
    # architecture a loader rebuilds them into.
    path = os.path.join(work_dir, "my_model")
    mirrored.save_checkpoint(path, model)

    # Now, load the model without Strategy.scope: the variables land on one device.
    unreplicated_model = create_model()
    mirrored.restore_checkpoint(path, unreplicated_model)

    unreplicated_trainer = compile_model(unreplicated_model)
    unreplicated = unreplicated_trainer.evaluate(eval_dataset)
    eval_loss, eval_acc = unreplicated["loss"], unreplicated["accuracy"]
    print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

    # Load the model with Strategy.scope: the variables are mirrored on every replica.
    with strategy.scope():
        replicated_model = create_model()
        mirrored.restore_checkpoint(path, replicated_model)
        replicated_trainer = compile_model(replicated_model)

        replicated = replicated_trainer.evaluate(eval_dataset)
        eval_loss, eval_acc = replicated["loss"], replicated["accuracy"]
        print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

    print(f"test accuracy: {restored['accuracy']:.4f}")
    return Results(
        history, trained, restored, unreplicated, replicated, checkpoint_dir, log_dir, path
    )


if __name__ == "__main__":
    main()
