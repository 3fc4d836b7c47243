"""`ReduceOp` and `PerReplica`: what crosses the boundary between replicas and the host."""

from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np


class ReduceOp(enum.Enum):
    """How values from all replicas combine. Strings ("SUM", "mean", ...) are accepted too."""

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        raise ValueError(
            f"Expected a ReduceOp or one of {list(cls.__members__)}; found {op!r}. "
            "Fix: strategy.reduce('SUM', value, axis=None) or mirrored.ReduceOp.SUM."
        )


_HOW_TO_READ = (
    "Fix: combine the replicas first, e.g. `strategy.reduce('SUM', value, axis=None)` "
    "(or 'MEAN'), or list them with `strategy.experimental_local_results(value)`."
)


class PerReplica:
    """One value per replica, held as a single global array on the replicas' devices.

    Two layouts share this type. *Stacked*: the array has a leading axis of length
    `num_replicas` and replica `i` owns `value[i]` (what `strategy.run` returns). *Split*: the
    leading axis is a batch split evenly, replica `i` owning the `i`-th chunk (what a
    distributed dataset yields).

    Differs from tf.distribute: there is no per-device Python list inside; the global
    `jax.Array` is the single source of truth and `experimental_local_results` slices it.
    """

    __slots__ = ("_count", "_mask", "_num_replicas", "_share", "_stacked", "_value")

    def __init__(
        self,
        value: jax.Array,
        *,
        num_replicas: int,
        stacked: bool,
        mask: jax.Array | None = None,
        count: jax.Array | None = None,
        share: bool = False,
    ) -> None:
        self._value = value
        # A scalar per replica from a step that called compute_average_loss: maybe each
        # replica's share of the loss (their SUM is the loss; `reduce` warns of a MEAN).
        self._share = share
        self._num_replicas = num_replicas
        self._stacked = stacked
        # A padded batch: which rows are real examples (split like the batch), and how many
        # real examples the global batch holds (the same scalar on every replica).
        self._mask = mask
        self._count = count

    def __getattr__(self, name: str) -> Any:
        if name == "values":  # TensorFlow's tuple of per-device components
            raise AttributeError(
                "PerReplica has no .values (TensorFlow's tuple of each replica's component); "
                "one global array holds every replica's value here. Fix: "
                "strategy.experimental_local_results(value) gives the tuple, each replica's "
                "real rows."
            )
        raise AttributeError(f"'PerReplica' object has no attribute {name!r}")

    @property
    def mask(self) -> PerReplica | None:
        """For a batch padded to a static shape: True for real examples, False for padding."""
        if self._mask is None:
            return None
        return PerReplica(self._mask, num_replicas=self._num_replicas, stacked=False)

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def stacked(self) -> bool:
        """True when the leading axis indexes replicas, False when it is a split batch."""
        return self._stacked

    @property
    def global_value(self) -> jax.Array:
        """The underlying global array (stacked or split along the leading axis)."""
        return self._value

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one replica's value."""
        shape = tuple(self._value.shape)
        if self._stacked:
            return shape[1:]
        return (shape[0] // self._num_replicas, *shape[1:])

    @property
    def dtype(self) -> Any:
        return self._value.dtype

    def stacked_value(self) -> jax.Array:
        """The values as one array with a leading replica axis, in either layout."""
        if self._stacked:
            return self._value
        return self._value.reshape(self._num_replicas, *self.shape)

    def __repr__(self) -> str:
        return (
            f"PerReplica(num_replicas={self._num_replicas}, shape={self.shape}, "
            f"dtype={self.dtype}) — one value per replica; read it with strategy.reduce(...) "
            "or strategy.experimental_local_results(...)"
        )

    def _refuse(self, what: str) -> TypeError:
        return TypeError(
            f"{what} a PerReplica value is ambiguous: it holds {self._num_replicas} values, one "
            f"per replica (each of shape {self.shape}), not one. {_HOW_TO_READ}"
        )

    def __iter__(self) -> Any:
        raise self._refuse("Iterating over")

    def __len__(self) -> int:
        raise self._refuse("Taking len() of")

    def __float__(self) -> float:
        raise self._refuse("Converting to float")

    def __int__(self) -> int:
        raise self._refuse("Converting to int")

    def __bool__(self) -> bool:
        raise self._refuse("Taking the truth value of")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise self._refuse("Converting to a NumPy array")

    def __getitem__(self, index: Any) -> Any:
        raise self._refuse("Indexing")

    def __jax_array__(self) -> jax.Array:
        raise self._refuse("Using in a JAX computation outside strategy.run")

    def __format__(self, spec: str) -> str:
        if not spec:  # f"{value}": its description
            return repr(self)
        raise self._refuse(f"Formatting (':{spec}')")

    def numpy(self) -> np.ndarray:  # TensorFlow's habit (`loss.numpy()`)
        raise self._refuse("Reading .numpy() of")

    def item(self) -> Any:  # NumPy's and PyTorch's habit
        raise self._refuse("Reading .item() of")

    def _arithmetic(self, *_: Any) -> Any:
        raise self._refuse("Arithmetic on")

    # `total_loss += loss` outside a reduce, say: the same refusal, with the fix.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __pow__ = __rpow__ = _arithmetic
    __matmul__ = __rmatmul__ = __neg__ = __abs__ = __pos__ = __invert__ = _arithmetic
    __mod__ = __rmod__ = __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _arithmetic
    __round__ = _arithmetic

    def _compare(self, *_: Any) -> Any:  # `if loss < best:` before a reduce
        raise self._refuse("Comparing")

    __lt__ = __le__ = __gt__ = __ge__ = _compare


def is_per_replica(x: Any) -> bool:
    """A pytree `is_leaf` that stops at PerReplica values."""
    return isinstance(x, PerReplica)


class ValueContext:
    """What `experimental_distribute_values_from_function` tells `value_fn` about its replica."""

    __slots__ = ("num_replicas_in_sync", "replica_id_in_sync_group")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def to_host(x: jax.Array) -> np.ndarray:
    """A global array as NumPy on this host, gathering other processes' shards when needed."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class StackedBatches:
    """K distributed batches already stacked on a leading step axis: `strategy.run_steps`'
    inputs as they are (each leaf (K, global batch, ...), split over the replicas on its
    second axis; the K masks likewise; the K real-example counts replicated).

    A distributed dataset of in-memory arrays yields these from `epoch_chunks` (`fit` with
    `steps_per_execution`): one transfer per leaf for K batches. `run_steps` takes one when
    the iterator yields it, in place of K batches."""

    __slots__ = ("count", "first", "leaves", "mask", "treedef")

    def __init__(
        self, treedef: Any, leaves: list[jax.Array], mask: jax.Array, count: jax.Array, first: Any
    ) -> None:
        self.treedef = treedef
        self.leaves = leaves
        self.mask = mask
        self.count = count
        self.first = first  # the first batch, as the iterator of single batches yields it

    def __len__(self) -> int:
        return int(self.mask.shape[0])
