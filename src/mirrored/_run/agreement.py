"""Mirrored state is the same on every process: the chief's values, broadcast once.

Each process of a multi-worker job builds its own model; without a seed (Keras' default
initializers, a TensorFlow tutorial as written) each draws its own initial values, while the
arrays report fully replicated. TensorFlow's MultiWorkerMirroredStrategy and PyTorch's DDP
broadcast the chief's initial values; so does `run`, the first time it sees a variable: one
broadcast per new set of state (a collective over every process, and a small program compiled
for its shapes), then nothing per step.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mirrored._core.devices import owning_processes
from mirrored._core.mesh import is_per_replica_state


def agreed(known: Known, variables: Sequence[Any], state: list[jax.Array]) -> list[jax.Array]:
    """`state` (the values of `variables`, in order) with every variable not `known` holding
    process 0's value; those are then known. Only for a strategy over several processes
    (`Agreement.state` returns first otherwise)."""
    known.let_go()
    # Per-replica state (a row per replica, not mirrored) keeps each process' rows.
    new = [
        i for i, v in enumerate(variables) if v not in known and not is_per_replica_state(state[i])
    ]
    if not new:
        return state
    from jax.experimental import multihost_utils

    local = [_host_value(state[i]) for i in new]
    chief = multihost_utils.broadcast_one_to_all(local)
    out = list(state)
    for i, value in zip(new, chief, strict=True):
        out[i] = _placed_like(state[i], np.asarray(value))
        known.add(variables[i])
    return out


class Known:
    """The variables every process was given the chief's value of, by identity.

    Not a set of `id()`s: Python reuses a freed object's id for the next object of its size,
    at a moment that differs from process to process (verify's copies of a model, a model
    built again), so one process took a new variable for a known one and skipped its
    broadcast while the others waited in it (a mismatched collective: a hang, then SIGABRT).
    nnx Variables take no weak references, so each known variable is held here (its id
    cannot be reused while it is) and let go once nothing else holds it."""

    def __init__(self) -> None:
        self._held: dict[int, Any] = {}

    def __contains__(self, variable: Any) -> bool:
        return self._held.get(id(variable)) is variable

    def add(self, variable: Any) -> None:
        self._held[id(variable)] = variable

    def let_go(self) -> None:
        """Forget the variables only this registry still holds (their model is gone)."""
        # Two references: this dict's and getrefcount's argument.
        gone = [key for key in self._held if sys.getrefcount(self._held[key]) <= 2]
        for key in gone:
            del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


def _is_key(x: jax.Array) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_value(x: jax.Array) -> np.ndarray:
    data = jax.random.key_data(x) if _is_key(x) else x
    return np.asarray(data.addressable_data(0))


def _placed_like(x: jax.Array, value: np.ndarray) -> jax.Array:
    if _is_key(x):
        data = jax.make_array_from_process_local_data(x.sharding, value.astype(np.uint32))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(x.sharding, value.astype(x.dtype))


class Agreement:
    """What one runner's processes agree on: the variables given the chief's values."""

    def __init__(self, devices: Sequence[Any]) -> None:
        # The processes of this strategy's devices: a strategy over one process' own devices
        # in a job of several (the chief's evaluation, say) has no one to agree with.
        self._processes = len(owning_processes(devices))
        self._known = Known()

    def is_agreed(self, variable: Any) -> bool:
        """Whether every process was given the chief's value of `variable`."""
        return variable in self._known

    def agree(self, variables: Sequence[Any]) -> None:
        """Give every process the chief's value of each of `variables` not agreed yet."""
        self.state(variables, [v.get_raw_value() for v in variables])

    def state(self, variables: Sequence[Any], state: list[jax.Array]) -> list[jax.Array]:
        """`state` (the values of `variables`) with the chief's values of variables not agreed
        yet, written into them too. One process: `state` itself."""
        if self._processes == 1:
            return state
        out = agreed(self._known, variables, state)
        if out is not state:
            for variable, value in zip(variables, out, strict=True):
                variable.set_raw_value(value)
        return out
