"""What `mirrored doctor` checks: a built-in step on the digits, or a step from a user's file."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import optax
from flax import nnx

import mirrored
from mirrored._cli.demo import DigitsMLP, load_digits_split, train_step


def builtin_step(batch_size: int = 128) -> tuple[Any, Callable[..., Any], tuple[Any, ...]]:
    """A MirroredStrategy over every device, the digits MLP with SGD, one global batch."""
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        model = DigitsMLP(rngs=nnx.Rngs(0))
        # Plain SGD: unlike Adam, it shows a wrongly scaled gradient in the update.
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y, _, _ = load_digits_split()
    global_batch = max(batch_size, strategy.num_replicas_in_sync)
    (batch,) = list(
        strategy.experimental_distribute_dataset([(x[:global_batch], y[:global_batch])])
    )
    return strategy, train_step, (model, optimizer, *batch)


def user_step(spec: str) -> tuple[Any, Callable[..., Any], tuple[Any, ...]]:
    """Load FILE.py:FUNCTION and call FUNCTION() → (strategy, step_fn, args); step_fn may be
    a compiled Keras model, args then (x, y[, sample_weight]) for its fit."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(
            f"Expected --step FILE.py:FUNCTION; found {spec!r}. Fix: e.g. --step train.py:make"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"Expected a Python file at {path!r}; found none. Fix: check the path"
        )
    module_spec = importlib.util.spec_from_file_location("mirrored_doctor_user_step", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    # As `python FILE` would: the file's folder is importable while it loads and runs, so it
    # may import the modules beside it, from any working directory.
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
        factory = getattr(module, name, None)
        if not callable(factory):
            raise AttributeError(
                f"Expected a function {name!r} in {path}; found {factory!r}. Fix: define "
                f"def {name}(): ... return strategy, step_fn, args"
            )
        made = factory()
    finally:
        sys.path.remove(folder)
    if not (isinstance(made, tuple) and len(made) == 3):
        raise TypeError(
            f"Expected {name}() to return (strategy, step_fn, args); found "
            f"{type(made).__name__}. Fix: return the three as a tuple"
        )
    strategy, step_fn, args = made
    return strategy, step_fn, tuple(np.asarray(a) if isinstance(a, list) else a for a in args)


def profile_step(
    strategy: Any,
    step_fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    logdir: str,
    steps: int,
    batch_size: int | None = None,
) -> Any:
    """`mirrored.profile` of the doctor's step: the built-in one, the user's, or the fit step
    of the compiled Keras model the user's FUNCTION returned."""
    from mirrored._proof.verify import _keras_prepared

    prepared = _keras_prepared(strategy, step_fn, list(args), batch_size)
    if prepared is not None:
        step_fn, args = prepared.explicit_step(), tuple(prepared.args)
    return mirrored.profile(strategy, step_fn, args=args, steps=steps, logdir=logdir)
