"""`mirrored demo`: the custom training loop of the README on scikit-learn's bundled digits."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import mirrored
from mirrored._core.devices import device_name
from mirrored._core.platform import seconds_since_start


class DigitsMLP(nnx.Module):
    """64 pixels → 256 ReLU → 10 classes."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 256, rngs=rngs)
        self.out = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.hidden(x)))


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, ...]:
    """The 1,797 8×8 digits shipped inside scikit-learn (no download), 80/20 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> Any:
    def loss_fn(model: nnx.Module) -> jax.Array:
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)  # ÷ GLOBAL batch size

    loss, grads = nnx.value_and_grad(loss_fn)(model)  # already summed over replicas
    optimizer.update(model, grads)
    return loss


def correct_count(model: DigitsMLP, x: jax.Array, y: jax.Array) -> jax.Array:
    # The last test batch is padded to the static batch shape; count only real examples.
    mask = mirrored.get_replica_context().example_mask  # type: ignore[union-attr]
    return jnp.sum((jnp.argmax(model(x), axis=-1) == y) & mask)


def run_demo(
    *,
    loop: str = "fit",
    epochs: int = 20,
    batch_size: int = 128,
    learning_rate: float = 3e-3,
    seed: int = 0,
) -> dict[str, Any]:
    """Train on the digits with a MirroredStrategy over every local device; returns a summary.

    `loop="fit"` uses `Trainer.fit`; `loop="custom"` the `strategy.run` loop of the README.
    """
    if loop not in ("fit", "custom"):
        raise ValueError(f"Expected loop 'fit' or 'custom'; found {loop!r}.")
    console = Console()
    strategy = mirrored.MirroredStrategy()
    n = strategy.num_replicas_in_sync
    devices = ", ".join(device_name(d) for d in strategy.extended.worker_devices)
    console.print(f"[bold]MirroredStrategy[/bold] with {n} replica(s) on {devices}")
    padded = batch_size + (-batch_size) % n
    per_replica = mirrored.InputContext(num_replicas_in_sync=n).get_per_replica_batch_size(padded)
    note = f" (padded from {batch_size}, padding masked)" if padded != batch_size else ""
    console.print(f"global batch {padded} = {n} replicas × {per_replica} per replica{note}")

    x_train, y_train, x_test, y_test = load_digits_split(seed)
    if loop == "fit":
        return _fit_demo(
            console,
            strategy,
            x_train,
            y_train,
            x_test,
            y_test,
            epochs=epochs,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
        )
    with strategy.scope():
        model = DigitsMLP(rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    # 1,437 examples: the last batch of each epoch is ragged, padded and masked, and counts
    # every real example exactly once.
    train = strategy.experimental_distribute_dataset(
        (x_train, y_train), batch_size=batch_size, shuffle=True, seed=seed
    )
    losses = []
    first_step: float | None = None
    start = time.perf_counter()
    with Progress(
        TextColumn("epoch {task.fields[epoch]:>3}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        for epoch in range(1, epochs + 1):
            task = progress.add_task("train", total=len(train), epoch=epoch, loss="…")
            total = jnp.zeros(())
            for x, y in train:
                per_replica_loss = strategy.run(train_step, args=(model, optimizer, x, y))
                total = total + strategy.reduce("SUM", per_replica_loss, axis=None)
                if first_step is None:  # one wait, once: the step is done, not only queued
                    jax.block_until_ready(total)
                    first_step = seconds_since_start()
                progress.advance(task)
            mean_loss = float(total) / len(train)  # one host sync per epoch
            losses.append(mean_loss)
            progress.update(task, loss=f"{mean_loss:.4f}")
            progress.remove_task(task)
            console.print(f"epoch {epoch:>3}/{epochs}  loss {mean_loss:.4f}")

    test = strategy.experimental_distribute_dataset((x_test, y_test), batch_size=batch_size)
    correct = sum(
        float(strategy.reduce("SUM", strategy.run(correct_count, args=(model, x, y))))
        for x, y in test
    )
    accuracy = correct / len(x_test)
    seconds = time.perf_counter() - start
    console.print(f"test accuracy {accuracy:.4f} on {len(x_test)} examples ({seconds:.1f} s)")
    _print_first_step(console, first_step)
    return {
        "replicas": n,
        "losses": losses,
        "test_accuracy": accuracy,
        "seconds": seconds,
        "time_to_first_step_s": first_step,
    }


class _FirstStep(mirrored.callbacks.Callback):
    """Records when fit's first step has finished (one wait on the devices, once)."""

    seconds: float | None = None

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.seconds is None:
            jax.block_until_ready(jax.tree.leaves(nnx.state(self.trainer.model)))
            self.seconds = seconds_since_start()


def _print_first_step(console: Console, seconds: float | None) -> None:
    cache = mirrored.config.compilation_cache_dir() or "off"
    console.print(
        f"time to first step {seconds:.1f} s after the process started (compilation cache: {cache})"
    )


def _fit_demo(
    console: Console,
    strategy: mirrored.Strategy,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
) -> dict[str, Any]:
    start = time.perf_counter()
    with strategy.scope():
        model = DigitsMLP(rngs=nnx.Rngs(seed))
        trainer = mirrored.Trainer(
            model,
            optax.adam(learning_rate),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
            from_logits=True,
        )
    first_step = _FirstStep()
    history = trainer.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        validation_split=0.1,
        seed=seed,
        callbacks=[first_step],
    )
    results = trainer.evaluate(x_test, y_test, batch_size=batch_size)
    seconds = time.perf_counter() - start
    accuracy = results["accuracy"]
    console.print(f"test accuracy {accuracy:.4f} on {len(x_test)} examples ({seconds:.1f} s)")
    _print_first_step(console, first_step.seconds)
    return {
        "time_to_first_step_s": first_step.seconds,
        "replicas": strategy.num_replicas_in_sync,
        "losses": history.history["loss"],
        "test_accuracy": accuracy,
        "seconds": seconds,
    }
