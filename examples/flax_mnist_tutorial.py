"""Flax's own MNIST tutorial (docs_nnx/mnist_tutorial.md), data-parallel with mirrored.

The tutorial as written, with the smallest diff: every changed line is marked `# mirrored:`.
Its CNN keeps BatchNorm and Dropout (randomness given at call time, as the tutorial does),
`nnx.MultiMetric` updated inside the `@nnx.jit` steps, and `nnx.view` train/eval models.
MNIST is replaced by scikit-learn's 8×8 digits upsampled to 28×28 (no download).

    python examples/flax_mnist_tutorial.py [--train-steps 300] [--eval-every 100]
"""

import argparse
from functools import partial

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored  # mirrored:

mirrored.simulate_cpu_devices(8)  # mirrored: 8 simulated devices where there is no accelerator

batch_size = 32  # mirrored: the GLOBAL batch, split over the replicas (4 each on 8)
learning_rate = 0.005
momentum = 0.9


def load_dataset(seed=0):
    """The digits as the tutorial's dicts: {'image': (N, 28, 28, 1) in [0, 1], 'label': (N,)}."""
    digits = load_digits()
    images = np.pad(np.kron(digits.images / 16.0, np.ones((3, 3))), ((0, 0), (2, 2), (2, 2)))
    images = images[..., None].astype(np.float32)
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], labels[order]
    train = {"image": images[:1440], "label": labels[:1440]}
    test = {"image": images[1440:], "label": labels[1440:]}
    return train, test


def batches(data, size, *, steps=None, seed=0):
    """The tutorial's `repeat().shuffle().batch(drop_remainder=True).take(steps)`."""
    rng = np.random.default_rng(seed)
    n = len(data["label"])
    out = []
    while steps is None or len(out) < steps:
        order = rng.permutation(n) if steps is not None else np.arange(n)
        for start in range(0, n - size + 1, size):
            index = order[start : start + size]
            out.append({k: v[index] for k, v in data.items()})
            if steps is not None and len(out) == steps:
                break
        if steps is None:
            break
    return out


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, rngs: nnx.Rngs, batch):
    logits = model(batch["image"], rngs)
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    )
    loss = mirrored.compute_average_loss(per_example)  # mirrored: ÷ GLOBAL batch, not .mean()
    return loss, (logits, per_example)  # mirrored: per-example losses for the metric


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs, batch):
    """Train for a single step."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (_loss, (logits, per_example)), grads = grad_fn(model, rngs, batch)
    # mirrored: the metric averages per-example losses (a replica's scalar loss is its share).
    metrics.update(loss=per_example, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    logits = model(batch["image"])
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    )
    metrics.update(loss=per_example, logits=logits, labels=batch["label"])  # In-place updates.


@nnx.jit
def pred_step(model: CNN, batch):
    logits = model(batch["image"])
    return logits.argmax(axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    args = parser.parse_args(argv)
    train_steps, eval_every = args.train_steps, args.eval_every

    train_data, test_data = load_dataset()
    strategy = mirrored.MirroredStrategy()  # mirrored:
    print(f"replicas: {strategy.num_replicas_in_sync}")
    # mirrored: the tutorial's batches, distributed (the test set's ragged tail is kept: exact)
    train_ds = strategy.experimental_distribute_dataset(
        batches(train_data, batch_size, steps=train_steps)
    )
    test_ds = strategy.experimental_distribute_dataset(
        [{k: v[i : i + 64] for k, v in test_data.items()} for i in range(0, 357, 64)]
    )

    with strategy.scope():  # mirrored: state created here is mirrored on every device
        model = CNN(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(learning_rate, momentum), wrt=nnx.Param)
        metrics = nnx.MultiMetric(
            accuracy=nnx.metrics.Accuracy(),
            loss=nnx.metrics.Average("loss"),
        )
        rngs = nnx.Rngs(0)
    train_model = nnx.view(model, deterministic=False, use_running_average=False)
    eval_model = nnx.view(model, deterministic=True, use_running_average=True)

    metrics_history = {"train_loss": [], "train_accuracy": [], "test_loss": [], "test_accuracy": []}
    for step, batch in enumerate(train_ds):
        # mirrored: strategy.run(step, args=...) instead of step(...)
        strategy.run(train_step, args=(train_model, optimizer, metrics, rngs, batch))

        if step > 0 and (step % eval_every == 0 or step == train_steps - 1):
            for metric, value in metrics.compute().items():
                metrics_history[f"train_{metric}"].append(float(value))
            metrics.reset()

            for test_batch in test_ds:
                strategy.run(eval_step, args=(eval_model, metrics, test_batch))  # mirrored:
            for metric, value in metrics.compute().items():
                metrics_history[f"test_{metric}"].append(float(value))
            metrics.reset()

            print(
                f"[train] step: {step}, "
                f"loss: {metrics_history['train_loss'][-1]:.4f}, "
                f"accuracy: {metrics_history['train_accuracy'][-1] * 100:.2f}"
            )
            print(
                f"[test] step: {step}, "
                f"loss: {metrics_history['test_loss'][-1]:.4f}, "
                f"accuracy: {metrics_history['test_accuracy'][-1] * 100:.2f}"
            )

    test_batch = next(iter(test_ds))
    pred = strategy.gather(strategy.run(pred_step, args=(eval_model, test_batch)), axis=0)
    print(f"first test predictions: {np.asarray(pred)[:10].tolist()}")
    print(f"test accuracy: {metrics_history['test_accuracy'][-1]:.4f}")
    return metrics_history


if __name__ == "__main__":
    main()
