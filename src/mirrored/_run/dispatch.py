"""Dispatch: at most a few steps in flight (simulated CPU devices deadlock in deeper queues of
collectives), and donated state buffers each held once."""

from __future__ import annotations

import collections
import time
from typing import Any

import jax
import jax.numpy as jnp

from mirrored._core.heartbeat import BEAT

MAX_IN_FLIGHT = 2  # steps queued before the host waits, with several replicas


class DispatchBound:
    """Blocks on the step `max_in_flight` steps back (None: never blocks)."""

    def __init__(self, max_in_flight: int | None) -> None:
        self.max_in_flight = max_in_flight
        self._in_flight: collections.deque[jax.Array] = collections.deque()

    def __call__(self, token: jax.Array) -> None:
        # Simulated CPU devices deadlock in collectives when too many steps are queued; real
        # accelerators gain nothing from a deeper queue either.
        if self.max_in_flight is None:
            return
        self._in_flight.append(token)
        while len(self._in_flight) > self.max_in_flight:
            start = time.perf_counter()
            self._in_flight.popleft().block_until_ready()
            BEAT.waited += time.perf_counter() - start  # a straggler's peers wait here


def own_buffers(state: list[jax.Array], donate: bool) -> list[jax.Array]:
    """The state with every array held once: a donated buffer must have one owner.

    Two variables may hold one array (`nnx.clone`, `target.kernel[...] = model.kernel[...]`,
    tied EMA or target networks); donating it twice would crash the runtime. The second
    holder gets a copy.
    """
    if not donate or len({id(x) for x in state}) == len(state):
        return state
    seen: set[int] = set()
    owned = []
    for x in state:
        owned.append(jnp.copy(x) if id(x) in seen else x)
        seen.add(id(x))
    return owned


def unaliased(state: list[jax.Array], rep: list[Any]) -> list[jax.Array]:
    """The state without the buffers also passed as replicated arguments: a donated buffer
    read by the same call crashes the runtime ("previously donated"). Keras' JAX guide does
    it: the state it passes is `[v.value for v in model.trainable_variables]`, the very
    arrays of the variables the step captures. Such a state entry is donated as a copy."""
    passed = {id(x) for x in rep if isinstance(x, jax.Array)}
    if not passed or passed.isdisjoint(map(id, state)):
        return state
    return [jnp.copy(x) if id(x) in passed else x for x in state]
