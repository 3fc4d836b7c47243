"""A `fit` with BackupAndRestore, run as a real process by test_trainer (optionally SIGKILLed)."""

import argparse
import os
import signal

import mirrored

mirrored.simulate_cpu_devices(8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP  # noqa: E402


class KillAt(mirrored.callbacks.Callback):
    """SIGKILL this process after `step` training steps in all: a crash mid-epoch."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class SigtermAt(KillAt):
    """SIGTERM this process after `step` training steps: a preemption notice mid-epoch."""

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backup_dir")
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--sigterm-at", type=int, default=0)
    parser.add_argument("--preemption", action="store_true")  # save_before_preemption only
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 12)).astype(np.float32)
    y = rng.integers(0, 5, 200).astype(np.int32)
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            model,
            optax.adam(1e-2),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
        )
    if args.preemption:
        backup = mirrored.callbacks.BackupAndRestore(
            args.backup_dir, save_freq=False, save_before_preemption=True
        )
    else:
        backup = mirrored.callbacks.BackupAndRestore(args.backup_dir, save_freq=3)
    callbacks = [backup]
    if args.kill_at:
        callbacks.append(KillAt(args.kill_at))
    if args.sigterm_at:
        callbacks.append(SigtermAt(args.sigterm_at))
    history = trainer.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=0, seed=7)
    state = {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model))
    }
    np.savez(args.out, loss=np.asarray(history.history["loss"][-1]), **state)


if __name__ == "__main__":
    main()
