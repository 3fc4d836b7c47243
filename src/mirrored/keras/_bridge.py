"""Keras variables as mirrored state: read into NNX slots for a step, written back after it.

A Keras object is not a pytree: passed to `strategy.run`, or captured by the step as in
TensorFlow's tutorials, its variables would be compiled in as constants. The bridge gives each
Keras variable an NNX slot of the kind that says how replicas combine it (TensorFlow's
variable aggregation), and runs the step under a Keras `StatelessScope` that maps each
variable to its slot's traced value; what the step assigns goes back into the slot, and from
there, after the step, into the Keras variable.

| Keras variable                         | slot            | across replicas                |
|----------------------------------------|-----------------|--------------------------------|
| trainable                              | `WeightSlot`    | must stay mirrored (gradients  |
|                                        |                 | of a mirrored loss are summed) |
| BatchNormalization moving statistics   | `MovingStatSlot`| averaged (TensorFlow's rule)   |
| `aggregation="mean"`                   | `MovingStatSlot`| averaged                       |
| `aggregation="sum"` (metric state)     | `SumSlot`       | each replica's additions summed|
| `SeedGenerator` state                  | `SeedSlot`      | a stream per replica           |
| anything else                          | `Slot`          | must stay mirrored             |
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import keras
from flax import nnx
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope

from mirrored._core import capture as _capture
from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._nnx import metrics


class Slot(nnx.Variable):  # type: ignore[type-arg]
    """A Keras variable that must stay identical on every replica."""


class WeightSlot(nnx.Param):  # type: ignore[type-arg]
    """A trainable Keras variable."""


class MovingStatSlot(nnx.BatchStat):  # type: ignore[type-arg]
    """A moving statistic: each replica's update is averaged across replicas."""


class SumSlot(metrics.MetricState):
    """Metric state (`aggregation="sum"`): the replicas' additions are summed."""


class SeedSlot(nnx.Variable):  # type: ignore[type-arg]
    """A `SeedGenerator`'s state: each replica draws from its own stream."""


class Holder(nnx.Pytree):
    """The slots of one set of Keras variables, passed to `strategy.run` as its first argument."""

    def __init__(self, slots: list[nnx.Variable[Any]], paths: tuple[str, ...]) -> None:
        self.slots = nnx.List(slots)
        self.variable_paths = paths  # static: how `verify` names each slot


_KERAS_TYPES: tuple[type, ...] = (
    keras.Variable,
    keras.layers.Layer,
    keras.optimizers.Optimizer,
    keras.metrics.Metric,
    keras.random.SeedGenerator,
)
_MAX_LEAVES = 64
# Each replica's seed: the mirrored seed plus replica × this odd constant (mod 2**32).
_SEED_STRIDE = 0x9E3779B9


def keras_objects(value: Any, *, depth: int = 1) -> list[Any]:
    """The Keras objects (layers, models, optimizers, metrics, variables, seed generators) in
    `value`: itself, the items of a list/tuple/dict, or the attributes of a plain object."""
    if isinstance(value, _KERAS_TYPES):
        return [value]
    if isinstance(value, list | tuple):
        items: Iterable[Any] = value[:_MAX_LEAVES]
    elif isinstance(value, dict):
        items = list(value.values())[:_MAX_LEAVES]
    elif depth > 0 and isinstance(getattr(value, "__dict__", None), dict):
        if _capture.is_code_or_namespace(value):
            return []  # functions, classes, modules: what they reach is visited elsewhere
        items = list(vars(value).values())[:_MAX_LEAVES]
    else:
        return []
    found = []
    for item in items:
        found += keras_objects(item, depth=depth - 1)
    return found


def variables_of(objects: Iterable[Any]) -> list[Any]:
    """Every Keras variable of `objects`, each once, in a fixed order."""
    found: dict[int, Any] = {}
    for obj in objects:
        if isinstance(obj, keras.Variable):
            own = [obj]
        elif isinstance(obj, keras.random.SeedGenerator):
            own = [obj.state]
        elif isinstance(obj, keras.layers.Layer):
            own = [*obj.variables, *obj.metrics_variables]
        else:  # optimizers, metrics
            own = list(obj.variables)
        for v in own:
            found.setdefault(id(v), v)
    return list(found.values())


def _special_ids(objects: Iterable[Any]) -> tuple[set[int], set[int]]:
    """Ids of (BatchNormalization moving statistics, SeedGenerator states) among `objects`."""
    moving: set[int] = set()
    seeds: set[int] = set()
    for obj in objects:
        if isinstance(obj, keras.random.SeedGenerator):
            seeds.add(id(obj.state))
        if not isinstance(obj, keras.layers.Layer):
            continue
        for layer in obj._flatten_layers(include_self=True):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.built:
                moving.update((id(layer.moving_mean), id(layer.moving_variance)))
            for generator in getattr(layer, "_seed_generators", ()):
                seeds.add(id(generator.state))
    return moving, seeds


def slot_kinds(
    objects: Iterable[Any], variables: list[Any], *, sums: bool = True
) -> list[type[nnx.Variable[Any]]]:
    """The slot class of each variable; `sums=False` when the step combines metric state itself."""
    objects = list(objects)
    moving, seeds = _special_ids(objects)
    kinds: list[type[nnx.Variable[Any]]] = []
    for v in variables:
        aggregation = getattr(v, "aggregation", "none")
        if id(v) in seeds:
            kinds.append(SeedSlot)
        elif id(v) in moving or aggregation == "mean":
            kinds.append(MovingStatSlot)
        elif v.trainable:
            kinds.append(WeightSlot)
        elif aggregation == "sum" and sums:
            kinds.append(SumSlot)
        else:
            kinds.append(Slot)
    return kinds


def uninitialized_count() -> int:
    """How many Keras variables wait for deferred initialization (created in a stateless scope)."""
    return len(global_state.get_global_attribute("uninitialized_variables") or ())


# The StatelessScope of the step `strategy.run` is tracing (see `_patches._optimizer_apply`).
step_scope: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "mirrored_keras_step", default=None
)


class VariablesCreated(Exception):
    """A step created Keras variables while it was traced (a lazy build): trace it again."""


class Bridge:
    """Slots for a fixed list of Keras variables, and the two copies around a step."""

    def __init__(self, variables: list[Any], kinds: list[type[nnx.Variable[Any]]]) -> None:
        self.variables = variables
        self.kinds = kinds
        self.slots = [kind(_value_of(v)) for v, kind in zip(variables, kinds, strict=True)]
        self.holder = Holder(self.slots, tuple(v.path for v in variables))

    def pull(self, values: list[Any] | None = None) -> None:
        """Keras → slots, before a step (`values`: arrays to use instead of the variables')."""
        if values is None:
            values = [_value_of(v) for v in self.variables]
        for slot, value in zip(self.slots, values, strict=True):
            if slot._raw_value is not value:
                object.__setattr__(slot, "_raw_value", value)

    def push(self) -> None:
        """Slots → Keras, after a step."""
        for variable, slot in zip(self.variables, self.slots, strict=True):
            variable._value = slot._raw_value

    def values(self) -> list[Any]:
        return [slot._raw_value for slot in self.slots]


def _value_of(variable: Any) -> Any:
    value = variable._value
    if value is None:
        raise ValueError(
            f"Expected the Keras variable {variable.path!r} to hold a value; found none (it "
            "was created but never initialized, or Keras released it during fit). Fix: build "
            "the model before the step (call it once on a batch, or give its first layer an "
            "input shape)."
        )
    return value


def _replica() -> Any:
    """This replica's index while `run` traces a step over several replicas, else None."""
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd or ctx.num_replicas_in_sync == 1:
        return None
    return jax.lax.axis_index(REPLICA_AXIS)


def fold_seeds(values: list[Any], seeds: list[int]) -> list[Any]:
    """`values` with each SeedGenerator state moved to this replica's own stream.

    A seed state is (seed, counter); replica r draws from (seed + r × stride, counter), so
    replicas draw different dropout masks and each step new ones.
    """
    replica = _replica()
    if replica is None or not seeds:
        return values
    out = list(values)
    stride = replica.astype(jnp.uint32) * jnp.uint32(_SEED_STRIDE)
    for i in seeds:
        offset = jnp.zeros(values[i].shape, jnp.uint32).at[0].set(stride)
        out[i] = values[i] + offset.astype(values[i].dtype)
    return out


def mirrored_seed(new: Any) -> Any:
    """A seed state advanced by the step, the same on every replica: replica 0's (its stream
    is the mirrored seed's own)."""
    replica = _replica()
    if replica is None:
        return new
    return jax.lax.psum(jnp.where(replica == 0, new, jnp.zeros_like(new)), REPLICA_AXIS)


def call_stateless(
    variables: list[Any],
    kinds: list[type[nnx.Variable[Any]]],
    holder: Holder,
    fn: Callable[[], Any],
) -> Any:
    """Inside a traced step: run `fn` with each Keras variable read from its slot, and write
    what `fn` assigned back into the slots. Raises `VariablesCreated` after a lazy build."""
    slots = list(holder.slots)
    values = [slot.get_raw_value() for slot in slots]
    seeds = [i for i, kind in enumerate(kinds) if kind is SeedSlot]
    inner = fold_seeds(values, seeds)
    scope = StatelessScope(initialize_variables=False)
    scope.state_mapping = {id(v): x for v, x in zip(variables, inner, strict=True)}
    created = uninitialized_count()
    token = step_scope.set(scope)
    try:
        with scope:
            out = fn()
    finally:
        step_scope.reset(token)
    if uninitialized_count() > created:
        raise VariablesCreated
    for i, (v, slot) in enumerate(zip(variables, slots, strict=True)):
        new = scope.state_mapping[id(v)]
        if new is inner[i]:
            continue
        if kinds[i] is SeedSlot:
            new = mirrored_seed(new)
        slot.set_raw_value(jnp.asarray(new, dtype=values[i].dtype))
    return out


def keras_backend_error() -> ImportError | None:
    """The error to raise when Keras was imported with a backend other than JAX, else None."""
    backend = keras.backend.backend()
    if backend == "jax":
        return None
    return ImportError(
        f"mirrored distributes Keras 3 models on the JAX backend; Keras was imported with the "
        f"{backend!r} backend, so its models cannot run on mirrored's devices.\n"
        "Fix: select JAX before the first `import keras`:\n"
        "  KERAS_BACKEND=jax python train.py\n"
        "or, first thing in the script:\n"
        "  import os; os.environ['KERAS_BACKEND'] = 'jax'"
    )
