"""How each kind of state combines across replicas, in one table (TensorFlow's
`VariableAggregation`):

| state                                   | rule                                | TensorFlow       |
|-----------------------------------------|-------------------------------------|------------------|
| parameters, optimizer state (any other) | stays mirrored: `grad` already sums | NONE (mirrored)  |
| `nnx.RngKey` (random streams)           | folded with the replica id per step | per-replica seed |
| `nnx.BatchStat` (moving statistics)     | mean over replicas with real rows   | ON_READ MEAN     |
| `MetricState`, Flax metric sums         | `old + Σ_replicas (new_r - old)`    | SYNC_ON_READ SUM |
| per-replica state (split, a row each)   | each replica keeps its own row      | SYNC_ON_READ     |

Anything else that comes back different on each replica is an error (`ReplicaDivergenceError`).
A Variable the step replaced by a new one first gives its value to the one `run` was given
(`program._check_writes`); an array assigned to an attribute that is not a Variable is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._nnx import metrics


def summed_over_replicas(old: jax.Array, new: jax.Array, n: int) -> jax.Array:
    """A running sum after every replica added its rows: `old + Σ_replicas (new_r - old)`
    (TensorFlow's SYNC_ON_READ SUM); an addition the same on every replica counts N times."""
    added = new - old
    return old + (jax.lax.psum(added, REPLICA_AXIS) if _context.is_varying(added) else added * n)


def mean_over_replicas(value: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The mean across replicas of a moving statistic; replicas with no real row left out."""
    if mask is None or not jnp.issubdtype(value.dtype, jnp.inexact):
        return jax.lax.pmean(value, REPLICA_AXIS)
    real = mask.any()
    total = jax.lax.psum(jnp.where(real, value, jnp.zeros_like(value)), REPLICA_AXIS)
    replicas = jax.lax.psum(real.astype(value.dtype), REPLICA_AXIS)
    return total / jnp.maximum(replicas, 1)


def replica_keys(state: list[Any], slots: list[int]) -> list[Any]:
    """The state with each random key folded with this replica's id.

    Every replica then draws its own dropout masks (TensorFlow's per-replica randomness), and
    each step draws new ones (the stream's mirrored count advances). The numbers depend on
    the seed and the replica count: a run is reproducible for both.
    """
    if not slots:
        return state
    replica = jax.lax.axis_index(REPLICA_AXIS)
    inner = list(state)
    for i in slots:
        inner[i] = _fold_each(state[i], replica)
    return inner


def _fold_each(keys: Any, replica: Any) -> Any:
    """`fold_in(key, replica)` for a key, or for each key of a stacked array of them (the
    layers of a scan-over-layers model, built with `nnx.split_rngs` and `nnx.vmap`)."""
    fold = jax.random.fold_in
    for _ in range(keys.ndim):
        fold = jax.vmap(fold, in_axes=(0, None))
    return fold(keys, replica)


# TensorFlow's VariableAggregation, as a Variable's metadata (`nnx.BatchStat(x, aggregation=
# "sum")`), plus MAX and MIN (mirrored's ReduceOp has them): how the replicas' values of a
# Variable the step changed per replica become its one new value.
AGGREGATIONS = ("mean", "sum", "max", "min", "only_first_replica", "none")


def declared_aggregation(variable: Any) -> str | None:
    """A Variable's declared `aggregation` metadata (checked), or None."""
    metadata = variable.get_metadata() if isinstance(variable, nnx.Variable) else {}
    how = metadata.get("aggregation")
    if how is None:
        return None
    how = str(getattr(how, "name", how)).lower()  # a tf.VariableAggregation works too
    if how not in AGGREGATIONS:
        raise ValueError(
            f"Expected a Variable's aggregation to be one of {list(AGGREGATIONS)} (TensorFlow's "
            f"VariableAggregation, with max and min); found {metadata['aggregation']!r} on a "
            f"{type(variable).__name__}. Fix: pass one of those, e.g. "
            "nnx.BatchStat(value, aggregation='max')."
        )
    return how


def _numbers_to_average(variable: Any) -> bool:
    value = variable.get_raw_value()
    return jnp.issubdtype(getattr(value, "dtype", jnp.float32), jnp.inexact)


@dataclasses.dataclass(frozen=True)
class StateRules:
    """The slots of a step's state (its Variables, in order) that each rule applies to."""

    keys: list[int]
    statistics: list[int]
    sums: list[int]
    declared: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, variables: list[Any], arguments: Any, local: Any = ()) -> StateRules:
        """The table applied to `variables`, the step's state; `arguments` hold its metrics.

        | kind | rule |
        | --- | --- |
        | `nnx.Param`, optimizer state, any other Variable | mirrored: must stay identical |
        | `nnx.RngKey` | folded with the replica id: per replica |
        | `nnx.BatchStat` (floats) | the mean of the replicas with real rows |
        | metric state (mirrored.metrics, Flax metrics that add) | additions summed |
        | a Variable with `aggregation=` metadata | that aggregation |

        A `BatchStat` of integers, with no aggregation declared, is not averaged: it stays
        mirrored (a per-replica value is refused, naming `aggregation=`). The slots `local`
        hold per-replica state (one row per replica): no rule applies to them."""
        flax_sums = metrics.summable_flax_states(arguments)
        local = frozenset(local)
        variables = [None if i in local else v for i, v in enumerate(variables)]
        declared = {
            i: how for i, v in enumerate(variables) if (how := declared_aggregation(v)) is not None
        }
        return cls(
            keys=[i for i, v in enumerate(variables) if isinstance(v, nnx.RngKey)],
            statistics=[
                i
                for i, v in enumerate(variables)
                if isinstance(v, nnx.BatchStat) and i not in declared and _numbers_to_average(v)
            ],
            sums=[
                i
                for i, v in enumerate(variables)
                if (isinstance(v, metrics.MetricState) or id(v) in flax_sums) and i not in declared
            ],
            declared=declared,
        )

    def entering(self, state: list[Any], n: int) -> list[Any]:
        """The state a replica's step sees: its own random keys (one replica: the keys
        themselves, so the numbers are the plain script's)."""
        return replica_keys(state, self.keys) if n > 1 else list(state)

    def combined(
        self,
        state: list[Any],
        inner: list[Any],
        new_state: list[Any],
        added: set[int],
        mask: Any,
        n: int,
    ) -> list[Any]:
        """The new state, combined across replicas by the table; `added`: more slots whose
        update only adds (Flax metrics of the user's own), summed too."""
        new_state = list(new_state)
        for i in self.keys:  # an unchanged stream keeps its mirrored key; its count moves on
            if new_state[i] is inner[i]:
                new_state[i] = state[i]
        for i in [*self.sums, *sorted(added - set(self.sums))]:
            new_state[i] = summed_over_replicas(state[i], new_state[i], n)
        for i in self.statistics:
            if _context.is_varying(new_state[i]):
                new_state[i] = mean_over_replicas(new_state[i], mask)
        for i, how in self.declared.items():
            if _context.is_varying(new_state[i]):
                new_state[i] = _aggregated(how, state[i], new_state[i], mask, n)
        return new_state


def _aggregated(how: str, old: Any, new: Any, mask: Any, n: int) -> Any:
    """The replicas' values `new` of a Variable declared `aggregation=how`, as one value."""
    if how == "sum":  # TensorFlow's SUM: every replica's change is applied
        return summed_over_replicas(old, new, n)
    if how == "mean":
        if not jnp.issubdtype(new.dtype, jnp.inexact):
            return new  # refused by the caller, naming the Variable: ints cannot be averaged
        return mean_over_replicas(new, mask)
    if how == "max":
        return jax.lax.pmax(new, REPLICA_AXIS)
    if how == "min":
        return jax.lax.pmin(new, REPLICA_AXIS)
    if how == "only_first_replica":
        first = jax.lax.axis_index(REPLICA_AXIS) == 0
        return jax.lax.psum(jnp.where(first, new, jnp.zeros_like(new)), REPLICA_AXIS)
    return new  # "none": must stay identical; a per-replica value is refused by the caller
