"""What a Keras callback or script reads from `self.model` besides fit/evaluate/predict:
`get_weights`, `set_weights`, `save_weights`, `load_weights`, `metrics_names`, `history`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrored._persist import checkpoint as _checkpoint


class KerasModelMethods:
    """Keras' `Model` methods on a `Trainer` (its `model` is the NNX module)."""

    model: Any
    _names: list[str]
    _stateful_names: list[str]
    history: Any = None  # Keras sets `model.history` to the last fit's History

    def _weights(self) -> Any:
        return nnx.state(self.model, nnx.Not(nnx.RngState))  # Keras' weights: no RNG state

    def get_weights(self) -> list[np.ndarray]:
        """The model's variables (parameters and statistics, not RNG state) as NumPy arrays,
        in the model's state order: Keras' `get_weights()`."""
        return [np.asarray(leaf) for leaf in jax.tree.leaves(self._weights())]

    def set_weights(self, weights: list[Any]) -> None:
        """Write `weights` (as `get_weights` gives them) into the model, placed as the model's
        variables are (mirrored): Keras' `set_weights()`. Shapes are checked first."""
        state = self._weights()
        leaves, treedef = jax.tree.flatten(state)
        weights = list(weights)
        if len(weights) != len(leaves) or any(
            np.shape(w) != np.shape(leaf) for w, leaf in zip(weights, leaves, strict=False)
        ):
            expected = [tuple(np.shape(leaf)) for leaf in leaves]
            found = [tuple(np.shape(w)) for w in weights]
            raise ValueError(
                f"Expected set_weights to get {len(leaves)} arrays of shapes {expected}; found "
                f"{len(weights)} of shapes {found}. Nothing was changed. Fix: pass what "
                "get_weights() returns for this model."
            )
        placed = [
            jax.device_put(np.asarray(w, dtype=leaf.dtype), leaf.sharding)
            for w, leaf in zip(weights, leaves, strict=True)
        ]
        nnx.update(self.model, jax.tree.unflatten(treedef, placed))

    def save_weights(self, filepath: str) -> None:
        """The model's variables saved as a checkpoint directory (Keras writes one
        `.weights.h5` file): `mirrored.save_checkpoint(filepath, model)`."""
        _checkpoint.save_checkpoint(filepath, self.model)

    def load_weights(self, filepath: str) -> None:
        """The model's variables restored from `save_weights`' directory."""
        _checkpoint.restore_checkpoint(filepath, self.model)

    @property
    def metrics_names(self) -> list[str]:
        """The names `evaluate` logs, loss first: Keras' `metrics_names`."""
        return [*self._names, *self._stateful_names]
