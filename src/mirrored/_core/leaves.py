"""What kind of thing each leaf of `strategy.run`'s arguments is, decided once per type."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrored._core.values import PerReplica

# isinstance against nnx.Variable goes through a metaclass hook, and these checks run for every
# leaf of every step: remember each type's coarse kind. "v" variable, "g" other NNX object,
# "p" PerReplica, "a" jax.Array, "c" host constant (NumPy, Python float), "x" anything else:
# static, part of the compiled program (Python bool, int, str, ...: `if training:` and
# `x[:k]` work inside the step, as they do in TensorFlow's `strategy.run`).
_TYPE_KINDS: dict[type, str] = {}


def type_kind(kind: type) -> str:
    known = _TYPE_KINDS.get(kind)
    if known is None:
        if issubclass(kind, nnx.Variable):
            known = "v"
        elif issubclass(kind, nnx.Pytree):
            known = "g"
        elif issubclass(kind, PerReplica):
            known = "p"
        elif issubclass(kind, jax.Array):
            known = "a"
        elif issubclass(kind, np.ndarray | np.generic | float | complex):
            known = "c"
        else:
            known = "x"
        _TYPE_KINDS[kind] = known
    return known


def is_leaf(x: Any) -> bool:
    """Variables and PerReplica values are leaves: the former are read and written back."""
    return type_kind(type(x)) in "vp"


def is_key(x: Any) -> bool:
    """Whether `x` is an array of typed random keys (what nnx.Rngs and Dropout hold)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def raw_array(x: Any) -> Any:
    """`x`, or for random keys their raw key data: what NumPy can hold, compare and save."""
    return jax.random.key_data(x) if is_key(x) else x


def is_hollow(value: Any) -> bool:
    """Whether a Variable's value is a pytree without any leaf (Optax's `MaskedNode`): there
    is nothing to place, step or save."""
    return value is not None and not isinstance(value, np.ndarray) and not jax.tree.leaves(value)
