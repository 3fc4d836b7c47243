"""Abstract state made in a strategy's scope names the strategy's devices.

Flax's checkpointing guide restores into an abstract model: `nnx.eval_shape(lambda:
Model(...))`, then Orbax's `restore(path, abstract_state)` places each array by the
`sharding` of its `ShapeDtypeStruct`. Under `strategy.scope()` (a `jax.set_mesh` of the
strategy's mesh) JAX types every abstract value with the *abstract* mesh, which Orbax cannot
place ("_device_assignment is not implemented for AbstractMesh"); Flax writes that sharding
itself (`NamedSharding(jax.sharding.get_abstract_mesh(), spec)`). In the scope, and outside a
step, `nnx.eval_shape` therefore gives its abstract Variables the strategy's own mesh, so that
a restore lands replicated on its devices, as the state the scope creates does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding

from mirrored._core import context as _context
from mirrored._core import patching

_EVAL_SHAPE = patching.target(
    "flax.nnx",
    "eval_shape",
    reason="(in a strategy's scope) abstract shardings name the strategy's devices, so that "
    "Orbax can restore into an abstract model",
    checked="flax 0.12.8",
)
_INSTALLED: list[bool] = []


def _concrete(mesh: jax.sharding.Mesh, leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if (
        isinstance(leaf, jax.ShapeDtypeStruct)
        and isinstance(sharding, NamedSharding)
        and isinstance(sharding.mesh, AbstractMesh)
        and sharding.mesh == mesh.abstract_mesh
    ):
        concrete = NamedSharding(mesh, sharding.spec)
        return jax.ShapeDtypeStruct(
            leaf.shape, leaf.dtype, sharding=concrete, weak_type=leaf.weak_type
        )
    return leaf


def _in_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def eval_shape(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        out = original(fun, *args, **kwargs)
        strategy = _context.entered_strategy()
        if strategy is None or _context.current_replica_context() is not None:
            return out
        from flax import nnx

        mesh = strategy._mesh
        for _, node in nnx.iter_graph(out):
            if isinstance(node, nnx.Variable):
                value = node.get_value()
                if isinstance(value, jax.ShapeDtypeStruct):
                    node.set_value(_concrete(mesh, value))
        return out

    return eval_shape


def install() -> None:
    """Wrap `nnx.eval_shape` (idempotent); it changes nothing outside a strategy's scope."""
    if not _INSTALLED:
        patching.replace(_EVAL_SHAPE, _in_scope)
        _INSTALLED.append(True)
