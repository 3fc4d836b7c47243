"""Pure functions on host batches: validation, padding to a static shape, per-process slices."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

_BATCH_HINT = (
    "Datasets must yield GLOBAL batches: arrays of shape (batch, ...). For a Grain or tf.data "
    "pipeline of single examples, add .batch(global_batch_size)."
)


def as_host_array(x: Any) -> Any:
    """A NumPy (or JAX) array for one batch leaf, or a TypeError that names the leaf."""
    if isinstance(x, jax.Array | np.ndarray):
        return x
    if hasattr(x, "__array__") or isinstance(x, list | tuple | int | float):
        array = np.asarray(x)
        if array.dtype != object:
            return array
    raise TypeError(
        f"Expected batch leaves to be arrays (NumPy, JAX, torch, tf, or array-likes); found "
        f"{type(x).__name__}: {x!r:.80}. Fix: convert it to a NumPy array, or drop it from the "
        "batch."
    )


def leading_size(leaves: list[Any]) -> int:
    """The common leading (batch) size of a batch's leaves."""
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if -1 in sizes:
        raise ValueError(
            f"Expected every leaf of a batch to have a leading batch axis; found a scalar. "
            f"{_BATCH_HINT}"
        )
    if len(sizes) != 1:
        raise ValueError(
            f"Expected every leaf of a batch to have the same leading (batch) size; found sizes "
            f"{sorted(sizes)}. Fix: make features and labels the same length."
        )
    return sizes.pop()


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """`global_batch_size / num_replicas`, or an error when it is not a positive whole number."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int | np.integer):
        raise TypeError(
            f"Expected the global batch size to be an int; found {global_batch_size!r}."
        )
    if global_batch_size < num_replicas:
        raise ValueError(
            f"Expected a global batch size of at least {num_replicas} (one example per "
            f"replica); found {global_batch_size}, which gives each of the {num_replicas} "
            "replicas 0 examples. Fix: the batch size is GLOBAL — use per-replica size × "
            f"num_replicas_in_sync, e.g. {32 * num_replicas}."
        )
    if global_batch_size % num_replicas:
        suggestion = global_batch_size + (-global_batch_size) % num_replicas
        raise ValueError(
            f"Expected a global batch size divisible by the {num_replicas} replicas; found "
            f"{global_batch_size} ({global_batch_size / num_replicas:g} per replica). Fix: use a "
            f"multiple of {num_replicas}, e.g. {suggestion}."
        )
    return int(global_batch_size) // num_replicas


def padded_size(rows: int, target: int, num_replicas: int) -> int:
    """Rows after padding: at least `target` (the static batch), and a multiple of the replicas."""
    size = max(rows, target)
    return size + (-size) % num_replicas


def process_rows(size: int, num_processes: int, process_index: int) -> slice:
    """The rows of a padded global batch that process `process_index` provides.

    Replicas are laid out process by process, each process owning the same number of devices,
    so each process owns one contiguous block of `size / num_processes` rows.
    """
    if size % num_processes:
        raise ValueError(
            f"Expected the padded global batch ({size} rows) to split evenly over "
            f"{num_processes} processes. Fix: give every process the same number of devices."
        )
    rows = size // num_processes
    return slice(process_index * rows, (process_index + 1) * rows)


def pad_to(
    leaves: list[Any], rows: int, size: int, fill: list[Any] | None = None
) -> list[np.ndarray]:
    """Each leaf extended from `rows` to `size` rows with copies of its real rows.

    A padded row must be harmless to any model and loss the real rows are fine for: a row of
    zeros is infinite under `1 / |y|` and NaN under `x / |x|`, and `inf * 0` is NaN even where
    the mask removes it (in the loss and in its gradient). Copies of real rows stay finite
    wherever the real rows are. `fill` gives the rows to copy when there are no real rows
    (a replica the data ran out for); the mask excludes every padded row from every result.
    """
    if rows == size:
        return [np.asarray(x) for x in leaves]
    out = []
    for i, x in enumerate(leaves):
        x = np.asarray(x)
        source = x[:rows] if rows else np.asarray(fill[i] if fill is not None else x)
        if len(source) == 0:  # nothing real to copy anywhere: zeros are all there is
            source = np.zeros((1, *x.shape[1:]), x.dtype)
        index = np.arange(size - rows) % len(source)
        out.append(np.concatenate([x[:rows], source[index].astype(x.dtype, copy=False)]))
    return out


def example_mask(rows: int, size: int) -> np.ndarray:
    """True for the `rows` real examples of a batch padded to `size` rows."""
    return np.arange(size) < rows
