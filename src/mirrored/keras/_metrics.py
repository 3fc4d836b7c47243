"""Keras metrics inside a padded batch's step (JAX backend): padded rows weigh 0, and a
metric of the whole batch (a `MeanMetricWrapper` around a function that gives one number per
batch, the classic `rmse`) is updated once, on the global batch's real rows."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import keras
from keras.src import backend, ops
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.losses import loss as loss_module

from mirrored._core import context as _context
from mirrored._core import patching
from mirrored._core.global_rows import first_replica, is_per_example, on_global_rows
from mirrored.keras._patches import _defining


def _sample_weight_position(cls: type) -> int | None:
    """The positional index of `sample_weight` in `cls.update_state` (None: it has none)."""
    try:
        parameters = list(inspect.signature(cls.__dict__["update_state"]).parameters)
    except (TypeError, ValueError):
        return None
    return parameters.index("sample_weight") - 1 if "sample_weight" in parameters else None


def _masked_update_state(original: Callable[..., Any], position: int) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        rows = _context.row_mask(args[0]) if args else None
        if rows is None:
            return original(self, *args, **kwargs)
        listed = list(args)
        weight = (
            listed.pop(position) if len(listed) > position else kwargs.pop("sample_weight", None)
        )
        if _of_whole_batch(self, listed, kwargs, rows.shape[0]):
            # One number per batch takes no weights (Keras cannot broadcast it to them); a
            # weight here is the padded-row mask an enclosing metric list passed down.
            return _update_once(original, self, listed, kwargs)
        return original(self, *listed, sample_weight=_row_weights(rows, weight, listed), **kwargs)

    return update_state


def _row_weights(rows: Any, weight: Any, args: list[Any]) -> Any:
    """The sample weights with padded rows at 0: the (rows,) mask on the weights' row axis,
    whatever their rank (per-token weights `(n, T)`), or shaped to meet the predictions' Keras
    mask (`Embedding(mask_zero=True)`: `(n, 1)` against a `(n, T)` mask)."""
    # Without weights: 0/1 as int32, which every metric casts to its dtype (a float mask made
    # the IoU metrics, which count in int32, warn about float weights).
    mask = ops.cast(rows, "int32")
    if weight is not None:
        weight = ops.convert_to_tensor(weight)
        if weight.ndim <= 1 or weight.shape[-1] == 1:  # (n,) or (n, 1): Keras' own pairing
            mask, weight = loss_module.squeeze_or_expand_to_same_rank(mask, weight)
            return ops.cast(mask, weight.dtype) * weight
        return ops.reshape(ops.cast(mask, weight.dtype), _row_shape(mask, weight.ndim)) * weight
    _, y_pred, _ = _true_pred(args, {})
    keras_mask = None if y_pred is None else backend.get_keras_mask(y_pred)
    if keras_mask is not None and keras_mask.ndim > 1:
        return ops.reshape(mask, _row_shape(mask, keras_mask.ndim))
    return mask


def _row_shape(mask: Any, ndim: int) -> tuple[int, ...]:
    return (mask.shape[0],) + (1,) * (ndim - 1)


def _of_whole_batch(metric: Any, args: list[Any], kwargs: dict[str, Any], rows: int) -> bool:
    """Whether a metric's function gives one number per batch, not per example (the classic
    `rmse`): Keras' `MeanMetricWrapper` around it, judged by its output's shape."""
    if not isinstance(metric, keras.metrics.MeanMetricWrapper):
        return False
    y_true, y_pred, _ = _true_pred(args, kwargs)
    if y_true is None or y_pred is None:
        return False
    shape = jax.eval_shape(lambda t, p: metric._fn(t, p, **metric._fn_kwargs), y_true, y_pred)
    return not is_per_example(shape, rows)


def _true_pred(args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """`update_state`'s labels and predictions, positional or named, and its other keywords."""
    rest = dict(kwargs)
    y_true = args[0] if args else rest.pop("y_true", None)
    y_pred = args[1] if len(args) > 1 else rest.pop("y_pred", None)
    return y_true, y_pred, rest


def _update_once(
    original: Callable[..., Any], metric: Any, args: list[Any], kwargs: dict[str, Any]
) -> None:
    """Keras' update of `metric` on the global batch's real rows, added once: every replica
    computes it and replica 0 keeps the change (the step sums the replicas' changes)."""
    variables = list(metric.variables)
    before = [v.value for v in variables]
    y_true, y_pred, rest = _true_pred(args, kwargs)
    mask = backend.get_keras_mask(y_pred)

    def updated(y_true: Any, y_pred: Any, mask: Any) -> list[Any]:
        if mask is not None:
            backend.set_keras_mask(y_pred, mask)
        with StatelessScope(state_mapping=list(zip(variables, before, strict=True))) as scope:
            original(metric, y_true, y_pred, **rest)
        return [
            old if (new := scope.get_current_value(v)) is None else new
            for v, old in zip(variables, before, strict=True)
        ]

    after = on_global_rows(updated, y_true, y_pred, mask)
    first = first_replica()
    for v, old, new in zip(variables, before, after, strict=True):
        v.assign(jnp.where(first, new, old))


_UPDATE_STATE = patching.target(
    "keras.metrics.Metric",
    "update_state",
    reason="(on every metric class in a padded batch's step) padded rows weigh 0",
    checked="keras 3.15",
)


@contextlib.contextmanager
def masked_keras_metrics() -> Iterator[None]:
    """While a padded batch's step is traced: every Keras metric weighs padded rows by 0."""
    with contextlib.ExitStack() as stack:
        for cls in list(_defining(keras.metrics.Metric, "update_state")):
            position = _sample_weight_position(cls)
            if position is None:
                continue
            original = cls.__dict__["update_state"]
            replacement = _masked_update_state(original, position)
            stack.enter_context(patching.temporarily(_UPDATE_STATE, replacement, owner=cls))
        yield
