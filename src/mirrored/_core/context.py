"""Which strategy is current (a context variable) and the replica context inside `run`."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.values import ReduceOp

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike as Strategy

# The stack of entered scopes, innermost last. A tuple so that every `with` restores exactly
# the previous value, even across threads and generators.
_scopes: contextvars.ContextVar[tuple[Strategy, ...]] = contextvars.ContextVar(
    "mirrored_scopes", default=()
)
_replica: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "mirrored_replica", default=None
)


def entered_strategy() -> Strategy | None:
    """The strategy of the innermost `scope()`, or None outside every scope."""
    scopes = _scopes.get()
    return scopes[-1] if scopes else None


def push_scope(strategy: Strategy) -> contextvars.Token[tuple[Strategy, ...]]:
    return _scopes.set((*_scopes.get(), strategy))


def pop_scope(token: contextvars.Token[tuple[Strategy, ...]]) -> None:
    _scopes.reset(token)


def current_replica_context() -> ReplicaContext | None:
    return _replica.get()


def enter_replica(ctx: ReplicaContext) -> contextvars.Token[ReplicaContext | None]:
    return _replica.set(ctx)


def exit_replica(token: contextvars.Token[ReplicaContext | None]) -> None:
    _replica.reset(token)


def row_mask(x: Any) -> Any:
    """The running replica's real-row mask (bool, one per row) when `x` has one row per example
    of a padded batch; None when the batch is not padded or `x` is not per example."""
    ctx = _replica.get()
    mask = None if ctx is None else ctx.example_mask
    if mask is None or not getattr(x, "ndim", 0) or x.shape[0] != mask.shape[0]:
        return None
    return mask


# (class, attribute) -> [uses, the original]: patches nest and may overlap between threads.
_patches: dict[tuple[type, str], list[Any]] = {}
_patch_lock = threading.Lock()


@contextlib.contextmanager
def patched_attribute(cls: type, name: str, replacement: Any) -> Iterator[None]:
    """`cls.name` is `replacement` while the block runs; the original is back after the last.

    `run` uses it while it traces a padded batch's step, so that Flax's BatchNorm and metrics
    leave the padded rows out.
    """
    key = (cls, name)
    with _patch_lock:
        if key not in _patches:
            _patches[key] = [0, cls.__dict__[name]]
            setattr(cls, name, replacement)
        _patches[key][0] += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patches[key][0] -= 1
            if _patches[key][0] == 0:
                setattr(cls, name, _patches.pop(key)[1])


@contextlib.contextmanager
def instance_attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    """`obj.name` is `value` while the block runs (set past the object's own `__setattr__`,
    which Keras and Flax track); an attribute the instance held before is back after it."""
    before = vars(obj).get(name, _ABSENT)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        if before is _ABSENT:
            object.__delattr__(obj, name)
        else:
            object.__setattr__(obj, name, before)


_ABSENT = object()


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes over which a traced value may differ between shards (its "vma")."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:  # jax 0.10 spells it aval.mat.varying
        axes = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(axes or ())


def is_unreduced(x: Any) -> bool:
    """Whether `x` is a partial sum that each replica holds (its sum over the replicas is the
    value): the gradient of a parameter whose gradients are reduce-scattered (ZeRO-2)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return REPLICA_AXIS in frozenset(getattr(mat, "unreduced", None) or ())


def is_varying(x: Any) -> bool:
    """Whether `x` may differ between replicas (False: provably identical on all of them)."""
    return REPLICA_AXIS in varying_axes(x)


def as_varying(x: Any) -> Any:
    """`x`, typed as differing between replicas (a scan carry that will, after a step)."""
    if x is None or is_varying(x):
        return x
    return jax.lax.pcast(x, (REPLICA_AXIS,), to="varying")


def _unreduced_error(op: ReduceOp, where: str) -> ValueError:
    effect = (
        "a MEAN would silently be 1/N of the true mean"
        if op is ReduceOp.MEAN
        else "reducing it here would make it whole on every device again"
    )
    return ValueError(
        f"all_reduce({op.value!r}) expected values that differ per replica; found{where} a "
        "gradient of a ShardedOptimizer(shard_gradients=True) model, which each replica holds "
        f"as its own part of the sum over the replicas (the optimizer reduce-scatters it; "
        f"{effect}). Fix: pass the gradients to optimizer.update as they are (it sums them); "
        "to look at them whole (a norm, a log), use shard_gradients=False."
    )


def _invariant_error(op: ReduceOp, path: str) -> ValueError:
    effect = "multiply it by the replica count" if op is ReduceOp.SUM else "do nothing"
    return ValueError(
        f"all_reduce({op.value!r}) expected a value that differs between replicas, but the "
        f"value{path} is already identical on every replica (it does not vary over the "
        f"{REPLICA_AXIS!r} axis), so the reduction would {effect}.\n"
        "The usual cause is the N× gradient trap: jax.grad / nnx.grad of a per-replica loss "
        "with respect to MIRRORED parameters already SUMS the gradients of all replicas.\n"
        "  Wrong:  grads = nnx.grad(loss_fn)(model)\n"
        "          grads = ctx.all_reduce('MEAN', grads)        # no-op or N× gradients\n"
        "  Right:  loss = mirrored.compute_average_loss(per_example_loss)  # ÷ GLOBAL batch\n"
        "          grads = nnx.grad(loss_fn)(model)             # already the global gradient\n"
        "Fix: drop the all_reduce for values computed only from mirrored state."
    )


class ReplicaContext:
    """What a replica knows about itself while `strategy.run` executes `fn`.

    Obtained with `mirrored.get_replica_context()` inside the function given to `run`.

    Example:
        >>> def step(x):
        ...     ctx = mirrored.get_replica_context()
        ...     return ctx.all_reduce("SUM", x.sum())
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        in_spmd: bool,
        example_mask: Any = None,
        example_count: Any = None,
        batch_is_split: bool = False,
        real_rows: tuple[int, ...] | None = None,
    ) -> None:
        self._strategy = strategy
        # The global batch's real-row counts the program is compiled for (a padded batch
        # whose step evaluates a function of the whole batch: `global_rows`), else None.
        self.real_rows = real_rows
        self._in_spmd = in_spmd
        self._example_mask = example_mask
        self._example_count = example_count
        self._batch_is_split = batch_is_split
        # Whether the step scaled a loss for the sum over replicas, or combined replicas
        # itself; `run` warns about the N× trap when it trains parameters without either.
        self.replica_aware = False
        # Whether the step called compute_average_loss: a scalar a metric then averages over
        # replicas is most likely a replica's share of the loss (metrics warn: loss / N).
        self.loss_shared = False
        self.mask_read = False  # whether the step read `example_mask` (it masks rows itself)
        self.warnings = True  # trace-time warnings (`run` traces a step twice: warns once)
        # ShardedOptimizer.update calls of this step, applied after it in the global view:
        # (optimizer, model, gradients, keyword arguments), the traced objects.
        self.deferred_updates: list[tuple[Any, Any, Any, Any]] = []
        # ZeRO-2 parameters among the step's: their gradients are each replica's part of a sum.
        self.gradients_scattered = False
        # Ids of state variables whose update only added to them (user's Flax metrics):
        # `run` sums the replicas' additions, as for metrics.
        self.summed_states: set[int] = set()
        self.not_summed_states: set[int] = set()
        # A BatchNorm that normalised with this replica's rows alone, and how many: (kind, rows).
        self.per_replica_norm: tuple[str, int] | None = None

    @property
    def in_spmd(self) -> bool:
        """True while `strategy.run` traces the step (False for the default strategy)."""
        return self._in_spmd

    @property
    def batch_is_split(self) -> bool:
        """Whether `run` was given a distributed batch (each replica sees its own shard)."""
        return self._batch_is_split

    def mark_replica_aware(self) -> None:
        """Note that the step scaled a loss for the sum over replicas, or combined them itself."""
        self.replica_aware = True

    @property
    def example_mask(self) -> Any:
        """This replica's real-example mask when a padded batch was passed to `run`, else None.

        `compute_average_loss` applies it on its own; use it for hand-written metrics.
        """
        self.mask_read = True
        return self._example_mask

    @property
    def example_count(self) -> Any:
        """Real examples in the GLOBAL batch when a padded batch was passed to `run`, else None."""
        return self._example_count

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index, 0..N-1, as a traced integer (a Python 0 outside `run`)."""
        if not self._in_spmd:
            return 0
        return jax.lax.axis_index(REPLICA_AXIS)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Combine `value` (a pytree) across all replicas; every replica gets the result.

        Raises:
            ValueError: when a leaf is already identical on every replica (see the N× trap).
        """
        op = ReduceOp.parse(reduce_op)
        if not self._in_spmd:
            return value
        self.mark_replica_aware()  # the step combines replicas itself
        reduce = {
            ReduceOp.SUM: jax.lax.psum,
            ReduceOp.MEAN: jax.lax.pmean,
            ReduceOp.MAX: jax.lax.pmax,
            ReduceOp.MIN: jax.lax.pmin,
        }[op]

        def one(path: Any, x: Any) -> Any:
            where = f" at {jax.tree_util.keystr(path)}" if path else ""
            if is_unreduced(x):
                raise _unreduced_error(op, where)
            if not is_varying(x):
                error = _invariant_error(op, where)
                if self.gradients_scattered:  # the first trace: the gradients still whole
                    raise ValueError(f"{error}\n{_unreduced_error(op, where)}")
                raise error
            return reduce(x, REPLICA_AXIS)

        return jax.tree_util.tree_map_with_path(one, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's `value` (a pytree) along `axis`, in replica order."""
        if not self._in_spmd:
            return value

        def one(x: Any) -> Any:
            if jnp.ndim(x) == 0:
                raise ValueError(
                    "ReplicaContext.all_gather expected values of rank 1 or more "
                    "(TensorFlow's rule: it concatenates along an existing axis); found a "
                    "scalar. Fix: all_gather(value[None], axis=0) for a vector of one value "
                    "per replica, or all_reduce('SUM' or 'MEAN', value) for one number."
                )
            if not isinstance(axis, int) or not -jnp.ndim(x) <= axis < jnp.ndim(x):
                raise ValueError(
                    f"ReplicaContext.all_gather expected axis to be an int in "
                    f"[{-jnp.ndim(x)}, {jnp.ndim(x)}) for a value of shape {jnp.shape(x)}; "
                    f"found {axis!r}. Fix: axis=0 concatenates the replicas' batches."
                )
            if not is_varying(x):
                x = jax.lax.pcast(x, REPLICA_AXIS, to="varying")
            return jax.lax.all_gather(x, REPLICA_AXIS, axis=axis, tiled=True)

        return jax.tree.map(one, value)

    def __repr__(self) -> str:
        return f"ReplicaContext(num_replicas_in_sync={self.num_replicas_in_sync})"


def refuse_inside_a_step(what: str, why: str, fix: str) -> None:
    """RuntimeError for `what`, a host operation, called inside `strategy.run`'s step (as
    TensorFlow refuses cross-replica operations in replica context)."""
    ctx = current_replica_context()
    if ctx is not None and ctx.in_spmd:
        raise RuntimeError(
            f"Expected {what} in cross-replica context (on the host, outside strategy.run), "
            f"as in TensorFlow; found it inside the step of strategy.run, {why}. Fix: {fix}."
        )
