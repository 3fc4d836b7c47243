"""Proof of distribution: small, pure checks and `verify`, which runs them on a real step.

"No error" does not mean the devices work together: training can silently run on one device,
never synchronise, or synchronise at the wrong scale. Each check returns a `Check` with a
status, a one-line summary and a paragraph that explains and tells how to fix.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrored._core import hooks
from mirrored._core.capture import is_state
from mirrored._core.leaves import is_hollow, is_key, raw_array
from mirrored._core.mesh import is_per_replica_state, is_sharded_variable, sharded
from mirrored._core.values import PerReplica, is_per_replica
from mirrored._nnx import batch_norm
from mirrored._proof.checks import (
    FAIL,
    INFO,
    WARN,
    Check,
    Report,
    check_collectives,
    check_devices,
    check_equivalence,
    check_in_sync,
    check_input,
    check_scaling,
    gpus_visible_to_system,
)
from mirrored._proof.memory import check_memory
from mirrored._proof.processes import check_processes, check_stragglers, global_host_value
from mirrored._run.errors import ReplicaDivergenceError


def _has_state(value: Any) -> bool:
    """An NNX object, or a list or tuple of them (the Trainer's tuple of stateful metrics)."""
    if isinstance(value, list | tuple):
        return any(is_state(leaf) for leaf in jax.tree.leaves(value, is_leaf=is_state))
    return is_state(value)


def _copy_args(args: Sequence[Any], place: Callable[[Any], Any], strategy: Any) -> list[Any]:
    """Fresh copies of the NNX objects in `args`, their arrays placed by `place`."""
    positions = [i for i, a in enumerate(args) if _has_state(a)]
    graphdef, state = nnx.split(tuple(args[i] for i in positions))

    def copy(a: Any) -> Any:
        if is_key(a):  # random keys travel as their raw key data
            return jax.random.wrap_key_data(
                place(np.asarray(raw_array(a))), impl=jax.random.key_impl(a)
            )
        return place(np.asarray(a))

    def copy_variable(var: Any) -> Any:
        if not isinstance(var, nnx.Variable):
            return jax.tree.map(copy, var)
        if is_sharded_variable(var) and strategy.num_replicas_in_sync > 1:  # keeps its split
            layout = sharded(strategy._mesh, var.get_metadata("sharded"))
            return var.replace(jax.device_put(np.asarray(var.get_raw_value()), layout))
        return jax.tree.map(copy, var)

    state = jax.tree.map(copy_variable, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    copies = list(args)
    for i, obj in zip(positions, nnx.merge(graphdef, state), strict=True):  # type: ignore[arg-type]
        copies[i] = obj
    return _map_batches(lambda v: _move_batch(v, strategy), copies)


def _map_batches(fn: Callable[[PerReplica], Any], args: Sequence[Any]) -> list[Any]:
    """`fn` applied to every distributed value in `args`, nested ones too (a dict batch)."""

    def one(a: Any) -> Any:
        if isinstance(a, PerReplica):
            return fn(a)
        if is_state(a):
            return a
        return jax.tree.map(
            one, a, is_leaf=lambda x: x is not a and (isinstance(x, PerReplica) or is_state(x))
        )

    return [one(a) for a in args]


def _deterministic(args: list[Any]) -> list[Any]:
    """The copies with dropout off (`nnx.Dropout`, attention dropout: every module's
    `deterministic` flag): N replicas cannot draw one device's masks."""
    for arg in args:
        if is_state(arg):
            for _, node in nnx.iter_graph(arg):
                if isinstance(node, nnx.Module) and hasattr(node, "deterministic"):
                    node.deterministic = True
    return args


def _take(value: PerReplica, rows: int) -> PerReplica:
    return _take_rows(value, rows) if not value.stacked else value


def _move_batch(value: PerReplica, strategy: Any) -> PerReplica:
    """A distributed batch re-split for `strategy` (same global rows, mask and count)."""
    n = strategy.num_replicas_in_sync
    if value.num_replicas == n:
        return value
    split = strategy._split
    if value.stacked:  # per-replica values (e.g. running sums): the first n replicas' values
        rows = np.asarray(value.stacked_value())[:n]
        return PerReplica(jax.device_put(rows, split), num_replicas=n, stacked=True)
    mask = None if value._mask is None else jax.device_put(global_host_value(value._mask), split)
    count = (
        None
        if value._count is None
        else jax.device_put(np.asarray(value._count), strategy._replicated)
    )
    return PerReplica(
        jax.device_put(global_host_value(value.global_value), split),
        num_replicas=strategy.num_replicas_in_sync,
        stacked=False,
        mask=mask,
        count=count,
    )


def _named_variables(args: Sequence[Any], which: Any = ...) -> dict[str, Any]:
    """The NNX variables in `args`, by path (`args[0].out.kernel`); the Keras variables of a
    step's `Holder` by their own paths (`dense/kernel`). `which`: an NNX filter (`...`: every
    variable)."""
    out = {}
    for i, arg in enumerate(args):
        if not is_state(arg) or isinstance(arg, nnx.Variable):
            continue
        keras_paths = getattr(arg, "variable_paths", None)
        for path, var in nnx.to_flat_state(nnx.state(arg, which)):
            if is_hollow(var.get_raw_value()):  # Optax's MaskedNode: no array
                continue
            if keras_paths is not None:
                name = keras_paths[int(str(path[-1]))]
            else:
                name = f"args[{i}]." + ".".join(map(str, path))
            out[name] = var
    return out


def _named_state(args: Sequence[Any], which: Any = ...) -> dict[str, Any]:
    """The arrays of `_named_variables(args, which)`."""
    return {name: var.get_value() for name, var in _named_variables(args, which).items()}


def _processes_check(strategy: Any, args: Sequence[Any]) -> Check:
    """Several processes: whether they hold the same state; then every process holds the
    chief's, as the first step would give it (the checks after compare one model)."""
    runner = strategy._step_runner()
    variables = {
        name: var
        for name, var in _named_variables(args).items()
        if not (is_per_replica_state(var.get_raw_value()) or is_sharded_variable(var))
    }
    agreed = {name for name, var in variables.items() if runner.agreement.is_agreed(var)}
    check = check_processes({n: v.get_raw_value() for n, v in variables.items()}, agreed)
    runner.agreement.agree(list(variables.values()))
    return check


def _params(args: Sequence[Any]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in _named_state(args, nnx.Param).items()}


def _mirrored_arrays(args: Sequence[Any]) -> dict[str, jax.Array]:
    """The state that must be identical on every device (per-replica state left out)."""
    return {
        name: var.get_raw_value()
        for name, var in _named_variables(args).items()
        if not (is_per_replica_state(var.get_raw_value()) or is_sharded_variable(var))
    }


def _global_batch(args: Sequence[Any]) -> int | None:
    for leaf in jax.tree.leaves(list(args), is_leaf=is_per_replica):
        if isinstance(leaf, PerReplica) and not leaf.stacked:
            if leaf._count is not None:  # padded to a multiple of the replicas: the real rows
                return int(np.asarray(leaf._count).item())
            return int(leaf.global_value.shape[0])
    return None


def verify(
    strategy: Any,
    step_fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    steps: int = 3,
    expected_replicas: int | None = None,
    dataset_size: int | None = None,
    steps_per_epoch: int | None = None,
    scaling: bool = False,
    scaling_steps: int = 10,
    batch_size: int | None = None,
) -> Report:
    """Prove that `strategy.run(step_fn, args)` really trains as one synchronous model.

    Runs on copies of the state (the caller's model and optimizer are untouched): the devices
    used; all-reduces in the compiled step; bit-identical replicas after `steps` steps; one
    N-replica step against one single-device step on the same global batch (use plain SGD:
    Adam hides scale errors); optionally weak scaling; the input batch sizes.

    Keras (`mirrored.keras`): `step_fn` may reach its Keras model, optimizer and loss by
    closure, as TensorFlow's custom loops do; or `step_fn` is a compiled Keras model and
    `args` = (x, y[, sample_weight]): its `fit` step is checked on the first global batch of
    `batch_size` rows (default 32, as `fit`'s).

    Example:
        >>> report = mirrored.verify(strategy, train_step, (model, optimizer, x, y))
        >>> report.print(); assert report.ok
    """
    from mirrored._strategy.strategy import MirroredStrategy

    args = list(args)
    n = strategy.num_replicas_in_sync
    devices = list(strategy.extended.worker_devices)

    def devices_check(unmirrored: str | None) -> Check:
        return check_devices(
            used=devices,
            found=jax.local_devices(),
            expected_replicas=expected_replicas,
            gpus_visible=gpus_visible_to_system(),
            unmirrored_state=unmirrored,
        )

    try:
        keras = _keras_prepared(strategy, step_fn, args, batch_size)
    except ValueError as error:  # Keras variables outside the scope: nothing can run
        return Report([devices_check(str(error))])
    deterministic: Callable[..., Any] = step_fn
    quiet: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if keras is not None:
        step_fn, args = keras.step, keras.args
        deterministic, quiet = keras.deterministic()
        dataset_size = dataset_size if dataset_size is not None else keras.dataset_size
    unmirrored = None
    try:
        for i, arg in enumerate(args):
            if is_state(arg):
                strategy._check_mirrored(arg, f"args[{i}]")
    except ValueError as error:
        unmirrored = str(error)
    checks = [devices_check(unmirrored)]
    processes = jax.process_count()
    if processes > 1 and unmirrored is None:
        checks.append(_processes_check(strategy, args))
        if checks[-1].status == FAIL:  # the processes train different models: nothing to run
            return Report(checks)
    replicated = strategy._replicated
    copies = _copy_args(args, lambda a: jax.device_put(a, replicated), strategy)
    try:
        compiled = strategy._runner.compiled(step_fn, copies, {})
        hlo_text = str(compiled.as_text())
        checks.append(check_collectives(hlo_text, n))
        # The caller's layout, not the copies'; the compiled program's own bytes.
        memory = check_memory(args, hlo_text, n, compiled.memory_analysis())
        if memory is not None:
            checks.append(memory)
    except ReplicaDivergenceError as error:
        # Mirrored state computed from replica-local data: nothing synchronises the replicas.
        checks.append(check_collectives("", n))
        checks.append(Check("Replicas in sync", FAIL, str(error).split("\n")[0], str(error)))
        return Report(checks)
    except (ValueError, TypeError) as error:
        # The step cannot even be traced: report why; the checks that run it would only repeat it.
        first = str(error).split("\n")[0]
        checks.append(
            Check("Collectives", FAIL, f"the step failed to compile: {first}", str(error))
        )
        return Report(checks)

    ran = False
    try:
        for _ in range(steps):
            strategy.run(step_fn, args=copies)
        ran = True
        checks.append(check_in_sync(_mirrored_arrays(copies)))
    except ValueError as error:
        checks.append(Check("Replicas in sync", FAIL, str(error).split("\n")[0], str(error)))
    # On whether the step runs (the same on every process), not on this process' own
    # replicas: a process whose replicas differ must still join the others' collectives.
    if processes > 1 and ran:
        checks.append(check_stragglers(lambda: strategy.run(step_fn, args=copies)))
    note = strategy._step_runner().note(step_fn, copies)
    if note is not None:  # a plain BatchNorm on few rows per replica
        checks.append(Check("BatchNorm batch size", WARN, note.split("; ")[0], note))

    # One device of this process: on several processes each compares with its own.
    single = MirroredStrategy(devices[:1] if processes == 1 else jax.local_devices()[:1])
    try:
        before = _params(args)
        ours = _deterministic(_copy_args(args, lambda a: jax.device_put(a, replicated), strategy))
        theirs = _deterministic(
            _copy_args(args, lambda a: jax.device_put(a, single._replicated), single)
        )
        # TensorFlow's per-replica BatchNorm statistics differ from one device's by design;
        # synchronised, any difference left is the step's own.
        with batch_norm.synchronized_batch_norm(), quiet:
            strategy.run(deterministic, args=ours)
            single.run(deterministic, args=theirs)
        after_ours, after_theirs = _params(ours), _params(theirs)
        checks.append(
            check_equivalence(
                {k: after_ours[k] - before[k] for k in before},
                {k: after_theirs[k] - before[k] for k in before},
                n,
            )
        )
    except ValueError as error:
        checks.append(
            Check("Single-device equivalence", FAIL, str(error).split("\n")[0], str(error))
        )

    if scaling and processes > 1:
        checks.append(
            Check("Scaling", INFO, "not measured across processes: run verify on one process")
        )
    elif scaling:
        checks.append(_measure_scaling(step_fn, args, devices, scaling_steps))
    global_batch = _global_batch(args)
    if global_batch is not None:
        checks.append(
            check_input(n, global_batch, dataset_size=dataset_size, steps_per_epoch=steps_per_epoch)
        )
    return Report(checks)


def _keras_prepared(strategy: Any, step_fn: Any, args: list[Any], batch_size: int | None) -> Any:
    """A Keras step or model as an explicit step (`mirrored.keras._verify.Prepared`), or None."""
    prepared = None
    for extension in hooks.extensions:  # Keras, say: its state may be reached
        prepared = extension.prepare_verify(strategy, step_fn, args, batch_size)
        if prepared is not None:
            break
    if batch_size is not None and (prepared is None or prepared.dataset_size is None):
        raise TypeError(
            "verify expected batch_size only with a compiled Keras model (the global batch of "
            f"its fit); found it with the step function {step_fn!r}, whose batch is in args "
            "already. Fix: drop batch_size=."
        )
    return prepared


def _measure_scaling(
    step_fn: Callable[..., Any], args: Sequence[Any], devices: list[Any], steps: int
) -> Check:
    from mirrored._strategy.strategy import MirroredStrategy

    n = len(devices)
    counts = sorted({1, *(2**k for k in range(1, n.bit_length()) if 2**k < n), n})
    global_batch = _global_batch(args) or n
    per_replica = max(1, global_batch // n)
    rates = {}
    for count in counts:
        sub = MirroredStrategy(devices[:count])
        rows = per_replica * count

        def place(a: Any, sub: Any = sub) -> Any:
            return jax.device_put(a, sub._replicated)

        copies = _copy_args(_map_batches(functools.partial(_take, rows=rows), args), place, sub)
        sub.run(step_fn, args=copies)  # compile
        jax.block_until_ready(_mirrored_arrays(copies))
        start = time.perf_counter()
        for _ in range(steps):
            sub.run(step_fn, args=copies)
        jax.block_until_ready(_mirrored_arrays(copies))
        rates[count] = steps * rows / (time.perf_counter() - start)
    return check_scaling(rates, devices[0].platform)


def _take_rows(value: PerReplica, rows: int) -> PerReplica:
    """The first `rows` rows of a distributed batch, as a host-side template for re-splitting."""
    mask = value._mask
    return PerReplica(
        np.asarray(value.global_value)[:rows],  # type: ignore[arg-type]
        num_replicas=-1,
        stacked=False,
        mask=None if mask is None else np.asarray(mask)[:rows],  # type: ignore[arg-type]
        count=None if mask is None else np.asarray(np.asarray(mask)[:rows].sum(), np.int32),  # type: ignore[arg-type]
    )
