"""Host callbacks inside a step: their results are per replica.

`jax.pure_callback` and `jax.experimental.io_callback` run once per device, on that device's
inputs; JAX types their results as identical on every replica, so `run` returned replica 0's
rows only, `gather` tiled them, and a Variable written from one held a different value on
each device under a replicated sharding, with no `ReplicaDivergenceError`. While a step is
traced, their results are typed as varying across replicas, as the values they computed are.

The public functions bind the primitives `jax._src.callback` holds as module globals; those
are replaced for the trace, so the functions are caught however they were imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from mirrored._core import context as _context
from mirrored._core import patching

_PRIMITIVES = [
    patching.target(
        "jax._src.callback",
        name,
        reason="(while a step is traced) the callback's results are per replica: varying",
        checked="jax 0.10.2",
    )
    for name in ("pure_callback_p", "io_callback_p")
]


class _PerReplicaResults:
    """A callback primitive whose `bind` types its results as varying across replicas."""

    def __init__(self, primitive: Any) -> None:
        self._primitive = primitive

    def bind(self, *args: Any, **params: Any) -> Any:
        out = self._primitive.bind(*args, **params)
        ctx = _context.current_replica_context()
        if ctx is None or not ctx.in_spmd:
            return out
        return jax.tree.map(_context.as_varying, out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._primitive, name)


@contextlib.contextmanager
def per_replica_callbacks() -> Iterator[None]:
    """While a step is traced: host callbacks' results are typed as per replica."""
    with contextlib.ExitStack() as stack:
        for found in _PRIMITIVES:
            original = vars(patching.resolve(found.owner))[found.name]
            # Nested traces share the first replacement (the patch counts its users).
            stack.enter_context(patching.temporarily(found, _PerReplicaResults(original)))
        yield
