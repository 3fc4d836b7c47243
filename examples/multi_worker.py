"""Multi-worker training with MultiWorkerMirroredStrategy — run it through the launcher:

    mirrored launch -n 2 --devices-per-process 2 examples/multi_worker.py

or on a cluster with TF_CONFIG / SLURM set for every worker (`python examples/multi_worker.py`).
Alone (`python examples/multi_worker.py`) it runs as a single worker.
"""

import os
import tempfile

import mirrored

strategy = mirrored.MultiWorkerMirroredStrategy()  # first: starts jax.distributed

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


def main():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))  # every worker: the same order
    x, y = x[order], y[order]
    x_train, y_train, x_test, y_test = x[:1440], y[:1440], x[1440:], y[1440:]

    with strategy.scope():
        trainer = mirrored.Trainer(
            MLP(rngs=nnx.Rngs(0)),
            optax.adam(3e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            from_logits=True,
        )
    # Every worker gives the same arrays; each one feeds only its own rows of every batch.
    backup = os.path.join(tempfile.gettempdir(), "mirrored_multi_worker_backup")
    trainer.fit(
        x_train,
        y_train,
        batch_size=128,
        epochs=10,
        callbacks=[mirrored.callbacks.BackupAndRestore(backup)],  # resumes after a crash
        verbose=1 if strategy.is_chief else 0,
    )
    results = trainer.evaluate(x_test, y_test)
    if strategy.is_chief:  # only the chief prints and writes files
        print(f"workers: {jax.process_count()}, replicas: {strategy.num_replicas_in_sync}")
        print(f"test accuracy: {results['accuracy']:.4f}")


if __name__ == "__main__":
    main()
