"""`strategy.run`: one cached SPMD program per call signature, and the fast path that calls it.

The hot path does only what must change per step: flatten the arguments, read the variables'
current arrays, call a cached `jax.jit(jax.shard_map(...))` of a pure function, write the new
arrays back. Tracing, graph surgery and validation of the program happen once per signature.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import functools
import inspect
import logging
import operator
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mirrored import config, debug, layers, metrics
from mirrored._core import capture as _capture
from mirrored._core import context as _context
from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.leaves import type_kind as _type_kind
from mirrored._core.mesh import REPLICA_AXIS, REPLICATED, SPLIT
from mirrored._core.values import PerReplica, is_per_replica
from mirrored._run import guard as _fastpath

if TYPE_CHECKING:
    from mirrored._strategy.strategy import Strategy

logger = logging.getLogger("mirrored")

# Leaf kinds of the flattened (args, kwargs).
_VARIABLE = "v"  # an nnx.Variable: mirrored state, read and written back
_MIRRORED = "m"  # a jax.Array identical on every replica
_SPLIT = "s"  # PerReplica whose leading axis is a split batch
_STACKED = "k"  # PerReplica with a leading replica axis
_CONSTANT = "c"  # NumPy array or Python number: the same value on every replica
_STATIC = "x"  # anything else: part of the program, compared by value


def _undecorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function inside `@nnx.jit` / `@jax.jit` (any options): `run` compiles the whole
    step as one SPMD program itself, and a jit nested inside it would trace the replica's
    values as constants of another program."""
    while callable(getattr(fn, "lower", None)) and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _state_as_arguments(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Any, Sequence[Any]]:
    """`run(model, ...)` and `run(model.method, ...)`: the module travels as an argument."""
    fn = _undecorated(fn)
    if _type_kind(type(fn)) in "vg":
        return _call_object, (fn, *args)
    if _type_kind(type(getattr(fn, "__self__", None))) == "g":
        return fn.__func__, (fn.__self__, *args)  # type: ignore[attr-defined]
    return fn, args


# Set by `mirrored.keras` when it is imported: it finds the Keras state a step reaches and
# runs the step with that state as an argument (NOT_BOUND: no Keras state here).
NOT_BOUND = object()
keras_bind: Callable[[Runner, Callable[..., Any], Sequence[Any], dict[str, Any]], Any] | None = None
# Trace-time patches entered while a padded batch's step is traced (Keras' metrics).
masked_trace_patches: list[Callable[[], contextlib.AbstractContextManager[None]]] = []

_EMPTY_CELL = object()
_BY_VALUE = frozenset({int, float, str, bool, bytes, type(None)})
_MAX_IN_FLIGHT = 2  # steps queued before the host waits, with several replicas


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


def _write(variable: nnx.Variable[Any], value: jax.Array) -> None:
    # set_raw_value re-checks the trace state twice per call; on the host, between steps, there
    # is no trace to check, and this loop is on the per-step path.
    object.__setattr__(variable, "_raw_value", value)


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
    # A padded batch among the inputs: its example mask (split) and real-example count.
    mask: jax.Array | None = None
    count: jax.Array | None = None

    def with_mask(self) -> tuple[list[Any], list[Any]]:
        """The split and replicated inputs, the mask and count appended when present."""
        if self.mask is None:
            return self.split, self.rep
        return [*self.split, self.mask], [*self.rep, self.count]


class _Empty(NamedTuple):
    """A zero-size host array among the static arguments: its shape and dtype select the program."""

    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class _Program:
    call: Callable[..., Any]
    out_treedef: Any
    out_stacked: tuple[bool, ...]
    # Outputs computed per example of a padded batch (leading axis = the replica's rows): they
    # carry the batch's mask, so reductions and gathers count real examples only.
    out_masked: tuple[bool, ...] = ()
    # check_numerics: the last output is each replica's finite flags, of its batch leaves
    # first (`check_inputs` of them), then of the checked values (`check_layout`'s stages).
    checked: bool = False
    check_inputs: int = 0
    check_layout: tuple[tuple[str, str], ...] = ()
    name: str = ""
    fn_key: Any = None  # counts the steps of one step function
    steps: int = 1  # per call
    eager: bool = False
    any_masked: bool = dataclasses.field(init=False)  # read every step

    def __post_init__(self) -> None:
        object.__setattr__(self, "any_masked", any(self.out_masked))


class Runner:
    """Compiles and calls `fn` once per replica, for one strategy."""

    def __init__(
        self, strategy: Strategy, *, max_in_flight: int | None, donate: bool = True
    ) -> None:
        self._strategy = strategy
        self._mesh = strategy._mesh
        self._devices = frozenset(strategy.extended.worker_devices)
        self._n = strategy.num_replicas_in_sync
        self._programs: dict[Any, _Program] = {}
        self._guards: dict[Any, _fastpath.Guard | None] = {}
        self._sharding_ok: dict[Any, bool] = {}
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        # One replica has no collective to deadlock: the host runs ahead as in plain JAX (PJRT's
        # own queue bounds it, 32 programs per device), since on CPU each wait costs the
        # devices' threads CPU time (measured: ~7% of a one-device Keras fit step).
        if max_in_flight is None:
            max_in_flight = _MAX_IN_FLIGHT if self._n > 1 else None
        self._max_in_flight = max_in_flight
        self._check_lag = max_in_flight or _MAX_IN_FLIGHT  # finite flags looked at this late
        self._donate = donate
        self._logged = False
        self._eager_traced: set[Any] = set()  # step functions run eagerly at least once
        self._steps_run: dict[Any, int] = {}  # steps run, per step function
        # check_numerics: a mirrored flag, set by the first non-finite step, after which the
        # checked programs change nothing; and the flags not yet looked at (checked with the
        # dispatch bound's lag, so the devices never wait for the host).
        self._failed: jax.Array | None = None
        self._pending: collections.deque[tuple[_Program, jax.Array, int]] = collections.deque()
        _RUNNERS.add(self)

    # -- validation ---------------------------------------------------------------------------

    def is_mirrored(self, x: Any) -> bool:
        """Whether the jax.Array `x` is fully replicated on exactly this strategy's devices."""
        sharding = x.sharding
        ok = self._sharding_ok.get(sharding)
        if ok is None:
            ok = sharding.is_fully_replicated and sharding.device_set == self._devices
            self._sharding_ok[sharding] = ok
        return ok

    def _not_mirrored_error(self, args: Any, kwargs: Any, bad: Any) -> ValueError:
        name = "an argument"
        for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_leaf)[0]:
            if leaf is bad:
                where = "args" if path[0].idx == 0 else "kwargs"
                name = f"{where}{jax.tree_util.keystr(path[1:])}"
                break
        return self.not_mirrored_error(name, bad)

    def not_mirrored_error(self, name: str, bad: Any) -> ValueError:
        value = bad.get_raw_value() if isinstance(bad, nnx.Variable) else bad
        if isinstance(value, jax.Array):
            found = "devices " + ", ".join(sorted(str(d) for d in value.sharding.device_set))
            if not value.sharding.is_fully_replicated:
                found += f" (sharded as {value.sharding})"
        else:
            found = f"a host value of type {type(value).__name__}"
        return ValueError(
            f"strategy.run expected mirrored state: every variable and jax.Array argument "
            f"replicated on this strategy's {self._n} device(s); {name} "
            f"({type(bad).__name__}) lives on {found}. It was most likely created outside "
            "strategy.scope().\n"
            "Fix: create models, optimizers and state inside the scope:\n"
            "  with strategy.scope():\n"
            "      model = MyModel(rngs=nnx.Rngs(0))\n"
            "      optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)\n"
            "(or pass a NumPy array for a constant input)."
        )

    def check_mirrored(self, obj: Any, label: str) -> None:
        """Raise the out-of-scope error for the first variable of `obj` not mirrored here."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(obj, is_leaf=_is_leaf)[0]:
            value = leaf.get_raw_value() if _type_kind(type(leaf)) == "v" else leaf
            if not (isinstance(value, jax.Array) and self.is_mirrored(value)):
                raise self.not_mirrored_error(f"{label}{jax.tree_util.keystr(path)}", leaf)

    def _check_split(self, leaf: PerReplica) -> None:
        sharding = leaf.global_value.sharding
        ok = self._sharding_ok.get(("split", sharding))
        if ok is None:
            ok = sharding.device_set == self._devices
            self._sharding_ok[("split", sharding)] = ok
        if not ok or leaf.num_replicas != self._n:
            raise ValueError(
                f"strategy.run expected PerReplica values over this strategy's {self._n} "
                f"replicas; found one over {leaf.num_replicas} replica(s) on devices "
                f"{sorted(str(d) for d in sharding.device_set)}. Fix: distribute inputs and "
                "run steps with the same strategy."
            )

    # -- the hot path ---------------------------------------------------------------------------

    def _sort(self, leaves: list[Any], args: Any, kwargs: Any) -> _Sorted:
        """Sort leaves into the program's three inputs (state, split, replicated) in one pass."""
        out = _Sorted()
        for leaf in leaves:
            kind = _type_kind(type(leaf))
            if kind == "v":
                value = leaf.get_raw_value()
                if _type_kind(type(value)) != "a" or not self.is_mirrored(value):
                    raise self._not_mirrored_error(args, kwargs, leaf)
                slot = out.slots.setdefault(id(leaf), len(out.unique))
                if slot == len(out.unique):
                    out.unique.append(leaf)
                    out.state.append(value)
                out.kinds.append(_VARIABLE)
            elif kind == "p":
                self._check_split(leaf)
                # The batch's mask; a stacked value carried over from an earlier step (running
                # sums, say) may hold that step's mask, which is not this batch's.
                if out.mask is None and leaf._mask is not None and not leaf.stacked:
                    out.mask, out.count = leaf._mask, leaf._count
                out.split.append(leaf.global_value)
                out.kinds.append(_STACKED if leaf.stacked else _SPLIT)
            elif kind == "a":
                if not self.is_mirrored(leaf):
                    raise self._not_mirrored_error(args, kwargs, leaf)
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

    def __call__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        if keras_bind is not None:  # mirrored.keras is in use: Keras state may be captured
            out = keras_bind(self, fn, args, kwargs)
            if out is not NOT_BOUND:
                return out
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """One step of `fn` on every replica (`__call__` without the Keras bridge)."""
        fn, args = _state_as_arguments(fn, args)
        if config.functions_run_eagerly():
            leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=_is_leaf)
            sorted_ = self._sort(leaves, args, kwargs)
            return self._eagerly(fn, args, kwargs, leaves, treedef, sorted_)
        fn_key = _fn_key(fn)
        guard = self._guards.get(fn_key)
        if guard is not None and guard.program.checked == debug.check_numerics_enabled():
            # Fast path: the state's structure is as last time; only the batch is flattened.
            inputs = guard.inputs(args, kwargs, self._check_split, self.is_mirrored)
            if inputs is not None:
                state, split, rep = inputs
                if state is not guard.written:  # changed since the last step: maybe aliased
                    state = self._own_buffers(state)
                return self._call(guard.program, guard, state, split, rep)
        program, sorted_ = self._program_for(fn, args, kwargs)
        guard = _fastpath.Guard.build(args, kwargs, program, sorted_.unique, self._sort)
        self._guards[fn_key] = guard
        if guard is None:
            guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        return self._call(program, guard, self._own_buffers(sorted_.state), *sorted_.with_mask())

    def call_steps(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        batches: list[Any],
    ) -> Any:
        """`len(batches)` steps of `fn(*args, *batch, **kwargs)` in one program (`run_steps`)."""
        fn, args = _state_as_arguments(fn, args)
        bad = [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_leaf) if is_per_replica(x)]
        if bad:
            raise ValueError(
                "strategy.run_steps expected the batches from the iterator and mirrored state "
                f"in args; found a PerReplica value in args ({bad[0].shape} per replica). A "
                "value that differs per replica cannot stay fixed over several steps.\n"
                "Fix: let the iterator yield it with each batch, or call strategy.run per step."
            )
        calls = [(*args, *(b if isinstance(b, tuple) else (b,))) for b in batches]
        leaves, first = jax.tree.flatten((calls[0], kwargs), is_leaf=_is_leaf)
        treedef: Any = first
        sorted_ = self._sort(leaves, calls[0], kwargs)
        columns: list[list[Any]] = [[] for _ in sorted_.split]
        masks, counts = [], []
        for i, call in enumerate(calls):
            step = sorted_
            if i:
                step_leaves, step_treedef = jax.tree.flatten((call, kwargs), is_leaf=_is_leaf)
                if step_treedef != treedef:
                    raise ValueError(
                        "strategy.run_steps expected every batch of the iterator to have the "
                        f"structure of the first; found {step_treedef} after {treedef}. Fix: "
                        "yield batches of one structure."
                    )
                step = self._sort(step_leaves, call, kwargs)
            for column, value in zip(columns, step.split, strict=True):
                column.append(value)
            masks.append(step.mask)
            counts.append(step.count)
        masked = any(m is not None for m in masks)
        stacked = _stack_steps(
            columns, masks if masked else [], counts if masked else [], self._strategy
        )
        split, rep = (
            ([*stacked[0], stacked[1]], [*sorted_.rep, stacked[2]])
            if masked
            else (stacked[0], sorted_.rep)
        )
        if config.functions_run_eagerly():
            return self._eagerly(
                fn,
                calls[0],
                kwargs,
                leaves,
                treedef,
                sorted_,
                steps=len(batches),
                inputs=(split, rep),
            )
        signature = "".join(sorted_.kinds)
        statics = tuple((type(x), x) for x in sorted_.statics)
        checking = debug.check_numerics_enabled()
        key = ("steps", len(batches), _fn_key(fn), treedef, signature, statics, masked, checking)
        program = self._programs.get(key)
        if program is None:
            if len(sorted_.unique) != signature.count(_VARIABLE):
                raise ValueError(
                    "strategy.run_steps expected each variable once among the arguments; "
                    "found one reachable twice (tied weights). Fix: call strategy.run per step."
                )
            program = self._compile(
                fn,
                calls[0],
                kwargs,
                leaves,
                treedef,
                signature,
                sorted_,
                masked,
                steps=len(batches),
                inputs=(split, rep),
            )
            self._programs[key] = program
        guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        return self._call(program, guard, self._own_buffers(sorted_.state), split, rep)

    def _program_for(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[_Program, _Sorted]:
        """The full path: flatten and sort every leaf, then find or compile the program."""
        leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=_is_leaf)
        sorted_ = self._sort(leaves, args, kwargs)
        signature = "".join(sorted_.kinds)
        # Tied weights (one Variable reachable twice) change the program: one input, one update.
        sharing = None
        if len(sorted_.unique) != signature.count(_VARIABLE):
            sharing = tuple(
                sorted_.slots[id(x)] for x, k in zip(leaves, signature, strict=True) if k == "v"
            )
        masked = sorted_.mask is not None
        statics = tuple((type(x), x) for x in sorted_.statics)  # True and 1 differ
        # `verify` traces BatchNorm on global statistics: a program of its own.
        key = (
            _fn_key(fn),
            treedef,
            signature,
            statics,
            sharing,
            masked,
            layers.synchronizing(),
            debug.check_numerics_enabled(),
        )
        program = self._programs.get(key)
        if program is None:
            program = self._compile(fn, args, kwargs, leaves, treedef, signature, sorted_, masked)
            self._programs[key] = program
        return program, sorted_

    def direct(self, fn: Callable[..., Any], variables: Sequence[Any]) -> Direct | None:
        """`fn`'s compiled step as a call on arrays, for a caller that keeps the state's arrays
        itself (Keras' epoch loops), or None when the last call of `fn` has no such form.

        `variables` are the state's Variables in the caller's order. The step must have run
        once through `run`; its batch is split leaves only (a Keras batch), masked, and its
        outputs the same on every replica (Keras' logs)."""
        guard = self._guards.get(_fn_key(fn))
        if guard is None:
            return None
        program = guard.program
        if (
            program.checked
            or program.eager
            or any(program.out_stacked)
            or not guard.masked
            or set(guard.data_kinds) != {_SPLIT}
            or len(guard.unique) != len(variables)
        ):
            return None
        position = {id(v): i for i, v in enumerate(variables)}
        if any(id(v) not in position for v in guard.unique):
            return None
        return Direct(self, guard, [position[id(v)] for v in guard.unique])

    def lowered(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The program `run(fn, args, kwargs)` executes, traced and lowered (nothing runs)."""
        fn, args = _state_as_arguments(fn, args)
        program, sorted_ = self._program_for(fn, args, kwargs)
        state = [*sorted_.state, self._latch()] if program.checked else sorted_.state
        return program.call.lower(state, *sorted_.with_mask())  # type: ignore[attr-defined]

    def compiled_text(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> str:
        """The optimized HLO of the program `run(fn, args, kwargs)` executes (nothing runs)."""
        return str(self.lowered(fn, args, kwargs).compile().as_text())

    def _eagerly(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        sorted_: _Sorted,
        *,
        steps: int | None = None,
        inputs: tuple[list[Any], list[Any]] | None = None,
    ) -> Any:
        """`fn` op by op (`run_functions_eagerly`): the compiled path's program, traced with
        the values themselves under `jax.disable_jit`, so `print`, `breakpoint()` and Python
        `if` on values the same on every replica work inside the step."""
        config.warn_eager_once()
        masked = sorted_.mask is not None
        kinds = "".join(sorted_.kinds)
        run = self._compile(
            fn, args, kwargs, leaves, treedef, kinds, sorted_, masked, steps, inputs, eager=True
        )
        split, rep = sorted_.with_mask() if inputs is None else inputs
        state = sorted_.state
        if debug.check_numerics_enabled():
            state = [*state, self._latch()]
        with _cached_eager_primitives(), jax.disable_jit():
            program = run(state, split, rep)
        guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        return self._call(program, guard, sorted_.state, split, rep)

    def _call(
        self,
        program: _Program,
        guard: _fastpath.Guard,
        state: list[jax.Array],
        split: list[jax.Array],
        rep: list[Any],
    ) -> Any:
        with peer_failures():
            if program.checked:  # the latch goes in and out with the state
                new_state, outs, token = program.call([*state, self._latch()], split, rep)
                *new_state, self._failed = new_state
                *outs, flags = outs
            else:
                new_state, outs, token = program.call(state, split, rep)
            for variable, value in zip(guard.unique, new_state, strict=True):
                _write(variable, value)
            guard.written = new_state
            self._bound_dispatch(token)
            first = self._count_steps(program)
            if program.checked:
                flags.copy_to_host_async()  # on the host by the time it is looked at
                self._pending.append((program, flags, first))
                self.check_pending(keep=0 if program.eager else self._check_lag)
        n = self._n
        # Outputs per example of a padded batch carry its mask (a masked program takes it last).
        mask, count = (split[-1], rep[-1]) if program.any_masked else (None, None)
        return jax.tree.unflatten(
            program.out_treedef,
            [
                PerReplica(
                    x,
                    num_replicas=n,
                    stacked=True,
                    mask=mask if masked else None,
                    count=count if masked else None,
                )
                if stacked
                else x
                for x, stacked, masked in zip(
                    outs, program.out_stacked, program.out_masked, strict=True
                )
            ],
        )

    def _latch(self) -> jax.Array:
        if self._failed is None:
            self._failed = jax.device_put(np.zeros((), bool), self._strategy._replicated)
        return self._failed

    def check_pending(self, keep: int = 0) -> None:
        """Look at the finite flags of all but the newest `keep` checked steps; raise
        `NonFiniteError` for the first step whose values were not all finite."""
        while len(self._pending) > keep:
            program, flags, first = self._pending.popleft()
            found = np.asarray(flags)  # waits for this step unless the dispatch bound did
            if found.ndim == 2:  # one step: (replicas, flags); run_steps: (replicas, steps, _)
                found = found[:, None, :]
            inputs = found[:, :, : program.check_inputs]
            values = found[:, :, program.check_inputs :]
            good = values.all(axis=(0, 2))
            if good.all():
                continue
            k = int(np.argmin(good))
            # The steps dispatched after it changed nothing (the latch); from now on they
            # train again, from the state before the failed step.
            later = sum(p.steps for p, _, _ in self._pending) + found.shape[1] - k - 1
            self._pending.clear()
            self._failed = None
            raise _non_finite_error(program, first + k, ~values[:, k], ~inputs[:, k], later)

    def _own_buffers(self, state: list[jax.Array]) -> list[jax.Array]:
        """The state with every array held once: a donated buffer must have one owner.

        Two variables may hold one array (`nnx.clone`, `target.kernel[...] = model.kernel[...]`,
        tied EMA or target networks); donating it twice would crash the runtime. The second
        holder gets a copy.
        """
        if not self._donate or len({id(x) for x in state}) == len(state):
            return state
        seen: set[int] = set()
        owned = []
        for x in state:
            owned.append(jnp.copy(x) if id(x) in seen else x)
            seen.add(id(x))
        return owned

    def _count_steps(self, program: _Program) -> int:
        """Count a call's steps of its step function; returns the number of its first."""
        first = self._steps_run.get(program.fn_key, 0)
        self._steps_run[program.fn_key] = first + program.steps
        return first

    def _bound_dispatch(self, token: jax.Array) -> None:
        # Simulated CPU devices deadlock in collectives when too many steps are queued; real
        # accelerators gain nothing from a deeper queue either.
        if self._max_in_flight is None:
            return
        self._in_flight.append(token)
        while len(self._in_flight) > self._max_in_flight:
            self._in_flight.popleft().block_until_ready()

    # -- compiling --------------------------------------------------------------------------------

    def _compile(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        kinds: str,
        sorted_: _Sorted,
        masked: bool,
        steps: int | None = None,
        inputs: tuple[list[Any], list[Any]] | None = None,
        *,
        eager: bool = False,
    ) -> Any:
        """The program for one signature; `steps`: `run_steps`' K steps in one program, on
        `inputs` (the stacked split and replicated inputs) instead of `sorted_`'s. `eager`:
        instead, a function that runs the step once on its inputs, without compiling, and
        returns a `_Program` that hands out what it computed."""
        unique = sorted_.unique
        captured = _capture.find_captured(fn, self.is_mirrored)
        if captured:
            raise _capture.captured_state_error(fn, captured)
        position = {id(v): i for i, v in enumerate(unique)}
        # How to rebuild each leaf inside the trace; holds no argument arrays alive.
        plan: list[tuple[str, Any]] = [
            (kind, position[id(leaf)] if kind == _VARIABLE else leaf if kind == _STATIC else None)
            for leaf, kind in zip(leaves, kinds, strict=True)
        ]
        var_treedefs = [jax.tree.structure(v) for v in unique]
        # NNX random streams (nnx.Rngs, Dropout): each replica draws from its own key.
        rng_slots = [i for i, v in enumerate(unique) if isinstance(v, nnx.RngKey)]
        # BatchNorm's moving statistics, updated from each replica's own batch statistics,
        # are averaged across replicas before they are written back (TensorFlow's rule).
        stat_slots = [i for i, v in enumerate(unique) if isinstance(v, nnx.BatchStat)]
        # mirrored.metrics sums: each replica adds its own rows; the additions are summed
        # (TensorFlow's SYNC_ON_READ SUM), so the state stays mirrored.
        flax_sums = metrics.summable_flax_states((args, kwargs))
        flax_metrics = metrics.flax_metric_classes((args, kwargs))
        metric_slots = [
            i
            for i, v in enumerate(unique)
            if isinstance(v, metrics.MetricState) or id(v) in flax_sums
        ]
        fn_name = getattr(fn, "__name__", type(fn).__name__)
        recorded: dict[str, Any] = {}
        # The trace-time warnings, once per step function (an eager step traces every call).
        quiet = eager and _fn_key(fn) in self._eager_traced
        checking = debug.check_numerics_enabled()
        state_names = _state_names(fn, args, kwargs, unique) if checking else []

        def one_step(
            state: list[Any], split: list[Any], rep: list[Any], mask: Any, count: Any, warn: bool
        ) -> tuple[list[Any], Any, Any]:
            """One step of `fn` on this replica: the new state (mirrored again), the output,
            and under check_numerics the finite flags (of the batch, of the values)."""
            # One replica draws from the keys themselves: the numbers of the plain script.
            inner = _replica_keys(state, rng_slots) if self._n > 1 else list(state)
            fresh = [jax.tree.unflatten(td, [x]) for td, x in zip(var_treedefs, inner, strict=True)]
            split_it, rep_it = iter(split), iter(rep)
            rebuilt = []
            for kind, payload in plan:
                if kind == _VARIABLE:
                    rebuilt.append(fresh[payload])
                elif kind == _SPLIT:
                    rebuilt.append(next(split_it))
                elif kind == _STACKED:
                    rebuilt.append(next(split_it)[0])
                elif kind in (_MIRRORED, _CONSTANT):
                    rebuilt.append(next(rep_it))
                else:
                    rebuilt.append(payload)
            call_args, call_kwargs = jax.tree.unflatten(treedef, rebuilt)
            ctx = _context.ReplicaContext(
                self._strategy,
                in_spmd=True,
                example_mask=mask,
                example_count=count,
                batch_is_split=_SPLIT in kinds,
            )
            ctx.warnings = warn  # trace-time warnings: on the first of the two traces only
            token = _context.enter_replica(ctx)
            gradients: list[Any] = []
            try:
                # A padded batch: BatchNorm statistics and Flax metrics leave padded rows out.
                with contextlib.ExitStack() as patches:
                    patches.enter_context(layers.varying_rnn_carries())
                    if checking:
                        patches.enter_context(_capturing_gradients(gradients))
                    if flax_metrics:
                        patches.enter_context(metrics.flax_metric_updates(flax_metrics))
                    if masked:
                        patches.enter_context(layers.masked_batch_norm())
                        for patch in masked_trace_patches:
                            patches.enter_context(patch())
                    out = fn(*call_args, **call_kwargs)
            except jax.errors.TracerBoolConversionError as error:
                raise _python_branch_error(error, fn_name, eager) from error
            finally:
                _context.exit_replica(token)
            new_state = [v.get_raw_value() for v in fresh]
            for i in rng_slots:  # an unchanged stream keeps its mirrored key; its count moves on
                if new_state[i] is inner[i]:
                    new_state[i] = state[i]
            # Flax metrics of the user's own whose update only adds to their state: sums too.
            slot_of = {id(v): i for i, v in enumerate(fresh)}
            sums = ctx.summed_states - ctx.not_summed_states
            added = {slot_of[v] for v in sums if v in slot_of} - set(metric_slots)
            for i in [*metric_slots, *sorted(added)]:
                new_state[i] = summed_over_replicas(state[i], new_state[i], self._n)
            for i in stat_slots:  # TensorFlow's ON_READ MEAN for moving statistics
                if _context.is_varying(new_state[i]):
                    new_state[i] = _mean_over_replicas(new_state[i], mask)
            for variable, value in zip(unique, new_state, strict=True):
                if _context.is_varying(value):
                    raise _diverged_error(fn_name, args, kwargs, variable)
            if warn:  # the first of the two traces
                _warn_per_replica_mean(fn_name, ctx, unique, state, new_state, kinds, self._n)
            flags = None
            if checking:
                flags, layout = _finite_flags(split, out, gradients, new_state, state_names)
                recorded["check"] = layout
            return new_state, out, flags

        def body(state: list[Any], split: list[Any], rep: list[Any], *, expand: Any) -> Any:
            failed = None
            if checking:  # the latch: set, the step changes nothing
                state, failed = state[:-1], state[-1]
            mask = count = None
            if masked:
                mask, count = split[-1], rep[-1]
                split, rep = split[:-1], rep[:-1]
            if steps is None:
                new_state, out, flags = one_step(
                    state, split, rep, mask, count, expand is None and not quiet
                )
                if checking:  # a non-finite value on any replica: every replica keeps its state
                    new_state, failed = _unless_non_finite(flags, new_state, state, failed)
                rows = None if mask is None else mask.shape[0]
            else:  # `run_steps`: the batches (and masks, counts) stacked on a leading step axis

                def scan_step(carry: Any, xs: Any) -> tuple[Any, Any]:
                    state_k, failed = carry
                    split_k, mask_k, count_k = xs
                    new, out, flags = one_step(
                        state_k, split_k, rep, mask_k, count_k, expand is None and not quiet
                    )
                    if checking:  # after a non-finite step, the state stays as before it
                        new, failed = _unless_non_finite(flags, new, state_k, failed)
                    return (new, failed), (jax.tree.map(jnp.asarray, out), flags)

                (new_state, failed), (out, flags) = jax.lax.scan(
                    scan_step,
                    (list(state), jnp.zeros((), bool) if failed is None else failed),
                    (split, mask, count),
                    unroll=unrolled[0],
                )
                rows = None  # outputs are stacked by step, not by example
            out_leaves, out_treedef = jax.tree.flatten(out)
            out_leaves = [jnp.asarray(x) for x in out_leaves]
            varying = tuple(_context.is_varying(x) for x in out_leaves)
            per_example = tuple(
                v and x.ndim >= 1 and x.shape[0] == rows
                for x, v in zip(out_leaves, varying, strict=True)
            )
            recorded["out"] = (out_treedef, varying, per_example)
            # The first trace has no layout yet: give every output a replica axis.
            expand = (True,) * len(out_leaves) if expand is None else expand
            outs = [x[None] if e else x for x, e in zip(out_leaves, expand, strict=True)]
            if checking:  # the flags, an extra last output, per replica; the latch
                outs.append(jnp.concatenate(flags, axis=-1)[None])
                new_state = [*new_state, failed]
            return new_state, outs, jnp.zeros((), jnp.int32)

        unrolled = [False]  # run_steps' scan, unrolled (below: convolutions on CPU)
        # K steps: every split input carries the step on its leading axis, the batch on the next.
        split_spec = SPLIT if steps is None else PartitionSpec(None, REPLICA_AXIS)

        def program(expand: Any, out_specs: Any) -> Any:
            return jax.shard_map(
                lambda s, d, r: body(s, d, r, expand=expand),
                mesh=self._mesh,
                in_specs=(REPLICATED, split_spec, REPLICATED),
                out_specs=(REPLICATED, out_specs, REPLICATED),
                check_vma=True,
            )

        def program_fields() -> dict[str, Any]:
            fields = {"fn_key": _fn_key(fn), "steps": steps or 1, "eager": eager, "name": fn_name}
            if checking:
                inputs, layout = recorded["check"]
                fields.update(checked=True, check_inputs=inputs, check_layout=tuple(layout))
            return fields

        if eager:

            def run(state: list[Any], split: list[Any], rep: list[Any]) -> _Program:
                # Every output with a replica axis (as the first trace of the compiled path);
                # those the same on every replica are then taken from the first replica.
                new_state, outs, token = program(None, SPLIT)(state, split, rep)
                self._eager_traced.add(_fn_key(fn))
                out_treedef, varying, per_example = recorded["out"]
                outs, extra = outs[: len(varying)], outs[len(varying) :]  # extra: the flags
                outs = [x if v else x[0] for x, v in zip(outs, varying, strict=True)]
                done = (new_state, [*outs, *extra], token)
                return _Program(
                    call=lambda *_: done,
                    out_treedef=out_treedef,
                    out_stacked=varying,
                    out_masked=per_example,
                    **program_fields(),
                )

            return run
        state = [*sorted_.state, self._latch()] if checking else sorted_.state
        split, rep = sorted_.with_mask() if inputs is None else inputs
        # First trace: learn which outputs differ between replicas, to choose their specs.
        jax.eval_shape(program(None, SPLIT), state, split, rep)
        out_treedef, varying, per_example = recorded["out"]
        out_specs = [SPLIT if v else REPLICATED for v in varying] + [SPLIT] * checking

        def jitted() -> Any:
            return jax.jit(program(varying, out_specs), donate_argnums=0 if self._donate else ())

        call = jitted()
        # XLA:CPU runs a convolution inside a loop dozens of times slower than outside one
        # (measured: a small CNN step 8 ms alone, 419 ms in a scan, 8 ms fully unrolled):
        # such a program gets its K steps unrolled (compiling takes longer instead).
        if (
            steps is not None
            and self._mesh.devices.flat[0].platform == "cpu"
            and "convolution" in call.lower(state, split, rep).as_text()
        ):
            unrolled[0] = True
            call = jitted()
        if not self._logged:
            self._log_first_program(fn_name, call, state, split, rep)
        return _Program(
            call=call,
            out_treedef=out_treedef,
            out_stacked=varying,
            out_masked=per_example,
            **program_fields(),
        )

    def _log_first_program(self, fn_name: str, call: Any, *inputs: Any) -> None:
        self._logged = True
        if not logger.isEnabledFor(logging.INFO):
            return
        text = call.lower(*inputs).as_text()
        count = text.count("all_reduce")
        logger.info(
            "Compiled %r as one SPMD program over %d replica(s) on axis %r: %d all-reduce "
            "op(s) over %d replicas synchronise it.",
            fn_name,
            self._n,
            REPLICA_AXIS,
            count,
            self._n,
        )


def _stack_steps(
    columns: list[list[jax.Array]], masks: list[Any], counts: list[Any], strategy: Strategy
) -> tuple[list[jax.Array], Any, Any]:
    """Each split input's K values stacked on a new leading step axis (the batch axis stays
    split over the replicas); with `masks`, the K masks and real-example counts likewise
    (a batch without padding gets an all-real mask)."""
    by_step = NamedSharding(strategy._mesh, PartitionSpec(None, REPLICA_AXIS))
    if masks:
        rows = next(m.shape[0] for m in masks if m is not None)
        masks = [jnp.ones((rows,), jnp.bool_) if m is None else m for m in masks]
        counts = [jnp.int32(rows) if c is None else c for c in counts]
    stacked, mask = _stack_jit(tuple(map(tuple, columns)), tuple(masks), by_step)
    count = jax.device_put(jnp.stack(counts), strategy._replicated) if masks else None
    return list(stacked), mask, count


@functools.partial(jax.jit, static_argnames=("sharding",))
def _stack_jit(columns: Any, masks: Any, sharding: Any) -> Any:
    stack = [jax.lax.with_sharding_constraint(jnp.stack(c), sharding) for c in columns]
    mask = jax.lax.with_sharding_constraint(jnp.stack(masks), sharding) if masks else None
    return stack, mask


def summed_over_replicas(old: jax.Array, new: jax.Array, n: int) -> jax.Array:
    """A running sum after every replica added its rows: `old + Σ_replicas (new_r - old)`
    (TensorFlow's SYNC_ON_READ SUM); an addition the same on every replica counts N times."""
    added = new - old
    return old + (jax.lax.psum(added, REPLICA_AXIS) if _context.is_varying(added) else added * n)


def _mean_over_replicas(value: jax.Array, mask: jax.Array | None) -> jax.Array:
    """The mean across replicas of a moving statistic; replicas with no real row left out."""
    if mask is None or not jnp.issubdtype(value.dtype, jnp.inexact):
        return jax.lax.pmean(value, REPLICA_AXIS)
    real = mask.any()
    total = jax.lax.psum(jnp.where(real, value, jnp.zeros_like(value)), REPLICA_AXIS)
    replicas = jax.lax.psum(real.astype(value.dtype), REPLICA_AXIS)
    return total / jnp.maximum(replicas, 1)


def _replica_keys(state: list[Any], slots: list[int]) -> list[Any]:
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
        inner[i] = jax.random.fold_in(state[i], replica)
    return inner


loss_logger = logging.getLogger("mirrored.loss")


def _warn_per_replica_mean(
    fn_name: str,
    ctx: _context.ReplicaContext,
    variables: list[Any],
    before: list[Any],
    after: list[Any],
    kinds: str,
    n: int,
) -> None:
    """Name the N× trap where it happens: parameters trained from a per-replica mean loss.

    Gradients of mirrored parameters are summed over replicas. A loss averaged over this
    replica's shard (`jnp.mean`) instead of divided by the global batch trains with N× the
    gradient, in TensorFlow too. The step is suspect when it updated parameters from
    replica-varying inputs and never scaled a loss for the sum (compute_average_loss).
    """
    if n == 1 or ctx.replica_aware or not (_SPLIT in kinds or _STACKED in kinds):
        return
    trained = [
        v
        for v, old, new in zip(variables, before, after, strict=True)
        if isinstance(v, nnx.Param) and new is not old
    ]
    if not trained:
        return
    loss_logger.warning(
        "%r updates mirrored parameters from a loss that mirrored.compute_average_loss did not "
        "scale. Gradients of mirrored parameters are SUMMED over the %d replicas, so a loss "
        "averaged over each replica's shard (jnp.mean, optax...(...).mean()) trains with %d× "
        "the gradient of the global batch (%d× the learning rate).\n"
        "  Right:  loss = mirrored.compute_average_loss(per_example_loss)\n"
        "  or:     loss = jnp.sum(per_example_loss) / GLOBAL_BATCH_SIZE\n"
        "If the step already divides by the global batch size, silence this check with "
        "logging.getLogger('mirrored.loss').setLevel(logging.ERROR).",
        fn_name,
        n,
        n,
        n,
    )


class _CachingJit:
    """`jax._src.api` for eager `shard_map`, whose every primitive calls `api.jit` on a new
    (but equal) `HashablePartial`: here the compiled function is kept per partial, so a
    primitive seen before dispatches from cache instead of being traced, lowered and looked
    up in the compilation cache again (measured on a 12-32-5 MLP with Adam: 4.9 s → 0.4 s
    per eager step on one device, 9 s → 0.8 s on 8)."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def jit(self, fun: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._api.jit(fun, *args, **kwargs)
        try:
            compiled = self._cache.get(fun)
        except TypeError:  # unhashable parameters
            return self._api.jit(fun)
        if compiled is None:
            compiled = self._cache[fun] = self._api.jit(fun)
            if len(self._cache) > 4096:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(fun)
        return compiled


_EAGER_JIT: list[_CachingJit] = []
_RUNNERS: weakref.WeakSet[Runner] = weakref.WeakSet()  # every runner: for check_numerics


def check_all_pending() -> None:
    """Every runner's checked steps not looked at yet (`disable_check_numerics`)."""
    for runner in list(_RUNNERS):
        runner.check_pending()


@atexit.register
def _report_pending_at_exit() -> None:
    """A program that ends right after a non-finite step still hears of it."""
    for runner in list(_RUNNERS):
        try:
            runner.check_pending()
        except debug.NonFiniteError as error:
            logger.error("check_numerics, at exit: %s", error)
        except Exception:  # the runtime may be shutting down; nothing to report then
            return


@contextlib.contextmanager
def _cached_eager_primitives() -> Iterator[None]:
    """While a step runs eagerly: eager shard_map's per-primitive programs are cached."""
    from jax._src import shard_map as shard_map_impl

    original = getattr(shard_map_impl, "api", None)
    if original is None or isinstance(original, _CachingJit):  # another JAX, or nested
        yield
        return
    if not _EAGER_JIT:
        _EAGER_JIT.append(_CachingJit(original))
    shard_map_impl.api = _EAGER_JIT[0]  # type: ignore[assignment]
    try:
        yield
    finally:
        shard_map_impl.api = original


@contextlib.contextmanager
def _capturing_gradients(seen: list[Any]) -> Iterator[None]:
    """While a step is traced under check_numerics: the gradients given to
    `nnx.Optimizer.update` (its `LossScaleOptimizer` hands it finite ones) are recorded."""
    original = nnx.Optimizer.update

    def update(self: Any, model: Any, grads: Any, **kwargs: Any) -> Any:
        seen.append(grads)
        return original(self, model, grads, **kwargs)

    nnx.Optimizer.update = update  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nnx.Optimizer.update = original  # type: ignore[method-assign]


def _leaf_name(path: Any) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name != "value":
                parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key))
    return ".".join(parts)


def _state_names(
    fn: Any, args: Sequence[Any], kwargs: dict[str, Any], unique: list[Any]
) -> list[str]:
    """A readable name for each of the step's variables: the step's parameter name, then
    the path inside it (`model.hidden.kernel`, `optimizer.opt_state.0.mu.hidden.kernel`)."""
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    position = {id(v): i for i, v in enumerate(unique)}
    names = [type(v).__name__ for v in unique]
    found = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=_is_leaf)[0]
    for path, leaf in reversed(found):  # the first path reaching a variable names it
        if id(leaf) not in position:
            continue
        if path[0].idx == 0 and isinstance(path[1], jax.tree_util.SequenceKey):
            index = path[1].idx
            head = params[index] if index < len(params) else f"args[{index}]"
            names[position[id(leaf)]] = ".".join(filter(None, [head, _leaf_name(path[2:])]))
        else:
            names[position[id(leaf)]] = _leaf_name(path[1:])
    return names


def _finite(x: Any) -> Any:
    """Whether every element of `x` is finite, as a per-replica (varying) boolean."""
    flag = jnp.all(jnp.isfinite(x))
    return flag if _context.is_varying(flag) else jax.lax.pcast(flag, REPLICA_AXIS, to="varying")


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.inexact)


def _finite_flags(
    batch: list[Any], out: Any, gradients: list[Any], new_state: list[Any], names: list[str]
) -> tuple[tuple[Any, Any], tuple[int, list[tuple[str, str]]]]:
    """This replica's finite flags: of its batch (reported, never an error by itself), then
    of the step's outputs, the gradients it applied and its new state; and their layout."""
    batch_flags = [_finite(x) for x in batch if _floating(x)]
    layout: list[tuple[str, str]] = []
    flags = []
    for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
        if _floating(jnp.asarray(x)):
            flags.append(_finite(x))
            layout.append(("outputs", _leaf_name(path) or "the output"))
    for grads in gradients:
        for path, x in jax.tree_util.tree_flatten_with_path(grads)[0]:
            if _floating(x):
                flags.append(_finite(x))
                layout.append(("gradients", _leaf_name(path)))
    for name, x in zip(names, new_state, strict=True):
        if _floating(x):
            flags.append(_finite(x))
            layout.append(("state", name))

    def stack(values: list[Any]) -> Any:
        if not values:
            return jax.lax.pcast(jnp.zeros((0,), bool), REPLICA_AXIS, to="varying")
        return jnp.stack(values)

    return (stack(batch_flags), stack(flags)), (len(batch_flags), layout)


def _unless_non_finite(
    flags: tuple[Any, Any], new: list[Any], old: list[Any], failed: Any
) -> tuple[list[Any], Any]:
    """`new`, or `old` on every replica when a checked value is not finite on any replica (or
    an earlier step of the program failed); and whether this or an earlier step failed."""
    bad = jax.lax.psum(jnp.sum(~flags[1]), REPLICA_AXIS) > 0
    failed = jnp.logical_or(failed, bad)
    kept = [_select(failed, o, n) for o, n in zip(old, new, strict=True)]
    return kept, failed


def _select(failed: Any, old: Any, new: Any) -> Any:
    """`old` where `failed`, else `new` (a select XLA fuses into the update; a PRNG key,
    which has no arithmetic select, through `lax.cond`)."""
    if jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key):
        return jax.lax.cond(failed, lambda: old, lambda: new)
    return jnp.where(failed, old, new)


def _non_finite_error(
    program: _Program, step: int, bad: np.ndarray, bad_batch: np.ndarray, later: int
) -> debug.NonFiniteError:
    """The error for a step whose values `bad` (replicas × checked values) were not finite."""
    layout = program.check_layout
    paths: dict[str, list[str]] = {}
    stage, replicas = "", []
    for j, (where, name) in enumerate(layout):
        if bad[:, j].any():
            paths.setdefault(where, []).append(name)
    for where in ("outputs", "gradients", "state"):
        columns = [j for j, (w, _) in enumerate(layout) if w == where]
        hit = [int(r) for r in np.nonzero(bad[:, columns].any(axis=1))[0]] if columns else []
        if hit:
            stage, replicas = where, hit
            break
    path = paths[stage][0]
    parameter = (paths.get("gradients") or paths.get("state") or [""])[0]
    parameter_stage = "gradients" if paths.get("gradients") else "state"
    batch_replicas = [int(r) for r in np.nonzero(bad_batch.any(axis=1))[0]]
    more = len(paths[stage]) - 1
    where_text = {
        "outputs": "the step's output" + ("" if path == "the output" else f" {path}"),
        "gradients": f"the gradients, of {path}",
        "state": f"the updated state, {path}",
    }[stage]
    message = (
        f"Non-finite values (NaN or infinity) at step {step} of {program.name!r} (counting from "
        f"0): first in {where_text}"
        + (f" (and {more} more)" if more and stage != "outputs" else "")
        + f", on replica(s) {replicas} of {bad.shape[0]}"
        + (
            f"; the batch on replica(s) {batch_replicas} already held non-finite values"
            if batch_replicas
            else ""
        )
        + "."
        + (
            f" The first parameter it reached: {parameter} (in the {parameter_stage})."
            if parameter and stage == "outputs"
            else ""
        )
        + " Non-finite: "
        + "; ".join(
            f"{w}: {', '.join(names[:4])}{' …' if len(names) > 4 else ''}"
            for w, names in paths.items()
        )
        + ". The step was not applied: the model and optimizer are as they were before it"
        + (
            f" (the {later} step(s) dispatched after it, asynchronously, changed nothing)"
            if later
            else ""
        )
        + ".\n"
        "Fix: look for NaN/inf in the input data (the batch), a log or sqrt of 0, or a "
        "division by 0 in the loss; lower the learning rate or clip gradients "
        "(Trainer(global_clipnorm=1.0), optax.clip_by_global_norm); for float16, loss "
        "scaling (mirrored.mixed_precision)."
    )
    return debug.NonFiniteError(
        message,
        step=step,
        replicas=replicas,
        stage=stage,
        path=path,
        parameter=parameter,
        paths=paths,
        batch_replicas=batch_replicas,
    )


class PythonBranchError(jax.errors.TracerBoolConversionError):
    """Python `if`, `while` or `bool()` on a value inside the step that has no Python truth
    value: traced (compiled mode) or different on each replica (eager mode)."""

    def __init__(self, message: str) -> None:
        TypeError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0])


def _python_branch_error(error: Exception, fn_name: str, eager: bool) -> PythonBranchError:
    varying = "{V:" in str(error)
    fix = (
        "Fix: compute both sides and choose per element with jnp.where(condition, a, b), or "
        "run one branch with jax.lax.cond(predicate, true_fn, false_fn, *operands) "
        "(jax.lax.while_loop for a while)"
    )
    if varying:
        return PythonBranchError(
            f"Python if/while/bool() in {fn_name!r} on a value that differs per replica: "
            "each replica would need its own Python branch, but the step is one program for "
            f"all of them{' (even when run eagerly)' if eager else ''}. {fix}; or make the "
            "value the same on every replica first, e.g. "
            "mirrored.get_replica_context().all_reduce('SUM', value)."
        )
    return PythonBranchError(
        f"Python if/while/bool() in {fn_name!r} on a traced value: strategy.run compiles the "
        f"step, so its values have no Python truth value while it is traced. {fix}; or, to "
        "debug with Python control flow, mirrored.config.run_functions_eagerly(True) (then "
        "Python branches work on values that are the same on every replica)."
    )


class PeerFailureError(RuntimeError):
    """A collective failed because another worker process died or stalled."""


def _collective_failure(error: BaseException) -> bool:
    text = str(error)
    return any(
        marker in text
        for marker in ("Gloo", "gloo", "Connection reset", "collective", "DEADLINE_EXCEEDED")
    )


class Direct:
    """A compiled step called on the state's arrays, not its Variables (`Runner.direct`).

    Keras' epoch loop hands each step the arrays the last one returned. Writing them into the
    Variables, proving the state's structure unchanged and reading them back costs host time
    that, on CPU, the devices' threads wait for (measured: ~40 us of a ~1.1 ms step of the seed
    MLP). A call returns None, for the caller's full path, unless the arrays are the very ones
    the last call returned (mirrored by construction) and nothing that selects the program
    (eager mode, check_numerics, a recompiled step) has changed.
    """

    def __init__(self, runner: Runner, guard: _fastpath.Guard, order: list[int]) -> None:
        self._runner = runner
        self._guard = guard
        self._order = order  # program's state position -> caller's position
        self._returned: list[Any] | None = None

    def __call__(self, values: list[Any], batch: Any) -> tuple[Any, list[Any]] | None:
        runner, guard, returned = self._runner, self._guard, self._returned
        if (
            returned is None
            or len(values) != len(returned)
            or not all(map(operator.is_, values, returned))
            or config.functions_run_eagerly()
            or debug.check_numerics_enabled()
            or runner._guards.get(guard.program.fn_key) is not guard
        ):
            return None
        leaves, treedef = jax.tree.flatten([batch])  # as the guard flattened the data
        if treedef != guard.data_treedef or any(type(x) is not PerReplica for x in leaves):
            return None
        first = leaves[0]
        if first._mask is None:
            return None
        split = [leaf.global_value for leaf in leaves]
        split.append(first._mask)
        program = guard.program
        with peer_failures():
            new_state, outs, token = program.call(
                [values[i] for i in self._order], split, [first._count]
            )
            runner._bound_dispatch(token)
        runner._count_steps(program)
        guard.written = new_state  # what the Variables will be given, if the full path runs
        new = list(values)
        for value, i in zip(new_state, self._order, strict=True):
            new[i] = value
        self._returned = new
        return jax.tree.unflatten(program.out_treedef, outs), new

    def returned(self, values: list[Any]) -> None:
        """The arrays the full path returned to the caller: the next call may take them."""
        self._returned = list(values)


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turn a failed cross-process collective into a `PeerFailureError` that says why."""
    try:
        yield
    except Exception as error:
        if jax.process_count() > 1 and _collective_failure(error):
            raise PeerFailureError(
                "A collective between the worker processes failed: a peer process most likely "
                "died or stalled (its connection was reset, or the collective timed out). This "
                "process cannot continue.\n"
                "Fix: check the other workers' logs for the first error; restart the job "
                "(BackupAndRestore resumes it). The timeout is XLA's "
                "--xla_cpu_collective_timeout_seconds (set in XLA_FLAGS before start)."
            ) from error
        raise


class ReplicaDivergenceError(ValueError):
    """A step wrote a replica-local value into mirrored state."""


def _diverged_error(fn_name: str, args: Any, kwargs: Any, variable: Any) -> ValueError:
    name = type(variable).__name__
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_leaf)[0]:
        if leaf is variable:
            name = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            break
    if isinstance(variable, nnx.metrics.MetricState):
        owner = next(
            (
                type(m).__name__
                for m in metrics.flax_metrics((args, kwargs))
                if any(v is variable for v in vars(m).values())
            ),
            "metric",
        )
        return ReplicaDivergenceError(
            f"{fn_name!r} updated the Flax metric state {name} (of a {owner}) from this "
            "replica's shard of the "
            "batch, so it differs between replicas. A Flax metric whose update only adds to "
            "its state (Average, Accuracy, MultiMetrics of them, or your own Metric with "
            "`self.total[...] += ...`) holds sums, which strategy.run adds across replicas for "
            f"you; this {owner}'s update is not a sum (it rescales or replaces its old state, "
            "as Welford's running mean does), so N replicas cannot combine it exactly.\n"
            "Fix: use mirrored.metrics (Mean, Accuracy, SparseCategoricalAccuracy, ...), or "
            "nnx.metrics.Average, whose sums every replica adds to:\n"
            "  with strategy.scope():\n"
            "      accuracy = mirrored.metrics.SparseCategoricalAccuracy()\n"
            "  # in the step: accuracy.update_state(y, logits); after it: accuracy.result()"
        )
    return ReplicaDivergenceError(
        f"{fn_name!r} wrote a value into the mirrored variable {name} that differs between "
        "replicas (it was computed from this replica's shard of the batch). Mirrored state must "
        "stay identical on every replica, or the replicas silently drift apart.\n"
        "Fix: combine the replicas' values before assigning, with the reduction that fits:\n"
        "  ctx = mirrored.get_replica_context()\n"
        "  total[...] = total[...] + ctx.all_reduce('SUM', local_sum)    # counters, sums\n"
        "  stat[...] = ctx.all_reduce('MEAN', local_statistic)           # averages\n"
        "(a running total of a metric needs SUM of the additions, never MEAN of the totals; "
        "mirrored.metrics does it for you), "
        "or keep per-replica running values out of the model: return them from the step and "
        "combine them with strategy.reduce. BatchNorm's nnx.BatchStat statistics are averaged "
        "for you; gradients of a loss from mirrored.compute_average_loss are already summed."
    )
