"""Keras-style per-example losses for `mirrored.Trainer`."""

from mirrored._train.objectives import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
    get_loss,
)

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Loss",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
    "get_loss",
]
