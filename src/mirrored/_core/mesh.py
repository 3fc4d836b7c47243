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


def is_sharded_variable(variable: object) -> bool:
    """Whether `variable` is a ShardedOptimizer's state leaf planned to be split over the
    replicas (its `sharded` metadata): its shards differ by design, and it is never
    per-replica state, whatever its layout looks like."""
    has = getattr(variable, "has_metadata", None)
    return bool(has and has("sharded") and variable.get_metadata("sharded") != REPLICATED)  # type: ignore[attr-defined]


def scattered_gradient_spec(variable: object) -> PartitionSpec | None:
    """The split of a parameter whose gradients a `ShardedOptimizer(shard_gradients=True)`
    reduce-scatters over the replicas (its `gradient_shards` metadata), or None."""
    has = getattr(variable, "has_metadata", None)
    if not (has and has("gradient_shards")):
        return None
    spec = variable.get_metadata("gradient_shards")  # type: ignore[attr-defined]
    return None if spec == REPLICATED else spec  # type: ignore[no-any-return]


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


def sharded_spec(shape: tuple[int, ...], n: int) -> PartitionSpec:
    """A state leaf's spec when it is split over `n` replicas (ZeRO): its first dimension
    divisible by `n` carries the replica axis (MaxText's rule); a leaf with none, a scalar, or
    any leaf when `n` is 1, stays whole on every replica."""
    if n > 1:
        for dim, size in enumerate(shape):
            if size >= n and size % n == 0:
                return PartitionSpec(*([None] * dim), REPLICA_AXIS)
    return REPLICATED


def sharded(mesh: Mesh, spec: PartitionSpec) -> NamedSharding:
    """The sharding of a state leaf split as `spec` over the replicas of `mesh`."""
    return NamedSharding(mesh, spec)
