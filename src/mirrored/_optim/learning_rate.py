"""The learning rate in an Optax optimizer's state: read and set between steps, no recompiling.

`optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)` keeps the rate in the optimizer
state (`InjectStatefulHyperparamsState.hyperparams["learning_rate"]`), an input of the compiled
step like the parameters. Writing a new value of the same dtype and placement there changes
the rate the next step uses and reuses the compiled step. A plain `optax.adam(1e-3)` bakes the
rate into the program as a constant: there is nothing to read or write.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from mirrored._core.values import to_host
from mirrored._optim.mixed_precision import LossScaleOptimizer

NAME = "learning_rate"
_INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)
_FIX = "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)"


@dataclasses.dataclass(frozen=True)
class _Found:
    path: str
    variable: nnx.Variable[Any]
    scheduled: bool  # a schedule recomputes it every step: readable, not settable


def _optax_state(optimizer: Any) -> Any:
    inner = optimizer.optimizer if isinstance(optimizer, LossScaleOptimizer) else optimizer
    if not isinstance(inner, nnx.Optimizer):
        raise TypeError(
            f"Expected an nnx.Optimizer or a mirrored.mixed_precision.LossScaleOptimizer; found "
            f"{type(optimizer).__name__}. Fix: pass an Optax transformation to the Trainer, "
            f"e.g. {_FIX}."
        )
    return inner.opt_state


def _search(node: Any, path: str, found: list[_Found], seen: set[str]) -> None:
    # Parameter-shaped trees (moments, accumulated gradients) and leaves hold no rate.
    if isinstance(node, nnx.State | nnx.Variable):
        return
    if isinstance(node, _INJECTED):
        seen.add(type(node).__name__)
        if NAME in node.hyperparams:
            scheduled = NAME in getattr(node, "hyperparams_states", {})
            found.append(_Found(f"{path}.hyperparams[{NAME!r}]", node.hyperparams[NAME], scheduled))
        _search(node.inner_state, f"{path}.inner_state", found, seen)
    elif isinstance(node, tuple) and hasattr(node, "_fields"):  # an Optax state NamedTuple
        seen.add(type(node).__name__)
        for field in node._fields:
            _search(getattr(node, field), f"{path}.{field}", found, seen)
    elif isinstance(node, tuple | list):  # optax.chain's states
        for i, child in enumerate(node):
            _search(child, f"{path}[{i}]", found, seen)
    elif isinstance(node, Mapping):  # optax.multi_transform's inner states
        for key, child in node.items():
            _search(child, f"{path}[{key!r}]", found, seen)


def find(optimizer: Any) -> _Found:
    """Where the optimizer's state holds its learning rate; errors show the fix."""
    found: list[_Found] = []
    seen: set[str] = set()
    _search(_optax_state(optimizer), "opt_state", found, seen)
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(
            f"Expected one learning rate in the optimizer state; found {len(found)}: "
            f"{', '.join(f.path for f in found)}. Fix: inject the learning rate into one "
            "transformation only, e.g. optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))."
        )
    hint = ""
    if "ScaleByScheduleState" in seen:
        hint = (
            " For a schedule, optax.inject_hyperparams(optax.adam)(learning_rate=schedule) "
            "makes the rate readable (the schedule still decides it)."
        )
    raise ValueError(
        "Expected the optimizer to keep its learning rate in its state, where it can change "
        "between steps without recompiling, as optax.inject_hyperparams does; found none among "
        f"its states ({', '.join(sorted(seen)) or 'none'}): optax.adam(1e-3) compiles the rate "
        f"into the step as a constant. Fix: build the optimizer as {_FIX} (any Optax "
        f"optimizer with a learning_rate argument works the same way).{hint}"
    )


def read(optimizer: Any) -> float:
    """The learning rate the next step uses (with a schedule: the one the last step used)."""
    return float(to_host(find(optimizer).variable.get_value()))


def as_rate(
    value: Any, *, found_in: str = "", fix: str = "e.g. trainer.learning_rate = 1e-3"
) -> float:
    """`value` as a Python float, if it is a finite real number (a 0-d array too)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        dtype = np.asarray(value).dtype
        ok = value.shape == () and np.issubdtype(dtype, np.number)
        ok = ok and not np.issubdtype(dtype, np.complexfloating)
    if not ok or not math.isfinite(float(value)):
        raise ValueError(
            f"Expected the learning rate to be a finite real number; found {value!r}"
            f"{found_in}. Fix: {fix}."
        )
    return float(value)


def check_settable(optimizer: Any) -> nnx.Variable[Any]:
    """The variable holding the rate, if it can be set; errors show the fix."""
    found = find(optimizer)
    if found.scheduled:
        raise TypeError(
            "Expected a learning rate that can be set; found one that a schedule computes "
            f"every step ({found.path} of optax.inject_hyperparams(...)(learning_rate="
            "<schedule>)), which would overwrite any value set. Fix: pass a number, "
            f"{_FIX}, to change the rate from callbacks such as LearningRateScheduler, or keep "
            "the schedule and drop what sets the rate."
        )
    return found.variable


def write(optimizer: Any, value: Any) -> None:
    """Set the learning rate on every replica, keeping its dtype and placement."""
    rate = as_rate(value)
    variable = check_settable(optimizer)
    current = variable.get_value()
    variable.set_value(jax.device_put(np.asarray(rate, current.dtype), current.sharding))
