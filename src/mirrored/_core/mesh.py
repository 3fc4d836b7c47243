"""The only module that builds `Mesh`, `PartitionSpec` and `NamedSharding`.

Data parallelism needs one mesh axis: every replica holds the whole model, and batches are
split along it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPLICA_AXIS = "replica"
"""Name of the mesh axis that indexes replicas."""

REPLICATED = PartitionSpec()
"""Spec of mirrored state: the full value on every replica."""

SPLIT = PartitionSpec(REPLICA_AXIS)
"""Spec of distributed values: the leading axis split across replicas."""


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A one-axis mesh whose position `i` is replica `i`."""
    return Mesh(np.asarray(devices, dtype=object), (REPLICA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a value mirrored on every device of `mesh`."""
    return NamedSharding(mesh, REPLICATED)


def split(mesh: Mesh) -> NamedSharding:
    """Sharding of a value whose leading axis is split across the replicas of `mesh`."""
    return NamedSharding(mesh, SPLIT)


def is_per_replica_state(x: object) -> bool:
    """Whether the array `x` is per-replica state: one row per replica, its leading axis split
    over the replica axis (the Trainer's local gradient sums), not mirrored."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return (
        spec is not None
        and len(spec) >= 1
        and spec[0] == REPLICA_AXIS
        and all(axis is None for axis in spec[1:])
    )
