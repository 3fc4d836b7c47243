"""Flax's recurrent layers inside a step: the carry starts varying across replicas."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import patching

_RNN_CALL = patching.target(
    "flax.nnx.RNN",
    "__call__",
    reason="the carry starts varying across replicas (a scan carry may not change its type)",
    checked="flax 0.12.8",
)
_INITIALIZE_CARRY = patching.target(
    "flax.nnx.nn.recurrent.RNNCellBase",
    "initialize_carry",
    reason="(on the cell's own class) the zero carry is typed as varying across replicas",
    checked="flax 0.12.8",
)

_flax_rnn_call = nnx.RNN.__call__


def _rnn_call(self: nnx.RNN, inputs: Any, *, initial_carry: Any = None, **kwargs: Any) -> Any:
    """`nnx.RNN.__call__` inside a step: the cell's initial carry varies across replicas.

    Flax's carry starts as zeros, the same on every replica; after a step on the replica's
    rows it differs, and JAX's scan refuses a carry whose replica-variance changes ("carry
    input and carry output must have equal types"). An explicit `initial_carry` (a learned
    one: its gradient is then summed over replicas, as any mirrored parameter's) too.
    """
    ctx = _context.current_replica_context()
    if (
        ctx is None
        or not ctx.in_spmd
        or not any(_context.is_varying(x) for x in jax.tree.leaves(inputs))
    ):
        return _flax_rnn_call(self, inputs, initial_carry=initial_carry, **kwargs)
    if initial_carry is not None:
        initial_carry = jax.tree.map(_context.as_varying, initial_carry)
        return _flax_rnn_call(self, inputs, initial_carry=initial_carry, **kwargs)
    owner = next(c for c in type(self.cell).__mro__ if "initialize_carry" in vars(c))
    initialize = vars(owner)["initialize_carry"]

    def varying_carry(cell: Any, *args: Any, **kw: Any) -> Any:
        return jax.tree.map(_context.as_varying, initialize(cell, *args, **kw))

    with patching.temporarily(_INITIALIZE_CARRY, varying_carry, owner=owner):
        return _flax_rnn_call(self, inputs, **kwargs)


@contextlib.contextmanager
def varying_rnn_carries() -> Iterator[None]:
    """While a step is traced, `nnx.RNN` starts its carry varying across replicas."""
    with patching.temporarily(_RNN_CALL, _rnn_call):
        yield
