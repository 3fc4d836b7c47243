"""Layers whose numbers depend on the replicas: TensorFlow's synchronized BatchNorm.

`SyncBatchNorm` is `tf.keras.layers.BatchNormalization(synchronized=True)`: in training, its
batch statistics cover the GLOBAL batch (every replica's real rows), so N replicas train
exactly as one device on the whole batch. Plain `nnx.BatchNorm` keeps TensorFlow's default:
statistics from each replica's own rows, moving statistics averaged across replicas.

Under both, the padded rows of a ragged batch never enter the batch statistics.

Example:
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.dense = nnx.Linear(4, 8, rngs=rngs)
    ...         self.norm = mirrored.layers.SyncBatchNorm(8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.norm(self.dense(x))
"""

from mirrored._nnx.batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
