"""Checkpoints of mirrored state with Orbax: atomic, and restorable on any number of replicas.

State is saved as host arrays keyed by variable path, so a checkpoint written by 8 replicas is
placed onto 2 (or 1) when restored. Each save is a new Orbax step directory that becomes
visible only when complete; older steps are deleted after it, so a crash mid-save leaves the
previous checkpoint usable.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from mirrored._leaves import is_key, raw_array


def is_chief() -> bool:
    """Whether this process writes files (process 0)."""
    return jax.process_index() == 0


def _flat_state(prefix: str, obj: Any) -> dict[str, Any]:
    return {
        f"{prefix}/" + "/".join(map(str, path)): var
        for path, var in nnx.to_flat_state(nnx.state(obj))
    }


def state_arrays(objects: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every variable of the named NNX objects as a host array, keyed `name/path/to/var`."""
    flat: dict[str, Any] = {}
    for prefix, obj in objects.items():
        flat.update({k: raw_array(v.get_value()) for k, v in _flat_state(prefix, obj).items()})
    return {k: np.asarray(v) for k, v in jax.device_get(flat).items()}


def load_state_arrays(objects: dict[str, Any], arrays: dict[str, np.ndarray], source: str) -> None:
    """Write `arrays` (from `state_arrays`) into the objects' variables, placed as they are.

    Each value lands with the sharding of the variable it replaces, so state saved by 8
    replicas restores onto a model mirrored on 2 (or on one device).
    """
    for prefix, obj in objects.items():
        state = nnx.state(obj)
        for key, var in _flat_state(prefix, obj).items():
            if key not in arrays:
                raise ValueError(
                    f"Expected the checkpoint at {source} to hold {key!r}; it does not. It was "
                    "saved from a different model or optimizer. Fix: restore into the same "
                    "architecture (and optimizer) that was saved."
                )
            value = arrays[key]
            current = var.get_value()
            expected = raw_array(current).shape
            if value.shape != expected:
                raise ValueError(
                    f"Expected {key!r} of shape {expected} in the checkpoint at "
                    f"{source}; found {value.shape}. Fix: restore into the architecture that "
                    "was saved."
                )
            if is_key(current):
                data = jax.device_put(value.astype(np.uint32), current.sharding)
                var.set_value(jax.random.wrap_key_data(data, impl=jax.random.key_impl(current)))
            else:
                var.set_value(jax.device_put(value.astype(current.dtype), current.sharding))
        nnx.update(obj, state)


class Checkpoints:
    """A directory of numbered checkpoints, newest kept (`max_to_keep`)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 1) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=False,
                # Host arrays, written by process 0 alone and read by each process on its own:
                # no cross-process barriers, which would wait for processes that never save.
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=jax.process_index(), active_processes={jax.process_index()}
                ),
            ),
        )

    def latest(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, arrays: dict[str, np.ndarray]) -> None:
        if is_chief():
            self._manager.save(step, args=ocp.args.StandardSave(arrays), force=True)
            self._manager.wait_until_finished()

    def restore(self, like: dict[str, np.ndarray], step: int | None = None) -> dict[str, Any]:
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"Expected a checkpoint in {self.directory}; found none. Fix: check the path, "
                "or save one first."
            )
        # Restore what is on disk, then keep the keys asked for: a model alone can be restored
        # from a checkpoint that also holds the optimizer.
        restored = dict(self._manager.restore(step, args=ocp.args.StandardRestore()))
        return {k: np.asarray(v) for k, v in restored.items() if k in like}

    def close(self) -> None:
        self._manager.close()


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    *,
    step: int = 0,
    max_to_keep: int | None = 1,
) -> None:
    """Save a model (and optimizer) into `directory` as checkpoint number `step`.

    Example:
        >>> mirrored.save_checkpoint("ckpt/", model, optimizer, step=epoch)
    """
    objects = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    checkpoints = Checkpoints(directory, max_to_keep=max_to_keep)
    try:
        checkpoints.save(step, state_arrays(objects))
    finally:
        checkpoints.close()


def restore_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    *,
    step: int | None = None,
) -> int:
    """Restore the newest (or `step`) checkpoint into a model (and optimizer); returns the step.

    Values are placed where the model's variables live (mirrored on its strategy), whatever
    replica count wrote them.

    Example:
        >>> with strategy.scope():
        ...     model = MLP(rngs=nnx.Rngs(0))
        >>> mirrored.restore_checkpoint("ckpt/", model)
    """
    objects = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    checkpoints = Checkpoints(directory, max_to_keep=None)
    try:
        step = checkpoints.latest() if step is None else step
        like = state_arrays(objects)
        arrays = checkpoints.restore(like, step)
    finally:
        checkpoints.close()
    load_state_arrays(objects, arrays, checkpoints.directory)
    assert step is not None
    return step
