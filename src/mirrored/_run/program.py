"""A compiled step: the SPMD program of one call signature (`jax.jit` of `jax.shard_map` over
the replica axis), traced once to learn which outputs differ between replicas."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.core import ShardingTypeError
from jax.sharding import PartitionSpec

from mirrored._core import capture as _capture
from mirrored._core import context as _context
from mirrored._core import hooks
from mirrored._core.leaves import is_leaf
from mirrored._core.mesh import REPLICA_AXIS, REPLICATED, SPLIT
from mirrored._nnx import batch_norm, metrics, optimizer, rnn
from mirrored._run import callbacks, deferred, loop_shape, numerics, state_rules
from mirrored._run.arguments import (
    _CONSTANT,
    _MIRRORED,
    _SPLIT,
    _STACKED,
    _STATIC,
    _VARIABLE,
    _fn_key,
    _Sorted,
)
from mirrored._run.errors import (
    _diverged_error,
    _output_array,
    _python_branch_error,
    _warn_captured_keys,
    _warn_invariant_psums,
    _warn_per_replica_mean,
)

logger = logging.getLogger("mirrored")


@dataclasses.dataclass(frozen=True)
class Program:
    call: Callable[..., Any]
    out_treedef: Any
    out_stacked: tuple[bool, ...]
    # Outputs computed per example of a padded batch (leading axis = the replica's rows): they
    # carry the batch's mask, so reductions and gathers count real examples only.
    out_masked: tuple[bool, ...] = ()
    # check_numerics: the last output is each replica's finite flags, of its batch leaves
    # first (`check_inputs` of them), then of the checked values (`check_layout`'s stages).
    checked: bool = False
    check_inputs: tuple[str, ...] = ()  # the names of the batch leaves flagged
    check_layout: tuple[tuple[str, str], ...] = ()
    name: str = ""
    where: str = ""  # "train_step at train.py:12": the hang watchdog names it
    fn_key: Any = None  # counts the steps of one step function
    # The step called compute_average_loss: its scalar outputs may be loss shares (a MEAN of
    # them is the loss / N, which `reduce` warns about).
    loss_shared: bool = False
    steps: int = 1  # per call
    eager: bool = False
    any_masked: bool = dataclasses.field(init=False)  # read every step

    def __post_init__(self) -> None:
        object.__setattr__(self, "any_masked", any(self.out_masked))


class CompileTarget(Protocol):
    """What compiling a step reads of its runner."""

    n: int
    mesh: Any
    strategy: Any
    placement: Any
    donate: bool
    logged: bool
    eager_traced: set[Any]
    notes: dict[Any, str]  # what a step function's first trace found worth saying

    def latch(self) -> jax.Array: ...

    def bound_dispatch(self, token: jax.Array) -> None: ...


def compile_step(
    target: CompileTarget,
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
    real_rows: tuple[int, ...] | None = None,
) -> Any:
    """The program for one signature; `steps`: `run_steps`' K steps in one program, on
    `inputs` (the stacked split and replicated inputs) instead of `sorted_`'s. `eager`:
    instead, a function that runs the step once on its inputs, without compiling, and
    returns a `Program` that hands out what it computed. `real_rows`: the global batch's
    real-row counts of a padded batch, for a step that evaluates a function of the whole
    batch (`global_rows`; it raises `RealRowsNeeded` without them)."""
    unique = sorted_.unique
    captured = _capture.find_captured(fn, target.placement.is_mirrored)
    if captured:
        raise _capture.captured_state_error(fn, captured)
    position = {id(v): i for i, v in enumerate(unique)}
    # How to rebuild each leaf inside the trace; holds no argument arrays alive.
    plan: list[tuple[str, Any]] = [
        (kind, position[id(leaf)] if kind == _VARIABLE else leaf if kind == _STATIC else None)
        for leaf, kind in zip(leaves, kinds, strict=True)
    ]
    var_treedefs = [jax.tree.structure(v) for v in unique]
    # How each variable combines across replicas (random keys, moving statistics, sums).
    rules = state_rules.StateRules.of(unique, (args, kwargs), sorted_.local)
    flax_metrics = metrics.flax_metric_classes((args, kwargs))
    n = target.n
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    recorded: dict[str, Any] = {}
    # The trace-time warnings, once per step function (an eager step traces every call).
    quiet = eager and _fn_key(fn) in target.eager_traced
    if not quiet and n > 1:
        _warn_captured_keys(fn_name, _capture.find_reachable(fn, _capture.is_random_key))
    checking = numerics.check_numerics_enabled()
    state_names = numerics._state_names(fn, args, kwargs, unique) if checking else []
    batch_names = (
        numerics._input_names(fn, args, kwargs, [k in (_SPLIT, _STACKED) for k in kinds])
        if checking
        else []
    )

    def one_step(
        state: list[Any],
        split: list[Any],
        rep: list[Any],
        mask: Any,
        count: Any,
        warn: bool,
        scatter: bool = False,
    ) -> tuple[list[Any], Any, Any, list[Any]]:
        """One step of `fn` on this replica: the new state (mirrored again), the output,
        and under check_numerics the finite flags (of the batch, of the values). With
        `scatter`, the parameters of a ShardedOptimizer(shard_gradients=True) enter
        "reduced": their gradients are then each replica's own part of the sum (JAX adds no
        all-reduce), which `deferred.collect` reduce-scatters (ZeRO-2)."""
        entered = inner = rules.entering(state, n)
        if scatter:
            inner = list(inner)
            for slot in sorted_.scattered:
                inner[slot] = jax.lax.pcast(inner[slot], REPLICA_AXIS, to="reduced")
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
            target.strategy,
            in_spmd=True,
            example_mask=mask,
            example_count=count,
            batch_is_split=_SPLIT in kinds,
            real_rows=real_rows,
        )
        ctx.warnings = warn  # trace-time warnings: on the first of the two traces only
        ctx.gradients_scattered = bool(sorted_.scattered)
        token = _context.enter_replica(ctx)
        gradients: list[Any] = []
        try:
            # A padded batch: BatchNorm statistics and Flax metrics leave padded rows out.
            with contextlib.ExitStack() as patches:
                patches.enter_context(rnn.varying_rnn_carries())
                patches.enter_context(callbacks.per_replica_callbacks())
                # check_numerics records the gradients applied.
                patches.enter_context(
                    optimizer.checked_optimizer_update(gradients if checking else None)
                )
                if flax_metrics:
                    patches.enter_context(metrics.flax_metric_updates(flax_metrics))
                if masked:
                    patches.enter_context(batch_norm.masked_batch_norm())
                    for extension in hooks.extensions:
                        for patch in extension.masked_trace_patches():
                            patches.enter_context(patch())
                out = fn(*call_args, **call_kwargs)
            after = (call_args, call_kwargs)
            _check_writes(fn_name, (args, kwargs), rebuilt, kinds, treedef, after, plan, fresh)
        except jax.errors.TracerBoolConversionError as error:
            raise _python_branch_error(error, fn_name, eager) from error
        except (NotImplementedError, ShardingTypeError) as error:
            if not scatter or "reduced" not in str(error):
                raise
            raise deferred.scattered_gradient_error(fn_name, error) from error
        finally:
            _context.exit_replica(token)
        # Flax metrics of the user's own whose update only adds to their state: sums too.
        slot_of = {id(v): i for i, v in enumerate(fresh)}
        sums = ctx.summed_states - ctx.not_summed_states
        added = {slot_of[v] for v in sums if v in slot_of}
        values = [v.get_raw_value() for v in fresh]
        if scatter:  # the parameters leave as they entered; the update comes after the step
            for slot in sorted_.scattered:
                if values[slot] is not inner[slot]:
                    raise deferred.scattered_write_error(fn_name, unique[slot])
                values[slot] = entered[slot]
        new_state = rules.combined(state, entered, values, added, mask, n)
        for slot, (variable, value) in enumerate(zip(unique, new_state, strict=True)):
            if slot in local:  # per-replica state: each replica keeps its own row
                new_state[slot] = _context.as_varying(value)
            elif slot in sorted_.sharded:  # a ShardedOptimizer's: each replica its shard
                continue
            elif _context.is_varying(value):
                raise _diverged_error(fn_name, args, kwargs, variable)
        if warn:  # the first of the two traces
            _warn_per_replica_mean(
                fn_name, ctx, unique, state, new_state, kinds, n, mask is not None
            )
            if ctx.per_replica_norm is not None and _fn_key(fn) not in target.notes:
                note = batch_norm.small_batch_warning(fn_name, *ctx.per_replica_norm, n)
                target.notes[_fn_key(fn)] = note
                logger.warning(note)
        # ShardedOptimizer updates: their gradients leave the step (whole, or each replica's
        # shard), to be applied in the global view right after it (`deferred`).
        records, grads, specs = deferred.collect(ctx, fresh, fn_name, n, scatter)
        recorded["deferred"] = records
        if not scatter:  # the first trace: the gradients' layout, for the compiled one
            recorded["grad_specs"] = specs
            recorded["scatter"] = any(o.shard_gradients for o, *_ in ctx.deferred_updates)
        flags = None
        if checking:
            names = [*batch_names, *["the batch's mask"] * (len(split) - len(batch_names))]
            applied = [*gradients, *deferred.gradients_of(records, grads)]
            flags, layout = numerics._finite_flags(
                split, out, applied, new_state, state_names, names
            )
            recorded["check"] = layout
        recorded["loss_shared"] = ctx.loss_shared  # compute_average_loss ran: shares out
        return new_state, out, flags, grads

    def body(
        state: list[Any], split: list[Any], rep: list[Any], *, expand: Any, per_step: bool
    ) -> Any:
        failed = None
        if checking:  # the latch: set, the step changes nothing
            state, failed = state[:-1], state[-1]
        mask = count = None
        if masked:
            mask, count = split[-1], rep[-1]
            split, rep = split[:-1], rep[:-1]
        if steps is None or per_step:
            scatter = expand is not None and recorded.get("scatter", False)
            new_state, out, flags, grads = one_step(
                state, split, rep, mask, count, expand is None and not quiet, scatter
            )
            if checking:  # a non-finite value on any replica: every replica keeps its state
                new_state, failed = numerics._unless_non_finite(flags, new_state, state, failed)
            # run_steps' outputs are stacked by step, not by example.
            rows = None if mask is None or per_step else mask.shape[0]
        else:  # `run_steps`: the batches (and masks, counts) stacked on a leading step axis

            def scan_step(carry: Any, xs: Any) -> tuple[Any, Any]:
                state_k, failed = carry
                split_k, mask_k, count_k = xs
                new, out, flags, grads = one_step(
                    state_k, split_k, rep, mask_k, count_k, expand is None and not quiet
                )
                if grads:
                    raise NotImplementedError(
                        f"strategy.run_steps does not run a ShardedOptimizer's update yet "
                        f"({fn_name!r} calls one). Fix: call strategy.run per step (Trainer: "
                        "steps_per_execution=1), or use nnx.Optimizer."
                    )
                if checking:  # after a non-finite step, the state stays as before it
                    new, failed = numerics._unless_non_finite(flags, new, state_k, failed)
                said = quiet or getattr(fn, "not_per_example", False)  # the Trainer's sums
                if mask_k is not None and expand is None and not said:
                    _warn_unmasked_step_outputs(fn_name, steps, out, mask_k.shape[0])
                return (new, failed), (jax.tree.map(_output_array, out), flags)

            (new_state, failed), (out, flags) = jax.lax.scan(
                scan_step,
                (list(state), jnp.zeros((), bool) if failed is None else failed),
                (split, mask, count),
            )
            rows = None  # outputs are stacked by step, not by example
            grads = []
        out_leaves, out_treedef = jax.tree.flatten(out)
        out_leaves = [_output_array(x) for x in out_leaves]
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
        return new_state, outs, jnp.zeros((), jnp.int32), grads

    # K steps: every split input carries the step on its leading axis, the batch on the next.
    split_spec = SPLIT if steps is None else PartitionSpec(None, REPLICA_AXIS)

    # Mirrored state enters whole; per-replica state (`sorted_.local`) as each replica's row.
    # A ShardedOptimizer's state (`sorted_.sharded`) as each replica's shard.
    local = frozenset(sorted_.local)
    slot_specs = [
        SPLIT if i in local else sorted_.sharded.get(i, REPLICATED) for i in range(len(unique))
    ]
    state_specs: Any = REPLICATED
    if local or sorted_.sharded:
        state_specs = [*slot_specs, *[REPLICATED] * checking]  # the latch

    # run_steps with a ShardedOptimizer among the arguments: its update runs in the global
    # view after each step, so the K steps loop around the per-replica program, not in it.
    # `dispatched` (below: convolutions on CPU): the loop runs on the host, one program a step.
    per_step = steps is not None and bool(sorted_.sharded)
    dispatched = [False]

    def program(expand: Any, out_specs: Any) -> Any:
        # ZeRO-2's gradients leave the step split (the compiled trace; the first, whole).
        grad_specs = REPLICATED if expand is None else recorded.get("grad_specs") or REPLICATED
        one_at_a_time = per_step or dispatched[0]  # the program runs one step's inputs
        mapped = jax.shard_map(
            lambda s, d, r: body(s, d, r, expand=expand, per_step=one_at_a_time),
            mesh=target.mesh,
            in_specs=(state_specs, SPLIT if one_at_a_time else split_spec, REPLICATED),
            out_specs=(state_specs, out_specs, REPLICATED, grad_specs),
            check_vma=True,
        )

        def step(state: list[Any], split: list[Any], rep: list[Any]) -> Any:
            new_state, outs, token, grads = mapped(state, split, rep)
            records = recorded.get("deferred")
            if records and not checking:  # ShardedOptimizer updates, in the global view
                new_state = deferred.apply(records, new_state, grads, slot_specs, target.mesh)
            elif records:  # checked: a non-finite new value keeps the state as it was
                applied = deferred.apply(records, new_state[:-1], grads, slot_specs, target.mesh)
                inputs, layout = recorded["check"]
                updated = deferred.updated_slots(records)
                named = [s for s in updated if numerics._floating(applied[s])]
                finite = jnp.stack([jnp.all(jnp.isfinite(applied[s])) for s in named] or [True])
                failed = jnp.logical_or(new_state[-1], ~jnp.all(finite))
                kept = zip(state[:-1], applied, strict=True)
                new_state = [*(numerics._select(failed, o, a) for o, a in kept), failed]
                # The updated values' flags join the step's, for the report of what failed.
                rows = jnp.broadcast_to(finite[: len(named)], (outs[-1].shape[0], len(named)))
                outs = [*outs[:-1], jnp.concatenate([outs[-1], rows], axis=1)]
                layout = [*layout, *(("state", state_names[s]) for s in named)]
                recorded["check"] = (inputs, layout)
            return new_state, outs, token

        if not one_at_a_time:
            return step
        if dispatched[0]:
            one = jax.jit(step, donate_argnums=0 if target.donate else ())
            return loop_shape.dispatched_steps(target, one, masked, expand, checking)

        def looped(state: list[Any], split: list[Any], rep: list[Any]) -> Any:
            counts = rep[-1] if masked else None  # each step's real-example count
            fixed = rep[:-1] if masked else rep

            def each(carry: list[Any], xs: Any) -> tuple[list[Any], Any]:
                split_k, count_k = xs
                new, outs, _ = step(carry, split_k, [*fixed, count_k] if masked else fixed)
                return new, outs

            new_state, outs = jax.lax.scan(each, state, (split, counts))
            # Stacked by step in front; the replicas' axis goes first, as in one program.
            # (check_numerics' flags, last, are per replica too.)
            flags = (True,) * len(outs) if expand is None else (*expand, *[True] * checking)
            outs = [jnp.moveaxis(o, 0, 1) if e else o for o, e in zip(outs, flags, strict=True)]
            return new_state, outs, jnp.zeros((), jnp.int32)

        return looped

    def program_fields() -> dict[str, Any]:
        fields = {
            "fn_key": _fn_key(fn),
            "steps": steps or 1,
            "eager": eager,
            "name": fn_name,
            "where": _defined_at(fn, fn_name),
            "loss_shared": recorded.get("loss_shared", False),
        }
        if checking:
            inputs, layout = recorded["check"]
            fields.update(checked=True, check_inputs=inputs, check_layout=tuple(layout))
        return fields

    if eager:

        def run(state: list[Any], split: list[Any], rep: list[Any]) -> Program:
            # Every output with a replica axis (as the first trace of the compiled path);
            # those the same on every replica are then taken from the first replica.
            new_state, outs, token = program(None, SPLIT)(state, split, rep)
            target.eager_traced.add(_fn_key(fn))
            out_treedef, varying, per_example = recorded["out"]
            outs, extra = outs[: len(varying)], outs[len(varying) :]  # extra: the flags
            outs = [x if v else x[0] for x, v in zip(outs, varying, strict=True)]
            done = (new_state, [*outs, *extra], token)
            return Program(
                call=lambda *_: done,
                out_treedef=out_treedef,
                out_stacked=varying,
                out_masked=per_example,
                **program_fields(),
            )

        return run
    state = [*sorted_.state, target.latch()] if checking else sorted_.state
    split, rep = sorted_.with_mask() if inputs is None else inputs
    # First trace: learn which outputs differ between replicas, to choose their specs; and
    # look at it for a hand-written psum of a value already the same on every replica.
    _warn_invariant_psums(fn_name, jax.make_jaxpr(program(None, SPLIT))(state, split, rep))
    out_treedef, varying, per_example = recorded["out"]
    out_specs = [SPLIT if v else REPLICATED for v in varying] + [SPLIT] * checking

    def jitted() -> Any:
        return jax.jit(program(varying, out_specs), donate_argnums=0 if target.donate else ())

    call = jitted()
    # XLA:CPU runs most convolutions many times slower inside a loop (`loop_shape`): such a
    # program's K steps run as K dispatches of one step's program.
    slow = (
        loop_shape.slow_convolutions(call.lower(state, split, rep).as_text())
        if steps is not None and not per_step and target.mesh.devices.flat[0].platform == "cpu"
        else []
    )
    if slow:
        dispatched[0] = True
        call = program(varying, out_specs)
        logger.info(
            "run_steps(%s, steps=%d): its %d steps run as %d calls of one step's program: "
            "XLA:CPU runs a convolution with dimensions %s (a gradient's, or channels first) "
            "many times slower inside one program of several steps.",
            fn_name,
            steps,
            steps,
            steps,
            slow[0],
        )
    if not target.logged:
        target.logged = True
        _log_first_program(n, fn_name, call, state, split, rep)
    return Program(
        call=call,
        out_treedef=out_treedef,
        out_stacked=varying,
        out_masked=per_example,
        **program_fields(),
    )


def _warn_unmasked_step_outputs(fn_name: str, steps: Any, out: Any, rows: int) -> None:
    """Once per program: `run_steps`' outputs are stacked by step, without the batches'
    masks, so per-example outputs of a ragged (padded) batch keep its padded rows."""
    per_example = [
        x
        for x in jax.tree.leaves(out)
        if _context.is_varying(x) and getattr(x, "ndim", 0) >= 1 and x.shape[0] == rows
    ]
    if per_example:
        logger.warning(
            "strategy.run_steps(%s, steps=%s) returns per-example outputs (shape %s per "
            "replica and step), stacked by step without the batches' masks: on a ragged last "
            "batch they hold its padded rows (copies of real rows), which strategy.reduce or "
            "strategy.gather over the rows would count (strategy.run's outputs carry the mask "
            "and do not). Fix: reduce per-example values inside the step "
            "(mirrored.compute_average_loss, or a sum weighted by "
            "mirrored.get_replica_context().example_mask), or run the ragged last batch with "
            "strategy.run.",
            fn_name,
            steps,
            tuple(per_example[0].shape),
        )


def _defined_at(fn: Any, name: str) -> str:
    """`name at file:line` of `fn`'s code, or `name` when it has none."""
    target = inspect.unwrap(fn)
    code = getattr(target, "__code__", None) or getattr(type(target).__call__, "__code__", None)
    if code is None:
        return name
    return f"{name} at {code.co_filename}:{code.co_firstlineno}"


def _check_writes(
    fn_name: str,
    original: Any,
    rebuilt: list[Any],
    kinds: str,
    treedef: Any,
    after_call: Any,
    plan: Sequence[tuple[str, Any]],
    fresh: list[Any],
) -> None:
    """What the step assigned to attributes, as `nnx.jit` on one device keeps it.

    A Variable replaced by a new one (the Flax cookbook's EMA assigns a new copy of the model
    every step) gives its value to the Variable `run` passed, which is written back. An array
    assigned to an attribute that is not a Variable (a plain `jax.Array` attribute,
    `nnx.data(...)`) is refused: `run` writes back Variables only, so the change would be lost
    without a word."""
    after, after_def = jax.tree.flatten(after_call, is_leaf=is_leaf)
    if after_def != treedef:  # static attributes changed (a mode switch): nothing to compare
        return
    for i, ((kind, payload), old, new) in enumerate(zip(plan, rebuilt, after, strict=True)):
        if kind == _VARIABLE and new is not old and isinstance(new, nnx.Variable):
            value, current = new.get_raw_value(), fresh[payload].get_raw_value()
            if jnp.shape(value) != jnp.shape(current) or jnp.result_type(value) != jnp.result_type(
                current
            ):
                raise ValueError(
                    f"strategy.run expected {fn_name!r} to keep the shape and dtype of "
                    f"{_where(original, i)} when it replaced that Variable; found "
                    f"{jnp.result_type(current)}{list(jnp.shape(current))} replaced by "
                    f"{jnp.result_type(value)}{list(jnp.shape(value))}.\n"
                    "Fix: change a Variable's shape outside the step (in the scope), then "
                    "call run again."
                )
            fresh[payload].set_raw_value(value)
    changed = next(
        (
            i
            for i, (kind, old, new) in enumerate(zip(kinds, rebuilt, after, strict=True))
            if kind in (_MIRRORED, _CONSTANT) and new is not old
        ),
        None,
    )
    if changed is None:
        return
    raise ValueError(
        f"strategy.run expected {fn_name!r} to change state only through nnx.Variables; found "
        f"it assigning {_where(original, changed)}, which is not a Variable (a plain array "
        "attribute or nnx.data): run writes back Variables only, so the change would be lost "
        "(nnx.jit on one device keeps it).\n"
        "Fix: hold the value in a Variable and update it in place, e.g.\n"
        "  self.calls = nnx.Variable(jnp.zeros((), jnp.int32))   # in __init__\n"
        "  self.calls[...] += 1                                    # in the step\n"
        "(nnx.BatchStat for a statistic the replicas average)."
    )


def _where(original: Any, index: int) -> str:
    """`args[0].calls`: the leaf `index` of run's (args, kwargs), as the user names it."""
    paths = jax.tree_util.tree_flatten_with_path(original, is_leaf=is_leaf)[0]
    path = jax.tree_util.keystr(paths[index][0][1:])
    return ("args" if paths[index][0][0].idx == 0 else "kwargs") + path


def _log_first_program(n: int, fn_name: str, call: Any, *inputs: Any) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    text = call.lower(*inputs).as_text()
    counts = {
        "all-reduce": text.count("all_reduce"),
        "reduce-scatter": text.count("reduce_scatter"),
        "all-gather": text.count("all_gather"),
    }
    ops = ", ".join(f"{count} {op}" for op, count in counts.items() if count or op == "all-reduce")
    logger.info(
        "Compiled %r as one SPMD program over %d replica(s) on axis %r: %s op(s) over %d "
        "replicas synchronise it.",
        fn_name,
        n,
        REPLICA_AXIS,
        ops,
        n,
    )
