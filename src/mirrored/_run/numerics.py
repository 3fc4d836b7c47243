"""check_numerics (TensorFlow's `tf.debugging.enable_check_numerics`): the switch, the finite
flags a checked step computes inside its program, and the error that names the first non-finite
value. `mirrored.debug` is its public face."""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from mirrored._core import context as _context
from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.mesh import REPLICA_AXIS

logger = logging.getLogger("mirrored")


class CheckedProgram(Protocol):
    """What the error reads of a checked program."""

    @property
    def name(self) -> str: ...

    @property
    def check_layout(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def check_inputs(self) -> tuple[str, ...]: ...


_enabled = False


def enable_check_numerics() -> None:
    """Check every step's outputs, gradients and new state for NaN and infinity (off by
    default; steps compiled before are compiled again, with the check)."""
    global _enabled
    _enabled = True


def disable_check_numerics() -> None:
    """Stop checking (the unchecked programs are used again); first raise for any checked
    step not looked at yet."""
    global _enabled
    _enabled = False
    check_all_pending()


def check_numerics_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def checking(enabled: bool = True) -> Iterator[None]:
    """Steps dispatched inside are checked (`fit` with `TerminateOnNaN`: the step that would
    make a parameter non-finite changes nothing), or not (`enabled=False`: `fit`'s look at
    the first batch's predictions); the switch is as it was afterwards."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


class NonFiniteError(FloatingPointError):
    """A step produced NaN or infinity; its update was not applied.

    Attributes:
        step: the step function's step, counting from 0 from its first call on this
            strategy, checked or not.
        replicas: where the first non-finite value appeared.
        stage: `"outputs"`, `"gradients"` or `"state"`, the first of them holding one.
        path: the first offending leaf of that stage.
        parameter: the first parameter it reached: its gradient (`"hidden.kernel"`), else
            its new value (`"model.hidden.kernel"`).
        paths: every offending leaf, by stage.
        batch_replicas: replicas whose batch itself held non-finite values.
        inputs: the batch's leaves that held them (`x`, `x.image`, `sample_weight`).
        epoch, batch: in `Trainer.fit`, the epoch and the batch of it (Keras' numbers:
            from 0), else None.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        replicas: list[int],
        stage: str,
        path: str,
        parameter: str,
        paths: dict[str, list[str]],
        batch_replicas: list[int],
        inputs: list[str] | None = None,
        epoch: int | None = None,
        batch: int | None = None,
    ) -> None:
        super().__init__(message)
        self.inputs = inputs or []
        self.epoch = epoch
        self.batch = batch
        self.step = step
        self.replicas = replicas
        self.stage = stage
        self.path = path
        self.parameter = parameter
        self.paths = paths
        self.batch_replicas = batch_replicas

    def in_fit(self, epoch: int, batch: int) -> NonFiniteError:
        """This error in `fit`'s terms: which epoch and batch of it."""
        return NonFiniteError(
            f"In fit, at epoch {epoch + 1}, batch {batch} (counting batches from 0, as Keras' "
            f"callbacks do): {self}",
            step=self.step,
            replicas=self.replicas,
            stage=self.stage,
            path=self.path,
            parameter=self.parameter,
            paths=self.paths,
            batch_replicas=self.batch_replicas,
            inputs=self.inputs,
            epoch=epoch,
            batch=batch,
        )


_RUNNERS: weakref.WeakSet[Any] = weakref.WeakSet()  # every runner: for check_numerics


def track(runner: Any) -> None:
    """Look at `runner`'s pending flags when checking stops and at exit."""
    _RUNNERS.add(runner)


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
        except NonFiniteError as error:
            logger.error("check_numerics, at exit: %s", error)
        except Exception:  # the runtime may be shutting down; nothing to report then
            return


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


def _parameters(fn: Any) -> list[str]:
    """The names of `fn`'s positional parameters (a `*batch` names its own: `batch[0]`, ...)."""
    try:
        found = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in found if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _argument_name(path: Any, params: list[str]) -> str:
    """The readable name of the leaf at `path` of `((args...), kwargs)`: the step's parameter
    name, then the path inside it."""
    if path[0].idx == 0 and isinstance(path[1], jax.tree_util.SequenceKey):
        index = path[1].idx
        head = params[index] if index < len(params) else f"args[{index}]"
        return ".".join(filter(None, [head, _leaf_name(path[2:])]))
    return _leaf_name(path[1:])


def _state_names(
    fn: Any, args: Sequence[Any], kwargs: dict[str, Any], unique: list[Any]
) -> list[str]:
    """A readable name for each of the step's variables: the step's parameter name, then
    the path inside it (`model.hidden.kernel`, `optimizer.opt_state.0.mu.hidden.kernel`)."""
    params = _parameters(fn)
    position = {id(v): i for i, v in enumerate(unique)}
    names = [type(v).__name__ for v in unique]
    found = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=_is_leaf)[0]
    for path, leaf in reversed(found):  # the first path reaching a variable names it
        if id(leaf) in position:
            names[position[id(leaf)]] = _argument_name(path, params)
    return names


def _input_names(
    fn: Any, args: Sequence[Any], kwargs: dict[str, Any], split: Sequence[bool]
) -> list[str]:
    """The names of the step's split (batch) inputs, `split` marking them among the leaves."""
    params = _parameters(fn)
    found = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs), is_leaf=_is_leaf)[0]
    return [_argument_name(path, params) for (path, _), s in zip(found, split, strict=True) if s]


def _finite(x: Any) -> Any:
    """Whether every element of `x` is finite, as a per-replica (varying) boolean."""
    flag = jnp.all(jnp.isfinite(x))
    return flag if _context.is_varying(flag) else jax.lax.pcast(flag, REPLICA_AXIS, to="varying")


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.inexact)


def _finite_flags(
    batch: list[Any],
    out: Any,
    gradients: list[Any],
    new_state: list[Any],
    names: list[str],
    batch_names: list[str],
) -> tuple[tuple[Any, Any], tuple[tuple[str, ...], list[tuple[str, str]]]]:
    """This replica's finite flags: of its batch (reported, never an error by itself), then
    of the step's outputs, the gradients it applied and its new state; and their layout:
    the names of the batch leaves flagged, and each value's (stage, name)."""
    floating = [(x, name) for x, name in zip(batch, batch_names, strict=True) if _floating(x)]
    batch_flags = [_finite(x) for x, _ in floating]
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

    return (stack(batch_flags), stack(flags)), (tuple(name for _, name in floating), layout)


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


def first_non_finite(pending: Any, keep: int) -> NonFiniteError | None:
    """Look at the finite flags of all but the newest `keep` of the `pending` checked steps
    ((program, flags, first step), oldest first): the error of the first step whose values
    were not all finite (the queue then emptied), or None."""
    while len(pending) > keep:
        program, flags, first = pending.popleft()
        found = np.asarray(flags)  # waits for this step unless the dispatch bound did
        if found.ndim == 2:  # one step: (replicas, flags); run_steps: (replicas, steps, _)
            found = found[:, None, :]
        inputs = found[:, :, : len(program.check_inputs)]
        values = found[:, :, len(program.check_inputs) :]
        good = values.all(axis=(0, 2))
        if good.all():
            continue
        k = int(np.argmin(good))
        # The steps dispatched after it changed nothing (the latch).
        later = sum(p.steps for p, _, _ in pending) + found.shape[1] - k - 1
        pending.clear()
        return _non_finite_error(program, first + k, ~values[:, k], ~inputs[:, k], later)
    return None


def _non_finite_error(
    program: CheckedProgram, step: int, bad: np.ndarray, bad_batch: np.ndarray, later: int
) -> NonFiniteError:
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
    inputs = [name for j, name in enumerate(program.check_inputs) if bad_batch[:, j].any()]
    more = len(paths[stage]) - 1
    where_text = {
        "outputs": "the step's output" + ("" if path == "the output" else f" {path}"),
        "gradients": f"the gradients, of {path}",
        "state": f"the updated state, {path}",
    }[stage]
    message = (
        f"Expected finite values; found NaN or infinity at step {step} of {program.name!r} "
        f"(counting from 0): first in {where_text}"
        + (f" (and {more} more)" if more and stage != "outputs" else "")
        + f", on replica(s) {replicas} of {bad.shape[0]}"
        + (
            f"; the batch on replica(s) {batch_replicas} already held non-finite values, "
            f"first in the input {inputs[0]}"
            + (f" (then {', '.join(inputs[1:])})" if len(inputs) > 1 else "")
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
    return NonFiniteError(
        message,
        step=step,
        replicas=replicas,
        stage=stage,
        path=path,
        parameter=parameter,
        paths=paths,
        batch_replicas=batch_replicas,
        inputs=inputs,
    )
