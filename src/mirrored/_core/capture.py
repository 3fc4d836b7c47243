"""Finding mirrored state that a step function captures instead of taking as an argument.

A captured model is baked into the compiled program as a constant: it is never updated, and
the optimizer step either fails or silently trains a copy. We read the function's closure
cells and the globals its byte code loads (recursively through helpers of the same module),
which finds the usual `def step(x): ... model(x) ...` before anything is traced.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

_MAX_CONTAINER_LEAVES = 64


def is_state(value: Any) -> bool:
    """An NNX object (module, optimizer, rngs, variable) — something `run` must be given."""
    return isinstance(value, nnx.Variable) or nnx.graph.is_graph_node(value)


def _holds_state(value: Any, is_mirrored: Callable[[Any], bool], *, depth: int = 1) -> bool:
    if is_state(value):
        return True
    if isinstance(value, jax.Array):
        return is_mirrored(value)
    if isinstance(value, list | tuple | dict):
        leaves = jax.tree.leaves(value, is_leaf=is_state)
        if len(leaves) <= _MAX_CONTAINER_LEAVES:
            return any(is_state(x) or (isinstance(x, jax.Array) and is_mirrored(x)) for x in leaves)
        return False
    # A plain object holding a model (`G.model`, `self.model` of a training class) bakes the
    # model in as a constant just as a captured model does.
    attributes = getattr(value, "__dict__", None)
    if depth > 0 and isinstance(attributes, dict) and not is_code_or_namespace(value):
        return any(
            _holds_state(v, is_mirrored, depth=depth - 1)
            for v in list(attributes.values())[:_MAX_CONTAINER_LEAVES]
        )
    return False


def is_random_key(value: Any) -> bool:
    """A JAX random key: a typed key, or `jax.random.PRNGKey`'s uint32 pair."""
    if not isinstance(value, jax.Array):
        return False
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return True
    return value.dtype == jax.numpy.uint32 and value.shape == (2,)


def is_code_or_namespace(value: Any) -> bool:
    return isinstance(
        value,
        types.ModuleType | type | types.FunctionType | types.MethodType | functools.partial,
    )


def _global_loads(code: types.CodeType) -> Iterator[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_loads(const)


def find_captured(
    fn: Callable[..., Any], is_mirrored: Callable[[Any], bool]
) -> list[tuple[str, Any]]:
    """(name, object) pairs of state that `fn` reaches other than through its arguments."""
    return find_reachable(fn, lambda value: _holds_state(value, is_mirrored))


def find_reachable(
    fn: Callable[..., Any],
    test: Callable[[Any], bool],
    globals_found: list[tuple[dict[str, Any], str, Any]] | None = None,
) -> list[tuple[str, Any]]:
    """(name, object) pairs for which `test` holds, among what `fn` reaches other than through
    its arguments: closure cells, defaults, `self`, partial arguments and the module globals
    its code (and same-module helpers it calls) loads. `globals_found` collects (namespace,
    name, object) of those found as globals: a caller keeping the result can check that the
    names still hold the same objects (a notebook cell that creates the model again)."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(f: Any) -> None:
        if id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, types.MethodType):  # `trainer_obj.step`: state reached via `self`
            if test(f.__self__):
                found.append(("self", f.__self__))
            visit(f.__func__)
            return
        if isinstance(f, functools.partial):
            for i, value in enumerate(f.args):
                if test(value):
                    found.append((f"functools.partial argument {i}", value))
            for key, value in f.keywords.items():
                if test(value):
                    found.append((f"functools.partial keyword {key!r}", value))
            visit(f.func)
            return
        code = getattr(f, "__code__", None)
        if not isinstance(code, types.CodeType):
            return
        defaults = [*(getattr(f, "__defaults__", None) or ())]
        defaults += [*(getattr(f, "__kwdefaults__", None) or {}).values()]
        for value in defaults:  # `def step(x, model=model)`: bound when the step was defined
            if test(value):
                found.append(("a default argument", value))
        for name, cell in zip(
            code.co_freevars, getattr(f, "__closure__", None) or (), strict=False
        ):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: the variable is not assigned yet
                continue
            if test(value):
                found.append((name, value))
            elif isinstance(value, types.FunctionType):
                visit(value)
        namespace = getattr(f, "__globals__", {})
        for name in _global_loads(code):
            if name not in namespace:
                continue
            value = namespace[name]
            if test(value):
                found.append((name, value))
                if globals_found is not None:
                    globals_found.append((namespace, name, value))
            elif isinstance(value, types.FunctionType) and value.__globals__ is namespace:
                # A helper from the same module may capture the model on the step's behalf.
                visit(value)

    visit(fn)
    unique: dict[int, tuple[str, Any]] = {}
    for name, value in found:
        unique.setdefault(id(value), (name, value))
    return list(unique.values())


def captured_state_error(fn: Callable[..., Any], captured: list[tuple[str, Any]]) -> ValueError:
    names = ", ".join(f"{name!r} ({type(value).__name__})" for name, value in captured)
    fn_name = getattr(fn, "__name__", repr(fn))
    first = captured[0][0] if captured[0][0].isidentifier() else "model"
    if first == "self":
        first = "model"
    return ValueError(
        f"strategy.run expected all mirrored state to arrive as arguments, but {fn_name!r} "
        f"captures {names} from an enclosing scope. Captured state is compiled in as a "
        "constant: it would never be updated on the replicas.\n"
        f"  Wrong:  def step(x): ... {first} ...\n"
        "          strategy.run(step, args=(x,))\n"
        f"  Right:  def step({first}, x): ... {first} ...\n"
        f"          strategy.run(step, args=({first}, x))\n"
        "Differs from tf.distribute: state is passed explicitly (the NNX way), not captured."
    )
