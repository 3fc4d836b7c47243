"""TensorFlow's tutorial "Multi-worker training with a custom training loop", ported to mirrored.

The tutorial's `main.py` (tensorflow/docs, site/en/tutorials/distribute/
multi_worker_with_ctl.ipynb), with its names: the cluster from `TF_CONFIG`, a per-worker
dataset from `distribute_datasets_from_function`, the CNN with L2 regularization, RMSprop, a
`train_step` that takes the iterator, and a checkpoint of the model, `epoch` and
`step_in_epoch` to resume from. MNIST is replaced by scikit-learn's 8×8 digits upsampled to
28×28 (no download). Start one process per worker, each with the same cluster and its own
task index:

    export TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
                       "task": {"type": "worker", "index": 0}}'      # index 1 for the second
    python examples/tutorial_multi_worker_custom_training.py --checkpoint-dir /shared/ckpt

Run again with the same --checkpoint-dir and it resumes after the last finished epoch.
Without TF_CONFIG it trains as a single worker. docs/tutorial-multi-worker.md puts each part
beside TensorFlow's.
"""

import argparse
import os
import tempfile

# As the tutorial hides the GPUs (CUDA_VISIBLE_DEVICES=-1): workers that share one machine
# must not share its accelerators. Drop this line where every worker has a machine of its own.
os.environ["JAX_PLATFORMS"] = "cpu"

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

per_worker_batch_size = 64
num_epochs = 3
# The tutorial's 70 steps are part of one pass over 30,000 images per worker; 14 steps of 64
# per worker cover 896 of a worker's 898 or 899 digits.
num_steps_per_epoch = 14
L2 = 1e-5  # tf.keras.regularizers.L2(1e-5): 1e-5 * sum(kernel ** 2), on every kernel


# -- mnist.py: dataset and model definition -----------------------------------------------------


def mnist_dataset():
    """All 1,797 digits as (N, 28, 28) float32 images in [0, 1] and int32 labels.

    The tutorial's MNIST arrays are (N, 28, 28) too; the model adds the channel axis.
    """
    digits = load_digits()  # ships inside scikit-learn: no download
    x_train = np.kron(digits.images, np.ones((3, 3)))  # 8×8 → 24×24
    x_train = np.pad(x_train, ((0, 0), (2, 2), (2, 2)))  # → 28×28
    x_train = (x_train / np.float32(16)).astype(np.float32)
    # int32, not the tutorial's int64: JAX computes in 32 bits unless x64 is enabled.
    y_train = digits.target.astype(np.int32)
    return x_train, y_train


class ShuffledBatches:
    """Per-replica batches in a new order every epoch: tf.data's `.shuffle(...).batch(...)`.

    The order is seeded by the epoch, which mirrored passes to `set_epoch` before each pass
    (PyTorch's DistributedSampler convention): a relaunched worker that resumes at epoch 1
    reads epoch 1's order. Counting passes instead, it would replay the first run's orders.
    """

    def __init__(self, x, y, batch_size, *, seed):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            yield self.x[rows], self.y[rows]


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    x_train, y_train = mnist_dataset()
    # dataset.shard(num_input_pipelines, input_pipeline_id): every n-th example, from the id.
    # Sharded before shuffling, as tf.data's shard() documentation asks: the tutorial
    # shuffles first, unseeded, so its workers' shards can overlap.
    x_train = x_train[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    y_train = y_train[input_context.input_pipeline_id :: input_context.num_input_pipelines]
    return ShuffledBatches(x_train, y_train, batch_size, seed=input_context.input_pipeline_id)


def build_cnn_model(seed=0):
    """The tutorial's Keras model in NNX: Reshape, Conv2D(32, 3), Flatten, Dense(128), Dense(10).

    Keras' Conv2D pads 'valid' (NNX: 'SAME') and Keras initializes kernels glorot_uniform
    (NNX: lecun_normal); both are passed explicitly. 28×28 → 26×26×32 features.
    """
    rngs = nnx.Rngs(seed)
    glorot = nnx.initializers.glorot_uniform()
    return nnx.Sequential(
        reshape_to_28_28_1,
        nnx.Conv(1, 32, (3, 3), padding="VALID", kernel_init=glorot, rngs=rngs),
        nnx.relu,
        flatten,
        nnx.Linear(26 * 26 * 32, 128, kernel_init=glorot, rngs=rngs),
        nnx.relu,
        nnx.Linear(128, 10, kernel_init=glorot, rngs=rngs),
    )


def reshape_to_28_28_1(x):  # tf.keras.layers.Reshape(target_shape=(28, 28, 1))
    return x.reshape(x.shape[0], 28, 28, 1)


def flatten(x):
    return x.reshape(x.shape[0], -1)


def model_losses(model):
    """Keras' `model.losses`: the L2 penalty of every kernel (`kernel_regularizer`)."""
    return [
        L2 * jnp.sum(jnp.square(layer.kernel[...]))
        for _, layer in nnx.iter_graph(model)
        if isinstance(layer, nnx.Conv | nnx.Linear)
    ]


# -- main.py: the per-replica step --------------------------------------------------------------

# Per-example losses, Keras' `reduction=NONE`.
loss_object = mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)


def step_fn(model, optimizer, train_accuracy, x, y):
    """Per-replica step function. State (model, optimizer, metric) arrives as arguments.

    Module-level, not nested in train_step as in the tutorial: strategy.run compiles once per
    function object, and a function defined inside train_step is a new object every step.
    """

    def loss_fn(model):
        predictions = model(x)
        per_example_loss = loss_object(y, predictions)
        loss = mirrored.compute_average_loss(per_example_loss)
        losses = model_losses(model)
        if losses:
            loss += mirrored.scale_regularization_loss(sum(losses))
        return loss, predictions

    (loss, predictions), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)  # apply_gradients: grads are already summed over replicas
    train_accuracy.update_state(y, predictions)
    return loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--checkpoint-dir",
        default=os.path.join(tempfile.gettempdir(), "mirrored_multi_worker_ctl_ckpt"),
        help="a directory every worker can read (the chief writes it)",
    )
    parser.add_argument("--num-epochs", type=int, default=num_epochs)
    parser.add_argument("--num-steps-per-epoch", type=int, default=num_steps_per_epoch)
    parser.add_argument(
        "--devices-per-worker",
        type=int,
        default=1,
        help="CPU devices to simulate in each worker (the tutorial: 1, the CPU)",
    )
    args = parser.parse_args(argv)

    mirrored.simulate_cpu_devices(args.devices_per_worker)
    # Reads TF_CONFIG (mirrored.TFConfigClusterResolver) and starts JAX's distributed runtime
    # before any JAX computation, as TensorFlow starts its servers here. Without TF_CONFIG it
    # is a single worker.
    strategy = mirrored.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    num_workers = resolver.num_processes  # the tutorial: len(tf_config["cluster"]["worker"])
    global_batch_size = per_worker_batch_size * num_workers

    with strategy.scope():
        # Model building needs to be within `strategy.scope()`.
        multi_worker_model = build_cnn_model()

        multi_worker_dataset = strategy.distribute_datasets_from_function(
            lambda input_context: dataset_fn(global_batch_size, input_context)
        )
        # Keras' RMSprop(learning_rate=0.001): rho=0.9, epsilon=1e-7 inside the square root,
        # which optax.rmsprop's decay and eps (eps_in_sqrt=True) are.
        optimizer = nnx.Optimizer(
            multi_worker_model,
            optax.rmsprop(learning_rate=0.001, decay=0.9, eps=1e-7),
            wrt=nnx.Param,
        )
        train_accuracy = mirrored.metrics.SparseCategoricalAccuracy(name="train_accuracy")

    def train_step(iterator):
        """Training step function: the next batch, every replica's step, the summed loss."""
        x, y = next(iterator)  # outside run: run takes batches, not iterators
        per_replica_losses = strategy.run(
            step_fn, args=(multi_worker_model, optimizer, train_accuracy, x, y)
        )
        return strategy.reduce(mirrored.ReduceOp.SUM, per_replica_losses, axis=None)

    # -- Checkpoint saving and restoring -----------------------------------------------------
    # No _is_chief / write_filepath here: every worker calls save_checkpoint, and only the
    # chief (process 0: the "chief" task, else worker 0, the tutorial's _is_chief rule)
    # writes. Saving reads each worker's own copy of the mirrored state, so it needs no
    # collective and cannot deadlock; no worker writes to a temporary path to delete.
    epoch = 0
    step_in_epoch = 0
    checkpoint_dir = args.checkpoint_dir

    latest_checkpoint = mirrored.latest_checkpoint(checkpoint_dir)
    if latest_checkpoint:
        # The tutorial's tf.train.Checkpoint(model=..., epoch=..., step_in_epoch=...): the
        # model and the counters, not the optimizer (pass `optimizer` to both calls to
        # resume RMSprop's state too).
        mirrored.restore_checkpoint(latest_checkpoint, multi_worker_model)
        extras = mirrored.checkpoint_extras(latest_checkpoint)
        epoch, step_in_epoch = extras["epoch"], extras["step_in_epoch"]
        print(f"Restored {latest_checkpoint}: epoch {epoch}, step_in_epoch {step_in_epoch}.")

    # Resume our CTL training
    while epoch < args.num_epochs:
        # The tutorial's iter(multi_worker_dataset) numbers epochs by this process' passes;
        # a resumed run asks for the epoch it is in (1-based), and reads its order.
        iterator = iter(multi_worker_dataset.epoch_iterator(epoch + 1))
        total_loss = 0.0
        num_batches = 0

        while step_in_epoch < args.num_steps_per_epoch:
            total_loss += train_step(iterator)
            num_batches += 1
            step_in_epoch += 1

        train_loss = total_loss / num_batches
        accuracy = float(train_accuracy.result())
        print(f"Epoch: {epoch:d}, accuracy: {accuracy:f}, train_loss: {float(train_loss):f}.")

        train_accuracy.reset_state()

        epoch += 1
        step_in_epoch = 0
        # Saved after the counters advance (the tutorial saves before, so a restored
        # step_in_epoch equals num_steps_per_epoch and the resumed epoch takes no step).
        # max_to_keep=1 as the tutorial's CheckpointManager.
        mirrored.save_checkpoint(
            checkpoint_dir,
            multi_worker_model,
            step=epoch,
            max_to_keep=1,
            extras={"epoch": epoch, "step_in_epoch": step_in_epoch},
        )


if __name__ == "__main__":
    main()
