"""`mirrored.verify` on Keras: a step that reaches Keras objects, or a compiled model's `fit`.

Both become an NNX-style step whose first argument holds the Keras variables (a `Holder`), so
`verify` copies that argument and runs every check on the copies, as for an NNX model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras

from mirrored.keras import _bind, _fit, _patches

# Layers that draw noise when training, and the attribute that turns it off.
_NOISE: tuple[tuple[str, tuple[type, ...]], ...] = (
    ("rate", (keras.layers.Dropout, keras.layers.GaussianDropout, keras.layers.AlphaDropout)),
    ("stddev", (keras.layers.GaussianNoise,)),
)


@dataclasses.dataclass
class Prepared:
    """What `verify` checks: `step(*args)` under `strategy.run`, `args[0]` the Keras state."""

    step: Callable[..., Any]
    args: list[Any]
    objects: list[Any]  # the Keras objects the step reaches
    dataset_size: int | None = None

    def explicit_step(self) -> Callable[..., Any]:
        """The step as a function of explicit arguments (`mirrored doctor --profile`)."""
        return _bind.Explicit(self.step)

    def deterministic(self) -> tuple[Callable[..., Any], contextlib.AbstractContextManager[None]]:
        """The step with every dropout and noise layer off while it is traced: N replicas
        cannot draw one device's masks. A distinct object, so it compiles a program of its
        own and the usual one keeps its dropout."""
        return _bind.Explicit(self.step), _without_noise(self.objects)


@contextlib.contextmanager
def _without_noise(objects: list[Any]) -> Iterator[None]:
    saved = []
    for obj in objects:
        if not isinstance(obj, keras.layers.Layer):
            continue
        for layer in obj._flatten_layers(include_self=True):
            for attribute, types in _NOISE:
                if isinstance(layer, types) and getattr(layer, attribute, None):
                    saved.append((layer, attribute, getattr(layer, attribute)))
                    setattr(layer, attribute, 0.0)
    try:
        yield
    finally:
        for layer, attribute, value in saved:
            setattr(layer, attribute, value)


def prepare(
    strategy: Any, step_fn: Any, args: list[Any], batch_size: int | None
) -> Prepared | None:
    """The Keras form of `verify`'s input, or None when it involves no Keras object
    (`batch_size`: the global batch of a model's fit).

    Raises ValueError when Keras variables are not mirrored on `strategy` (created outside
    its scope): `verify` reports that as the devices check's failure.
    """
    if isinstance(step_fn, keras.Model):
        return _fit_step(strategy, step_fn, args, batch_size)
    made = _bind.explicit(strategy._step_runner(), step_fn, args, {})
    if made is None:
        return None
    step, step_args = made
    return Prepared(step, step_args, step.objects)


def _fit_step(strategy: Any, model: Any, data: list[Any], batch_size: int | None) -> Prepared:
    """`model.fit`'s training step on the first global batch of `data` = (x, y[, weights])."""
    if not getattr(model, "compiled", False):
        raise TypeError(
            "verify expected a compiled Keras model (its fit step is checked); found "
            f"{type(model).__name__} {model.name!r} not compiled. Fix: "
            "model.compile(optimizer=..., loss=...) inside strategy.scope() first."
        )
    if not 1 <= len(data) <= 3:
        raise TypeError(
            f"verify expected args=(x, y) or (x, y, sample_weight) with a Keras model, as "
            f"fit takes them; found {len(data)} item(s)."
        )
    size = len(jax.tree.leaves(data[0])[0])
    batch_size = batch_size or 32  # Keras' default
    batch = tuple(jax.tree.map(lambda a: a[:batch_size], part) for part in data)
    model.jax_state_sync()
    with strategy.scope():
        _patches.strategy_of(model)  # another strategy's model: its error
        _patches.check_mirrored(model, strategy, what="fit")
        model._symbolic_build(data_batch=batch)
    step = _fit._Step(model, strategy, "train")
    explicit = _bind.Explicit(step.traced)
    return Prepared(explicit, [step.bridge.holder, step.place(batch)], [model], size)
