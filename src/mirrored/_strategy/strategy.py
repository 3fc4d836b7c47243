"""Strategies: where replicas live, how state is mirrored, and the cross-replica operations."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import numpy as np

from mirrored._core import context as _context
from mirrored._core import heartbeat as _heartbeat
from mirrored._core import hooks
from mirrored._core import lowering as _lowering
from mirrored._core import mesh as _mesh
from mirrored._core import settings as config
from mirrored._core.devices import DeviceLike, device_name, resolve_device, resolve_devices
from mirrored._core.values import PerReplica, ReduceOp, StackedBatches, ValueContext
from mirrored._data import epoch as _epoch
from mirrored._data import from_function as _from_function
from mirrored._data import input as _input
from mirrored._run import hang
from mirrored._run.runner import Runner
from mirrored._strategy import abstract, cross_replica

logger = logging.getLogger("mirrored")


class StrategyMixError(RuntimeError, ValueError):
    """Entering one strategy's scope inside another's (TensorFlow raises RuntimeError)."""


def _refuse_mixing(strategy: Any, what: str, fix: str) -> None:
    """StrategyMixError when `what` `strategy` happens inside another strategy's scope."""
    current = _context.entered_strategy()
    if current is not None and current is not strategy:
        raise StrategyMixError(
            f"Expected {what} {strategy!r} outside any other strategy's scope; found it "
            f"inside the scope of {current!r}. Mixing strategies would place state on two "
            f"sets of devices.\nFix: {fix}, or use one strategy throughout."
        )


def _refuse_in_a_step(what: str, instead: str) -> None:
    """A cross-replica operation inside `run`'s step (each replica would combine only its
    own value alone: N× a sum, silently)."""
    _context.refuse_inside_a_step(
        what,
        "where each replica would combine only its own value",
        f"inside the step use mirrored.get_replica_context().{instead}, or return the value "
        f"from the step and call {what} on the result",
    )


class _Scope:
    """What `strategy.scope()` returns: a context manager that may be entered again and again."""

    __slots__ = ("_strategy", "_tokens")

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._tokens: list[tuple[Any, Any]] = []

    def __enter__(self) -> Strategy:
        strategy = self._strategy
        _refuse_mixing(strategy, "to enter", "leave the first `with strategy.scope():` block")
        ctx = _context.current_replica_context()
        if ctx is not None and ctx.in_spmd:  # inside run's step: already this strategy's
            self._tokens.append((None, None))
            return strategy
        hooks.load_extensions()  # Keras imported since: mirror its variables too
        token = _context.push_scope(strategy)
        try:
            mesh = jax.set_mesh(strategy._mesh)  # sets the mesh now; exiting restores the last
        except BaseException:
            _context.pop_scope(token)
            raise
        self._tokens.append((token, mesh))
        return strategy

    def __exit__(self, *exc: Any) -> None:
        token, mesh = self._tokens.pop()
        if mesh is None:  # entered inside run's step: nothing was set
            return
        try:
            mesh.__exit__(*exc)
        finally:
            _context.pop_scope(token)


class Extended:
    """The few `strategy.extended` attributes TensorFlow users reach for."""

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        self._devices = tuple(devices)

    @property
    def worker_devices(self) -> tuple[jax.Device, ...]:
        """The devices holding one replica each, in replica order."""
        return self._devices


class Strategy:
    """Synchronous data parallelism over a fixed set of devices, one replica per device."""

    def __init__(
        self,
        devices: Sequence[jax.Device],
        *,
        max_in_flight: int | None = None,
        donate: bool = True,
        hang_timeout: float | None = None,
    ) -> None:
        if not isinstance(donate, bool):
            raise TypeError(f"Expected donate to be True or False; found {donate!r}.")
        if max_in_flight is not None and (
            not isinstance(max_in_flight, int)
            or isinstance(max_in_flight, bool)
            or max_in_flight < 1
        ):
            raise ValueError(
                f"Expected max_in_flight to be a positive int or None; found {max_in_flight!r}. "
                "Fix: keep the default None (2 steps with several replicas, no bound with one), "
                "or pass a number of steps."
            )
        config.use_default_compilation_cache()  # before this strategy compiles anything
        _lowering.install()
        abstract.install()
        self._extended = Extended(devices)
        self._mesh = _mesh.make_mesh(devices)
        self._replicated = _mesh.replicated(self._mesh)
        self._split = _mesh.split(self._mesh)
        self._runner = Runner(self, max_in_flight=max_in_flight, donate=donate)
        hang.start_watchdog(hang_timeout)  # several processes: on by default

    # -- properties -----------------------------------------------------------------------------

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas compute each step together (the device count)."""
        return len(self._extended.worker_devices)

    @property
    def extended(self) -> Extended:
        return self._extended

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The one-axis JAX mesh of this strategy, axis named `mirrored.REPLICA_AXIS`."""
        return self._mesh

    def __repr__(self) -> str:
        names = ", ".join(device_name(d) for d in self._extended.worker_devices)
        return (
            f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, "
            f"devices=[{names}])"
        )

    # -- scope ------------------------------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy; state created inside is mirrored on its devices.

        The returned object may be entered more than once (`s = strategy.scope()`, then
        `with s:` twice), as in TensorFlow. Entering another strategy's scope inside this one
        raises `RuntimeError`.

        Example:
            >>> with strategy.scope():
            ...     model = MLP(rngs=nnx.Rngs(0))
        """
        return _Scope(self)

    # -- running ------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run `fn(*args, **kwargs)` once per replica as one compiled SPMD program.

        Mirrored state (NNX modules, optimizers, variables) must be passed in `args`/`kwargs`;
        `fn` may update it in place and it stays mirrored. Distributed batches arrive as each
        replica's shard. Results that differ between replicas come back as `PerReplica`;
        results identical on every replica come back as plain (mirrored) arrays.

        Example:
            >>> loss = strategy.run(train_step, args=(model, optimizer, x, y))
            >>> strategy.reduce("SUM", loss, axis=None)

        Differs from tf.distribute: state is passed as arguments, never captured by closure.
        """
        _check_callable(fn, "strategy.run(fn)")
        self._outside_other_scopes("strategy.run")
        if _context.current_replica_context() is not None:
            raise RuntimeError(
                "Expected strategy.run to be called from the host (cross-replica context); found "
                "it called inside another strategy.run. Fix: call the inner function directly."
            )
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"Expected args to be a tuple or list of arguments; found {type(args).__name__}. "
                "Fix: strategy.run(fn, args=(model, x)) — note the trailing comma for one "
                "argument: args=(x,)."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"Expected kwargs to be a dict or None; found {type(kwargs).__name__}.")
        return self._runner(fn, args, kwargs or {})

    def _outside_other_scopes(self, what: str) -> None:
        """Refuse `what` of this strategy inside another strategy's scope (TensorFlow's
        "Mixing different tf.distribute.Strategy objects"): its devices are not this one's."""
        _refuse_mixing(self, f"{what} of", "call it after leaving `with other.scope():`")

    # -- the named surface the layers above use (not public API) -------------------------------

    def _step_runner(self) -> Runner:
        """The runner of this strategy's steps, for an extension that binds its own (Keras)."""
        return self._runner

    def _is_mirrored(self, x: Any) -> bool:
        """Whether the jax.Array `x` is replicated on exactly this strategy's devices."""
        return self._runner.is_mirrored(x)

    def _check_mirrored(self, obj: Any, label: str) -> None:
        """Raise the out-of-scope error for the first variable of `obj` not mirrored here."""
        self._runner.check_mirrored(obj, label)

    def _check_pending(self) -> None:
        """check_numerics: raise for a checked step not looked at yet."""
        self._runner.check_pending()

    def _lowered(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """The program `run(fn, args, kwargs)` executes, traced and lowered (nothing runs)."""
        return self._runner.lowered(fn, args, kwargs)

    def _compiled_text(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> str:
        """The optimized HLO of the program `run(fn, args, kwargs)` executes (nothing runs)."""
        return str(self._runner.compiled(fn, args, kwargs).as_text())

    def run_steps(
        self,
        fn: Callable[..., Any],
        iterator: Iterator[Any],
        *,
        steps: int,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run up to `steps` steps in ONE compiled program: TensorFlow's `tf.function` that
        loops `strategy.run` over `next(iterator)`, without a dispatch from Python per step.

        Takes the next `steps` batches of `iterator` (a distributed dataset's), and runs
        `fn(*args, *batch, **kwargs)` on each in order (a batch that is a tuple is unpacked,
        as `strategy.run(fn, args=(*args, *batch))` would; any other batch is one argument),
        inside a `jax.lax.scan`. The state in `args` is updated after every step exactly as
        `steps` calls of `strategy.run` update it, ragged (padded) batches included.

        Returns `fn`'s outputs stacked on a new leading axis, one entry per step run (fewer
        than `steps` when the iterator ran out; `()` when `fn` returns nothing), or None when
        the iterator was already exhausted. A different number of steps compiles a program of
        its own.

        Example:
            >>> iterator = iter(strategy.experimental_distribute_dataset(ds))
            >>> while (losses := strategy.run_steps(train_step, iterator, steps=32,
            ...                                      args=(model, optimizer))) is not None:
            ...     per_step = strategy.reduce("SUM", losses, axis=None)   # shape (32,)
        """
        if _context.current_replica_context() is not None:
            raise RuntimeError(
                "Expected strategy.run_steps to be called from the host; found it inside "
                "strategy.run. Fix: call the inner function directly."
            )
        self._outside_other_scopes("strategy.run_steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"Expected steps to be a positive int; found {steps!r}.")
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"Expected args to be a tuple or list of arguments; found {type(args).__name__}."
                " Fix: args=(model, optimizer)."
            )
        if not isinstance(iterator, Iterator):
            raise TypeError(
                f"Expected an iterator of distributed batches; found {type(iterator).__name__}. "
                "Fix: iterator = iter(strategy.experimental_distribute_dataset(...)), made once "
                "and passed to every call, so each call takes the next batches."
            )
        # `iter(dataset)` of in-memory arrays: K batches gathered at once.
        batches: Any = _epoch.ONE_AT_A_TIME
        if isinstance(iterator, _epoch.Epoch):
            batches = iterator.stacked(steps)
        if batches is None:
            return None  # the epoch has ended
        if batches is _epoch.ONE_AT_A_TIME:
            batches = list(itertools.islice(iterator, 1))
            if not batches:
                return None
            if isinstance(batches[0], StackedBatches):  # a dataset's `epoch_chunks`: K steps
                batches = batches[0]
            else:
                batches += itertools.islice(iterator, steps - 1)
        for extension in hooks.extensions:  # Keras, say: its state may be captured
            out = extension.bind_steps(self._runner, fn, args, kwargs or {}, batches)
            if out is not hooks.NOT_BOUND:
                break
        else:
            out = self._runner.call_steps(fn, args, kwargs or {}, batches)
        return () if out is None else out  # steps ran: never None, which means "exhausted"

    # -- cross-replica operations -----------------------------------------------------------------

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine per-replica values into one value on the host side.

        `axis=None` combines across replicas only. `axis=k` also reduces along axis `k` of each
        replica's value, so `MEAN` divides by the global number of elements.

        A padded batch, or an output of `run` computed per example from one, carries the
        batch's mask: `axis=0` counts its real rows only, exactly as TensorFlow counts the
        unevenly split last batch (`[5, 6, 7]` on 2 replicas: `MEAN` is 6.0). Other axes would
        mix padding into the result and raise while the batch is padded.

        Example:
            >>> strategy.reduce("SUM", per_replica_loss, axis=None)
        """
        self._outside_other_scopes("strategy.reduce")
        _refuse_in_a_step("strategy.reduce", "all_reduce('SUM', value)")
        self._runner.check_pending()  # check_numerics: raised before the value is read
        with _heartbeat.phase("read"):
            return cross_replica.reduce(self, reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's value along `axis`, in replica order.

        On a padded batch (or `run`'s per-example outputs over one), `axis=0` keeps the real
        rows only, in order: the global batch as the dataset yielded it.
        """
        self._outside_other_scopes("strategy.gather")
        _refuse_in_a_step("strategy.gather", "all_gather(value, 0)")
        self._runner.check_pending()  # check_numerics: raised before the value is read
        with _heartbeat.phase("read"):
            return cross_replica.gather(self, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's replicas' values, one entry per replica, each on its own device.

        A padded batch shows each replica's real rows only (as TensorFlow's unevenly split
        last batch: `[5, 6]` and `[7]`), so replicas' results may differ in length.
        """
        ctx = _context.current_replica_context()
        if ctx is not None and ctx.in_spmd:  # a replica's own value, as TensorFlow's (value,)
            return (value,)
        self._runner.check_pending()  # check_numerics: raised before the value is read
        return cross_replica.local_results(self, value)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Build a `PerReplica` from `value_fn(ValueContext)`, called once per local replica."""
        _check_callable(value_fn, "experimental_distribute_values_from_function(value_fn)")
        n = self.num_replicas_in_sync
        local = [
            (i, d)
            for i, d in enumerate(self._extended.worker_devices)
            if d.process_index == jax.process_index()
        ]
        per_replica = [jax.tree.map(np.asarray, value_fn(ValueContext(i, n))) for i, _ in local]
        treedef = jax.tree.structure(per_replica[0])
        for (i, _), tree in zip(local, per_replica, strict=True):
            if jax.tree.structure(tree) != treedef:  # type: ignore[operator]
                raise ValueError(
                    f"Expected value_fn to return the same structure for every replica; replica "
                    f"0 gave {treedef} and replica {i} gave {jax.tree.structure(tree)}."
                )
        columns = zip(*(jax.tree.leaves(t) for t in per_replica), strict=True)
        out = []
        for column in columns:
            shapes = {x.shape for x in column}
            if len(shapes) != 1:
                raise ValueError(
                    f"Expected value_fn to return arrays of one shape on every replica; found "
                    f"shapes {sorted(shapes)}. Fix: pad the values to a common shape."
                )
            shards = [jax.device_put(x[None], d) for x, (_, d) in zip(column, local, strict=True)]
            array = jax.make_array_from_single_device_arrays(
                (n, *column[0].shape), self._split, shards
            )
            out.append(PerReplica(array, num_replicas=n, stacked=True))
        return jax.tree.unflatten(treedef, out)

    # -- input ------------------------------------------------------------------------------------

    def experimental_distribute_dataset(
        self,
        dataset: Any,
        options: _input.InputOptions | None = None,
        *,
        batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_remainder: bool = False,
    ) -> _input.DistributedDataset:
        """Split each GLOBAL batch of `dataset` across the replicas.

        `dataset` yields global batches (tuples/dicts of arrays): a list or generator, a Grain
        `MapDataset`/`IterDataset`, a `tf.data.Dataset` or a torch `DataLoader`. In-memory arrays
        (e.g. `(x, y)`) take `batch_size`, the GLOBAL batch size, and may be shuffled (seeded,
        different every epoch) by the fast path: a NumPy index gather on a background thread.

        A batch that does not fill the static shape (the last one, say) is padded with masked
        rows: every real example counts exactly once and nothing recompiles.

        Example:
            >>> dist = strategy.experimental_distribute_dataset((x, y), batch_size=256)
            >>> for xb, yb in dist:  # each a PerReplica: 256 / N rows per replica
            ...     strategy.run(train_step, args=(model, optimizer, xb, yb))
        """
        return _input.distribute_dataset(
            self,
            dataset,
            options,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
        )

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[_input.InputContext], Any],
        options: _input.InputOptions | None = None,
    ) -> _input.DistributedDataset:
        """Build the input pipeline from `dataset_fn(InputContext)`; each replica takes one batch.

        `dataset_fn` returns a dataset of PER-REPLICA batches
        (`ctx.get_per_replica_batch_size(global_batch_size)`); every step, each local replica
        takes the next one. Short or missing batches at the end are padded and masked.

        Example:
            >>> def dataset_fn(ctx):
            ...     per_replica = ctx.get_per_replica_batch_size(256)
            ...     return grain.MapDataset.source(records).batch(per_replica)
            >>> dist = strategy.distribute_datasets_from_function(dataset_fn)
        """
        return _from_function.distribute_from_function(self, dataset_fn, options)


class MirroredStrategy(Strategy):
    """One replica per device of this machine; gradients all-reduced every step.

    Args:
        devices: devices to mirror on — ``"/gpu:0"``, ``"gpu:0"``, ``"/cpu:3"``, ints or
            `jax.Device`s. None (the default) takes every local device of the default backend.
        max_in_flight: how many steps may be queued on the devices before the host waits.
            None (the default): 2 with several replicas (deeper queues of collectives
            deadlock simulated CPU devices), no bound with one (nothing to deadlock: the host
            runs ahead as in plain JAX; waiting cost a one-device Keras `fit` ~7% on CPU).
        donate: let each step reuse the previous state's device memory (the default; an
            array read out of a variable before a step is deleted by it). `False` keeps such
            arrays valid, at the cost of holding two copies of the state during a step.
        hang_timeout: seconds without any step, input or result before the job is reported
            as hung and stopped (`mirrored.HangError`, exit code 44, the stack of every
            thread); default `$MIRRORED_HANG_TIMEOUT`, else off for one process.
        cross_device_ops: TensorFlow's; accepted and ignored with a warning (XLA picks it).

    Example:
        >>> strategy = mirrored.MirroredStrategy()
        >>> strategy.num_replicas_in_sync
        8
    """

    def __init__(
        self,
        devices: Sequence[DeviceLike] | None = None,
        *,
        max_in_flight: int | None = None,
        donate: bool = True,
        hang_timeout: float | None = None,
        cross_device_ops: Any = None,
    ) -> None:
        if cross_device_ops is not None:  # TensorFlow's choice of all-reduce: XLA's here
            logger.warning(
                "MirroredStrategy(cross_device_ops=%r) is TensorFlow's choice of all-reduce "
                "(NCCL, hierarchical copy); XLA picks the collective here (NCCL on GPU), so it "
                "is ignored. Fix: drop the argument.",
                cross_device_ops,
            )
        resolved = resolve_devices(devices)
        super().__init__(
            resolved, max_in_flight=max_in_flight, donate=donate, hang_timeout=hang_timeout
        )
        logger.info(
            "%s: %d replica(s) on %s",
            type(self).__name__,
            len(resolved),
            ", ".join(device_name(d) for d in resolved),
        )


class OneDeviceStrategy(Strategy):
    """All computation on one device, with the same API as `MirroredStrategy`.

    Example:
        >>> strategy = mirrored.OneDeviceStrategy("/cpu:0")
    """

    def __init__(
        self, device: DeviceLike, *, max_in_flight: int | None = None, donate: bool = True
    ) -> None:
        resolved = resolve_device(device)
        super().__init__([resolved], max_in_flight=max_in_flight, donate=donate)
        logger.info("OneDeviceStrategy on %s", device_name(resolved))


class _DefaultStrategy(Strategy):
    """What `get_strategy()` returns outside every scope: one replica on the default device."""

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        return contextlib.nullcontext(self)


_default: list[_DefaultStrategy] = []
_default_replica: list[_context.ReplicaContext] = []


def _default_strategy() -> _DefaultStrategy:
    if not _default:
        _default.append(_DefaultStrategy([jax.local_devices()[0]]))
    return _default[0]


def _running() -> Strategy | None:
    """The strategy whose `run` is tracing the current step, if any."""
    ctx = _context.current_replica_context()
    return cast(Strategy, ctx.strategy) if ctx is not None else None


def get_strategy() -> Strategy:
    """The running or innermost entered strategy, or the default one-device strategy.

    Inside `strategy.run` this is the running strategy, even when `run` was called outside
    its scope (as in TensorFlow, where `run` enters the scope).
    """
    return _running() or cast(Strategy | None, _context.entered_strategy()) or _default_strategy()


def has_strategy() -> bool:
    """Whether a (non-default) strategy is current: its scope is entered, or its `run` runs."""
    return _running() is not None or _context.entered_strategy() is not None


def in_cross_replica_context() -> bool:
    """True inside `strategy.scope()` but outside `strategy.run` (TensorFlow's meaning)."""
    return _context.current_replica_context() is None and has_strategy()


def get_replica_context() -> _context.ReplicaContext | None:
    """The replica context inside `run`; None in cross-replica context; default outside scopes."""
    ctx = _context.current_replica_context()
    if ctx is not None:
        return ctx
    if has_strategy():
        return None
    if not _default_replica:  # one object, as TensorFlow's default replica context
        _default_replica.append(_context.ReplicaContext(_default_strategy(), in_spmd=False))
    return _default_replica[0]


def _check_callable(fn: Any, where: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"Expected {where} to be a function; found {type(fn).__name__} {fn!r}. Fix: pass "
            "the function itself, e.g. strategy.run(train_step, args=(model, x)), not its result."
        )
