"""A step's arguments: the module as an argument, the step's cache key, and its leaves sorted
into the program's inputs (mirrored state, split batches, replicated values, statics)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from mirrored._core.leaves import is_hollow
from mirrored._core.leaves import type_kind as _type_kind
from mirrored._core.mesh import scattered_gradient_spec

if TYPE_CHECKING:
    from mirrored._run.placement import Placement

# Leaf kinds of the flattened (args, kwargs).
_VARIABLE = "v"  # an nnx.Variable: mirrored state, read and written back
_MIRRORED = "m"  # a jax.Array identical on every replica
_SPLIT = "s"  # PerReplica whose leading axis is a split batch
_STACKED = "k"  # PerReplica with a leading replica axis
_CONSTANT = "c"  # NumPy array or Python number: the same value on every replica
_STATIC = "x"  # anything else: part of the program, compared by value


def undecorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function inside `@nnx.jit` / `@jax.jit` (any options): `run` compiles the whole
    step as one SPMD program itself, and a jit nested inside it would trace the replica's
    values as constants of another program."""
    while callable(getattr(fn, "lower", None)) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def state_as_arguments(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Sequence[Any]]:
    """`run(model, ...)` and `run(model.method, ...)`: the module travels as an argument."""
    fn = undecorated(fn)
    if _type_kind(type(fn)) in "vg":
        return _call_object, (fn, *args)
    if _type_kind(type(getattr(fn, "__self__", None))) == "g":
        return fn.__func__, (fn.__self__, *args)  # type: ignore[attr-defined]
    return fn, args


_EMPTY_CELL = object()
_BY_VALUE = frozenset({int, float, str, bool, bytes, type(None)})


class _FnKey:
    """A step function by what it computes: its code, and what its closure and defaults hold
    (compared by identity, and kept alive so an id is never reused).

    TensorFlow's tutorials define `step_fn` inside the function that calls `run`: a new
    function object on every call. Keyed by the object, every step would compile anew and
    the caches would grow without end.
    """

    __slots__ = ("_code", "_hash", "_held")

    def __init__(self, fn: types.FunctionType) -> None:
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                cells.append(_EMPTY_CELL)
        kwdefaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
        self._code = fn.__code__
        held = (*cells, *(fn.__defaults__ or ()), *(v for _, v in kwdefaults))
        # Python scalars by value (a new float each call is the same constant); the rest by
        # identity.
        self._held = tuple((type(v), v) if type(v) in _BY_VALUE else (None, v) for v in held)
        self._hash = hash((self._code, *(v if t is not None else id(v) for t, v in self._held)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _FnKey)
            and other._code is self._code
            and len(other._held) == len(self._held)
            and all(
                ta is tb and (a == b if ta is not None else a is b)
                for (ta, a), (tb, b) in zip(other._held, self._held, strict=True)
            )
        )


def _fn_key(fn: Callable[..., Any]) -> Any:
    """The cache key of a step (looked up every step: the common cases stay cheap)."""
    if type(fn) is not types.FunctionType:
        return fn
    if fn.__closure__ is None and fn.__defaults__ is None and fn.__kwdefaults__ is None:
        return fn.__code__  # nothing held: the code says it all
    return _FnKey(fn)


def _call_object(obj: Any, *args: Any, **kwargs: Any) -> Any:
    """`strategy.run(model, args=(x,))`: the module travels as an argument, not a capture."""
    return obj(*args, **kwargs)


@dataclasses.dataclass
class _Sorted:
    """The leaves of one call, sorted into the program's inputs."""

    kinds: list[str] = dataclasses.field(default_factory=list)
    unique: list[Any] = dataclasses.field(default_factory=list)
    state: list[jax.Array] = dataclasses.field(default_factory=list)
    slots: dict[int, int] = dataclasses.field(default_factory=dict)
    split: list[jax.Array] = dataclasses.field(default_factory=list)
    rep: list[Any] = dataclasses.field(default_factory=list)
    statics: list[Any] = dataclasses.field(default_factory=list)
    # Slots of per-replica state (one row per replica, split over them; `is_per_replica`).
    local: list[int] = dataclasses.field(default_factory=list)
    # Slots of a ShardedOptimizer's state split over the replicas, and their specs.
    sharded: dict[int, Any] = dataclasses.field(default_factory=dict)
    # Slots of parameters whose gradients are reduce-scattered (ZeRO-2), and their splits.
    scattered: dict[int, Any] = dataclasses.field(default_factory=dict)
    # A padded batch among the inputs: its example mask (split) and real-example count.
    mask: jax.Array | None = None
    count: jax.Array | None = None

    def with_mask(self) -> tuple[list[Any], list[Any]]:
        """The split and replicated inputs, the mask and count appended when present."""
        if self.mask is None:
            return self.split, self.rep
        return [*self.split, self.mask], [*self.rep, self.count]


class _Hollow(NamedTuple):
    """A Variable holding an empty pytree (Optax's `MaskedNode`): its types select the program."""

    variable: type
    value: type


class _Empty(NamedTuple):
    """A zero-size host array among the static arguments: its shape and dtype select the program."""

    shape: tuple[int, ...]
    dtype: str


def sort_leaves(placement: Placement, leaves: list[Any], args: Any, kwargs: Any) -> _Sorted:
    """Sort leaves into the program's three inputs (state, split, replicated) in one pass."""
    out = _Sorted()
    for leaf in leaves:
        kind = _type_kind(type(leaf))
        if kind == "v":
            value = leaf.get_raw_value()
            if _type_kind(type(value)) != "a":
                if is_hollow(value):  # Optax's MaskedNode: a Variable that holds no array
                    out.statics.append(_Hollow(type(leaf), type(value)))
                    out.kinds.append(_STATIC)
                    continue
                value = placement.mirror_host_value(leaf)
            # A ShardedOptimizer's leaf split as planned, per-replica state (split over the
            # replicas, a row each) or mirrored state.
            spec = None if value is None else placement.sharded_spec(leaf, value)
            local = spec is None and value is not None and placement.is_per_replica(value)
            if spec is None and not local and (value is None or not placement.is_mirrored(value)):
                raise placement.argument_error(args, kwargs, leaf)
            slot = out.slots.setdefault(id(leaf), len(out.unique))
            if slot == len(out.unique):
                out.unique.append(leaf)
                out.state.append(value)
                if local:
                    out.local.append(slot)
                if spec is not None:
                    out.sharded[slot] = spec
                scatter = scattered_gradient_spec(leaf)
                if scatter is not None and spec is None and not local:
                    out.scattered[slot] = scatter
            out.kinds.append(_VARIABLE)
        elif kind == "p":
            placement.check_split(leaf)
            # The batch's mask; a stacked value carried over from an earlier step (running
            # sums, say) may hold that step's mask, which is not this batch's.
            if out.mask is None and leaf._mask is not None and not leaf.stacked:
                out.mask, out.count = leaf._mask, leaf._count
            out.split.append(leaf.global_value)
            out.kinds.append(_STACKED if leaf.stacked else _SPLIT)
        elif kind == "a":
            if not placement.is_mirrored(leaf):
                raise placement.argument_error(args, kwargs, leaf)
            out.rep.append(leaf)
            out.kinds.append(_MIRRORED)
        elif kind == "c" and np.size(leaf) == 0:
            # An empty host array holds no data: compile it in (XLA rejects zero-size
            # replicated operands of a manual computation).
            out.statics.append(_Empty(np.shape(leaf), np.asarray(leaf).dtype.str))
            out.kinds.append(_STATIC)
        elif kind == "c":
            out.rep.append(leaf)
            out.kinds.append(_CONSTANT)
        elif kind == "g":
            raise TypeError(
                f"strategy.run expected NNX objects that are pytrees (the Flax default); "
                f"found {type(leaf).__name__}, declared with pytree=False. Fix: drop "
                "pytree=False from its class definition."
            )
        else:
            if isinstance(leaf, Iterator):
                raise ValueError(
                    f"strategy.run expected arrays, batches and state as arguments; found an "
                    f"iterator ({type(leaf).__name__}). Calling next() on it inside the step "
                    "would run at trace time only, once, not every step.\n"
                    "Fix: take the batch on the host and pass it:\n"
                    "  batch = next(iterator)\n"
                    "  strategy.run(step, args=(model, batch))"
                )
            out.statics.append(leaf)
            out.kinds.append(_STATIC)
    return out
