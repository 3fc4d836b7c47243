"""`strategy.run`: one cached SPMD program per call signature, and the fast path that calls it.

The hot path does only what must change per step: flatten the arguments, read the variables'
current arrays, call a cached `jax.jit(jax.shard_map(...))` of a pure function, write the new
arrays back. Tracing, graph surgery and validation of the program happen once per signature.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx

from mirrored._core import heartbeat as _heartbeat
from mirrored._core import hooks
from mirrored._core import settings as config
from mirrored._core.global_rows import RealRowsNeeded
from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.values import PerReplica, StackedBatches
from mirrored._nnx import batch_norm
from mirrored._run import agreement, dispatch, numerics
from mirrored._run import guard as _fastpath
from mirrored._run.arguments import (
    _SPLIT,
    _VARIABLE,
    _fn_key,
    _Sorted,
    sort_leaves,
    state_as_arguments,
)
from mirrored._run.array_step import Direct
from mirrored._run.eager import _cached_eager_primitives
from mirrored._run.errors import peer_failures
from mirrored._run.placement import Placement
from mirrored._run.program import Program, compile_step
from mirrored._run.run_steps import stacked_steps

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike

logger = logging.getLogger("mirrored")


def _write(variable: nnx.Variable[Any], value: jax.Array) -> None:
    # set_raw_value re-checks the trace state twice per call; on the host, between steps, there
    # is no trace to check, and this loop is on the per-step path.
    object.__setattr__(variable, "_raw_value", value)


def _counts(count: Any) -> tuple[int, ...]:
    """The distinct values of a padded batch's real-row count (K of them for `run_steps`)."""
    return tuple(sorted({int(c) for c in np.asarray(count).reshape(-1)}))


class Runner:
    """Compiles and calls `fn` once per replica, for one strategy."""

    def __init__(
        self, strategy: StrategyLike, *, max_in_flight: int | None, donate: bool = True
    ) -> None:
        self.strategy = strategy
        self.mesh = strategy._mesh
        self.n = strategy.num_replicas_in_sync
        self.placement = Placement(
            frozenset(strategy.extended.worker_devices), self.n, strategy._replicated
        )
        self.is_mirrored = self.placement.is_mirrored
        self.check_mirrored = self.placement.check_mirrored
        self._sort = functools.partial(sort_leaves, self.placement)
        self._programs: dict[Any, Program] = {}
        self._guards: dict[Any, _fastpath.Guard | None] = {}
        # Step functions that evaluate a function of the whole batch (`global_rows`): their
        # programs are compiled per real-row count of a padded batch, without a fast path.
        self._global_rows: set[Any] = set()
        # Several processes: the chief's values of state seen for the first time.
        self.agreement = agreement.Agreement(strategy.extended.worker_devices)
        # What an extension keeps per runner (Keras: its bound steps), by extension name.
        self.extension_state: dict[str, Any] = {}
        # One replica has no collective to deadlock: the host runs ahead as in plain JAX (PJRT's
        # own queue bounds it, 32 programs per device), since on CPU each wait costs the
        # devices' threads CPU time (measured: ~7% of a one-device Keras fit step).
        if max_in_flight is None:
            max_in_flight = dispatch.MAX_IN_FLIGHT if self.n > 1 else None
        self.bound_dispatch = dispatch.DispatchBound(max_in_flight)
        self._check_lag = max_in_flight or dispatch.MAX_IN_FLIGHT  # flags looked at this late
        self.donate = donate
        self.logged = False
        self.eager_traced: set[Any] = set()  # step functions run eagerly at least once
        self.notes: dict[Any, str] = {}  # warnings of step functions' first traces
        self._steps_run: dict[Any, int] = {}  # steps run, per step function
        self.last_first_step = 0  # the number of the last call's first step (of its function)
        self._ran: set[int] = set()  # programs called at least once (the first compiles)
        # check_numerics: a mirrored flag, set by the first non-finite step, after which the
        # checked programs change nothing; and the flags not yet looked at (checked with the
        # dispatch bound's lag, so the devices never wait for the host).
        self._failed: jax.Array | None = None
        self._pending: collections.deque[tuple[Program, jax.Array, int]] = collections.deque()
        numerics.track(self)

    def __call__(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        for extension in hooks.extensions:  # Keras, say: its state may be captured
            out = extension.bind(self, fn, args, kwargs)
            if out is not hooks.NOT_BOUND:
                return out
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """One step of `fn` on every replica (`__call__` without the extensions)."""
        fn, args = state_as_arguments(fn, args)
        if config.functions_run_eagerly():
            leaves, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=_is_leaf)
            sorted_ = self._sort(leaves, args, kwargs)
            return self._eagerly(fn, args, kwargs, leaves, treedef, sorted_)
        fn_key = _fn_key(fn)
        guard = self._guards.get(fn_key)
        if guard is not None and guard.program.checked == numerics.check_numerics_enabled():
            # Fast path: the state's structure is as last time; only the batch is flattened.
            inputs = guard.inputs(args, kwargs, self.placement.check_split, self.is_mirrored)
            if inputs is not None:
                state, split, rep = inputs
                if state is not guard.written:  # changed since the last step: maybe aliased
                    state = dispatch.own_buffers(state, self.donate)
                return self._call(guard.program, guard, state, split, rep)
        program, sorted_ = self._program_for(fn, args, kwargs)
        guard = None
        if fn_key not in self._global_rows:  # else each batch's real rows choose the program
            guard = _fastpath.Guard.build(args, kwargs, program, sorted_.unique, self._sort)
            self._guards[fn_key] = guard
        if guard is None:
            guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        state = self.agreement.state(sorted_.unique, sorted_.state)
        return self._call(
            program, guard, dispatch.own_buffers(state, self.donate), *sorted_.with_mask()
        )

    def _program_for(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> tuple[Program, _Sorted]:
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
            batch_norm.synchronizing(),
            numerics.check_numerics_enabled(),
            tuple(sorted_.local),
            tuple(sorted_.sharded.items()),
            tuple(sorted_.scattered.items()),
        )
        # A step that evaluates a function of the whole batch: a program per real-row count.
        real_rows = self._real_rows(key[0], masked, sorted_.count)
        program = self._programs.get((*key, real_rows))
        if program is None:
            compiling = (self, fn, args, kwargs, leaves, treedef, signature, sorted_, masked)
            try:
                program = compile_step(*compiling, real_rows=real_rows)
            except RealRowsNeeded:
                self._global_rows.add(key[0])
                self._guards.pop(key[0], None)
                real_rows = self._real_rows(key[0], masked, sorted_.count)
                program = compile_step(*compiling, real_rows=real_rows)
            self._programs[(*key, real_rows)] = program
        return program, sorted_

    def _real_rows(self, fn_key: Any, masked: bool, count: Any) -> tuple[int, ...] | None:
        """The distinct real-row counts of a padded batch (one, or `run_steps`' K steps'),
        for a step that evaluates a function of the whole batch (`global_rows`); else None.
        Read on the host: the counts were placed from there, so this waits for no step."""
        if not masked or fn_key not in self._global_rows:
            return None
        return _counts(count)

    def call_steps(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        batches: list[Any] | StackedBatches,
    ) -> Any:
        """`len(batches)` steps of `fn(*args, *batch, **kwargs)` in one program (`run_steps`)."""
        steps = stacked_steps(self.placement, self.strategy, fn, args, kwargs, batches)
        fn, sorted_, masked = steps.fn, steps.sorted_, steps.masked
        split, rep = steps.inputs
        compiling = (fn, steps.first, kwargs, steps.leaves, steps.treedef)
        if config.functions_run_eagerly():
            return self._eagerly(*compiling, sorted_, steps=len(batches), inputs=steps.inputs)
        signature = "".join(sorted_.kinds)
        statics = tuple((type(x), x) for x in sorted_.statics)
        checking = numerics.check_numerics_enabled()
        key = (
            "steps",
            len(batches),
            _fn_key(fn),
            steps.treedef,
            signature,
            statics,
            masked,
            tuple(sorted_.local),
            tuple(sorted_.sharded.items()),
            tuple(sorted_.scattered.items()),
        )
        real_rows = self._real_rows(key[2], masked, rep[-1] if masked else None)
        program = self._programs.get((*key, real_rows, checking))
        if program is None:
            if len(sorted_.unique) != signature.count(_VARIABLE):
                raise ValueError(
                    "strategy.run_steps expected each variable once among the arguments; "
                    "found one reachable twice (tied weights). Fix: call strategy.run per step."
                )
            compile_args = (self, *compiling, signature, sorted_, masked, len(batches))
            try:
                program = compile_step(*compile_args, steps.inputs, real_rows=real_rows)
            except RealRowsNeeded:  # a function of the whole batch: compile for its rows
                self._global_rows.add(key[2])
                real_rows = self._real_rows(key[2], masked, rep[-1])
                program = compile_step(*compile_args, steps.inputs, real_rows=real_rows)
            self._programs[(*key, real_rows, checking)] = program
        guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        state = self.agreement.state(sorted_.unique, sorted_.state)
        return self._call(program, guard, dispatch.own_buffers(state, self.donate), split, rep)

    def note(self, fn: Callable[..., Any], args: Sequence[Any]) -> str | None:
        """The warning the first trace of `run(fn, args)`'s step gave, if any."""
        fn, _ = state_as_arguments(fn, args)
        return self.notes.get(_fn_key(fn))

    def guard_of(self, fn_key: Any) -> _fastpath.Guard | None:
        """The fast-path guard of the last call of the step function `fn_key`."""
        return self._guards.get(fn_key)

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
        fn, args = state_as_arguments(fn, args)
        program, sorted_ = self._program_for(fn, args, kwargs)
        state = [*sorted_.state, self.latch()] if program.checked else sorted_.state
        return program.call.lower(state, *sorted_.with_mask())  # type: ignore[attr-defined]

    def compiled(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The compiled program `run(fn, args, kwargs)` executes (nothing runs)."""
        return self.lowered(fn, args, kwargs).compile()

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
        split, rep = sorted_.with_mask() if inputs is None else inputs
        # Op by op the counts are at hand: a function of the whole batch never waits for them.
        real_rows = None
        if masked:
            real_rows = _counts(rep[-1])
        run = compile_step(
            self,
            fn,
            args,
            kwargs,
            leaves,
            treedef,
            kinds,
            sorted_,
            masked,
            steps,
            inputs,
            eager=True,
            real_rows=real_rows,
        )
        agreed = state = self.agreement.state(sorted_.unique, sorted_.state)
        if numerics.check_numerics_enabled():
            state = [*state, self.latch()]
        with _cached_eager_primitives(), jax.disable_jit():
            program = run(state, split, rep)
        guard = _fastpath.Guard.unguarded(program, sorted_.unique)
        return self._call(program, guard, agreed, split, rep)

    def _call(
        self,
        program: Program,
        guard: _fastpath.Guard,
        state: list[jax.Array],
        split: list[jax.Array],
        rep: list[Any],
    ) -> Any:
        if self.donate and rep:
            state = dispatch.unaliased(state, rep)
        beat = _heartbeat.BEAT  # the hang watchdog's view: a few attribute writes
        beat.beats += 1
        beat.phase = "step" if id(program) in self._ran else "compile"
        beat.fn = program.where
        with peer_failures():
            if program.checked:  # the latch goes in and out with the state
                new_state, outs, token = program.call([*state, self.latch()], split, rep)
                *new_state, self._failed = new_state
                *outs, flags = outs
            else:
                new_state, outs, token = program.call(state, split, rep)
            for variable, value in zip(guard.unique, new_state, strict=True):
                _write(variable, value)
            guard.written = new_state
            self.bound_dispatch(token)
            first = self.count_steps(program)
            if program.checked:
                flags.copy_to_host_async()  # on the host by the time it is looked at
                self._pending.append((program, flags, first))
                self.check_pending(keep=0 if program.eager else self._check_lag)
        self._ran.add(id(program))
        beat.steps += program.steps
        beat.beats += 1
        beat.phase = "host"
        n = self.n
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
                    share=program.loss_shared and x.ndim == 1,
                )
                if stacked
                else x
                for x, stacked, masked in zip(
                    outs, program.out_stacked, program.out_masked, strict=True
                )
            ],
        )

    def latch(self) -> jax.Array:
        """check_numerics' mirrored flag: set by a non-finite step, it keeps the state."""
        if self._failed is None:
            self._failed = jax.device_put(np.zeros((), bool), self.strategy._replicated)
        return self._failed

    def check_pending(self, keep: int = 0) -> None:
        """Look at the finite flags of all but the newest `keep` checked steps; raise
        `NonFiniteError` for the first step whose values were not all finite."""
        error = numerics.first_non_finite(self._pending, keep)
        if error is not None:  # from now on the steps train again, from before that step
            self._failed = None
            raise error

    def count_steps(self, program: Program) -> int:
        """Count a call's steps of its step function; returns the number of its first."""
        first = self._steps_run.get(program.fn_key, 0)
        self._steps_run[program.fn_key] = first + program.steps
        self.last_first_step = first
        return first
