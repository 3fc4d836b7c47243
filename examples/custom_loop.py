"""A custom training loop with mirrored.MirroredStrategy — copy this file to start.

Uses every local accelerator; where there is none, 8 simulated CPU devices.

    python examples/custom_loop.py
"""

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import mirrored

# Only affects the CPU backend, so harmless where GPUs are present. Must come before JAX work.
mirrored.simulate_cpu_devices(8)

GLOBAL_BATCH_SIZE = 128
EPOCHS = 15


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def train_step(model, optimizer, x, y):  # runs once per replica, on its shard of the batch
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)  # ÷ GLOBAL batch size

    loss, grads = nnx.value_and_grad(loss_fn)(model)  # grads are summed over replicas
    optimizer.update(model, grads)
    return loss


def predict(model, x):
    return model(x).argmax(axis=-1)


def main():
    digits = load_digits()  # ships inside scikit-learn: no download
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1440], y[:1440], x[1440:], y[1440:]

    strategy = mirrored.MirroredStrategy()
    print(f"replicas: {strategy.num_replicas_in_sync}")

    with strategy.scope():  # state created here is mirrored on every device
        model = MLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    # The last batch is ragged: it is padded and masked, so every example counts exactly once.
    dataset = strategy.experimental_distribute_dataset(
        (x_train, y_train), batch_size=GLOBAL_BATCH_SIZE, shuffle=True
    )
    for epoch in range(EPOCHS):
        total = 0.0
        for xb, yb in dataset:
            per_replica_loss = strategy.run(train_step, args=(model, optimizer, xb, yb))
            total += strategy.reduce("SUM", per_replica_loss, axis=None)
        print(f"epoch {epoch + 1}: loss {float(total) / len(dataset):.4f}")

    test = strategy.experimental_distribute_dataset((x_test, y_test), batch_size=GLOBAL_BATCH_SIZE)
    # run's per-example outputs carry the batch's mask: gather keeps the real rows only.
    predictions = np.concatenate(
        [strategy.gather(strategy.run(predict, args=(model, xb)), axis=0) for xb, _ in test]
    )
    accuracy = float(np.mean(predictions == y_test))
    print(f"test accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    main()
