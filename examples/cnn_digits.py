"""A CNN with BatchNorm and Dropout, trained on 8 replicas — copy this file to start.

The model of TensorFlow's "Custom training with tf.distribute.Strategy" tutorial (Conv,
MaxPool, Dense), with BatchNorm and Dropout, on scikit-learn's 8×8 digits (no download).
Trains with a custom loop (`strategy.run`) or with `Trainer.fit`; `--sync-bn` uses
`mirrored.layers.SyncBatchNorm` (global-batch statistics, TensorFlow's synchronized=True);
`--checkpoint-dir` saves every epoch and resumes from the newest checkpoint there.

    python examples/cnn_digits.py [--loop custom|fit] [--epochs 12] [--sync-bn]
                                  [--checkpoint-dir DIR]
    mirrored doctor --devices 8 --step examples/cnn_digits.py:doctor_step
"""

import argparse

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

mirrored.simulate_cpu_devices(8)  # only affects the CPU backend; call before JAX work

GLOBAL_BATCH_SIZE = 64  # 8 per replica on 8 devices


class CNN(nnx.Module):
    def __init__(self, *, sync_bn: bool = False, dropout: float = 0.3, rngs: nnx.Rngs):
        norm = mirrored.layers.SyncBatchNorm if sync_bn else nnx.BatchNorm
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.bn1 = norm(32, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (3, 3), rngs=rngs)
        self.bn2 = norm(64, momentum=0.9, rngs=rngs)
        self.dense = nnx.Linear(2 * 2 * 64, 64, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):  # x: (batch, 8, 8, 1)
        x = nnx.max_pool(jax.nn.relu(self.bn1(self.conv1(x))), (2, 2), strides=(2, 2))
        x = nnx.max_pool(jax.nn.relu(self.bn2(self.conv2(x))), (2, 2), strides=(2, 2))
        x = self.dropout(jax.nn.relu(self.dense(x.reshape(x.shape[0], -1))))
        return self.out(x)


def load_data():
    """The 1,797 digits as (N, 8, 8, 1) images in [0, 1]: 1,440 to train, 357 to test."""
    digits = load_digits()  # ships inside scikit-learn: no download
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1440], y[:1440], x[1440:], y[1440:]


def make_model(sync_bn=False, dropout=0.3, seed=0):
    """Model and Adam optimizer; call inside `strategy.scope()`."""
    model = CNN(sync_bn=sync_bn, dropout=dropout, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)


def train_step(model, optimizer, x, y):  # runs once per replica, on its shard of the batch
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)  # ÷ GLOBAL batch size

    loss, grads = nnx.value_and_grad(loss_fn)(model)  # grads are summed over replicas
    optimizer.update(model, grads)
    return loss


def predict(model, x):
    return model(x).argmax(axis=-1)


def train_custom(strategy, epochs, *, sync_bn=False, checkpoint_dir=None, data=None):
    """The custom loop; resumes from the newest checkpoint in `checkpoint_dir` if any."""
    x_train, y_train, _, _ = data or load_data()
    with strategy.scope():  # state created here is mirrored on every device
        model, optimizer = make_model(sync_bn)
    start = 0
    path = mirrored.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if path is not None:  # the newest complete checkpoint: model, optimizer, random keys
        mirrored.restore_checkpoint(path, model, optimizer)
        start = mirrored.checkpoint_extras(path)["epoch"]
        print(f"resumed after epoch {start}")
    # The last batch is ragged: it is padded and masked, so every example counts exactly once
    # (in the loss and in BatchNorm's batch statistics).
    dataset = strategy.experimental_distribute_dataset(
        (x_train, y_train), batch_size=GLOBAL_BATCH_SIZE, shuffle=True
    )
    model.train()  # BatchNorm on batch statistics, Dropout on
    for epoch in range(start, epochs):
        total = 0.0
        for xb, yb in dataset.epoch_iterator(epoch + 1):  # epoch k's shuffle, resumed or not
            total += strategy.reduce("SUM", strategy.run(train_step, (model, optimizer, xb, yb)))
        print(f"epoch {epoch + 1}/{epochs}: loss {float(total) / len(dataset):.4f}")
        if checkpoint_dir:
            mirrored.save_checkpoint(
                checkpoint_dir, model, optimizer, step=epoch + 1, extras={"epoch": epoch + 1}
            )
    return model, optimizer


def evaluate_custom(strategy, model, x_test, y_test):
    model.eval()  # BatchNorm on its moving statistics, Dropout off
    test = strategy.experimental_distribute_dataset((x_test, y_test), batch_size=GLOBAL_BATCH_SIZE)
    # run's per-example outputs carry the batch's mask: gather keeps the real rows only.
    predictions = np.concatenate(
        [strategy.gather(strategy.run(predict, args=(model, xb)), axis=0) for xb, _ in test]
    )
    return float(np.mean(predictions == y_test))


def train_fit(strategy, epochs, *, sync_bn=False, data=None):
    x_train, y_train, x_test, y_test = data or load_data()
    with strategy.scope():
        model = CNN(sync_bn=sync_bn, rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            from_logits=True,  # the model returns logits
        )
    trainer.fit(x_train, y_train, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, verbose=0)
    return trainer.evaluate(x_test, y_test, verbose=0)["accuracy"]


def doctor_step():
    """For `mirrored doctor --step examples/cnn_digits.py:doctor_step`: one step to check."""
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = CNN(rngs=nnx.Rngs(0))
        # Plain SGD: unlike Adam, it shows a wrongly scaled gradient in the update.
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x_train, y_train, _, _ = load_data()
    (batch,) = list(strategy.experimental_distribute_dataset([(x_train[:69], y_train[:69])]))
    return strategy, train_step, (model, optimizer, *batch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loop", choices=["custom", "fit"], default="custom")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args(argv)

    strategy = mirrored.MirroredStrategy()
    print(f"replicas: {strategy.num_replicas_in_sync}")
    data = load_data()
    if args.loop == "fit":
        accuracy = train_fit(strategy, args.epochs, sync_bn=args.sync_bn, data=data)
    else:
        model, _ = train_custom(
            strategy,
            args.epochs,
            sync_bn=args.sync_bn,
            checkpoint_dir=args.checkpoint_dir,
            data=data,
        )
        accuracy = evaluate_custom(strategy, model, *data[2:])
    print(f"test accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    main()
