"""`mirrored.keras.value_and_grad`: the JAX spelling of TensorFlow's `GradientTape` block."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope

from mirrored.keras import _bridge


def value_and_grad(
    fn: Callable[[], Any], variables: Sequence[Any], *, has_aux: bool = False
) -> tuple[Any, list[Any]]:
    """`fn()`'s value and its gradients with respect to the Keras `variables`.

    Replaces the tape block of a TensorFlow step:

        with tf.GradientTape() as tape:                 def compute_loss():
            logits = model(x, training=True)                logits = model(x, training=True)
            loss = loss_fn(y, logits)                       return loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
                                                        loss, grads = mirrored.keras.value_and_grad(
                                                            compute_loss, model.trainable_variables)

    `fn` takes no arguments: it reads the model as TensorFlow's tape block does. What it
    assigns besides (BatchNormalization's moving statistics, dropout's seed) takes effect as it
    would in the tape block. With `has_aux=True`, `fn` returns `(loss, aux)` and so does the
    first value returned. Inside `strategy.run` the gradients of mirrored weights are already
    summed over replicas; a Keras loss with its default reduction averages over the global
    batch, so they are the gradients of the global batch's loss.

    Returns:
        `(loss, grads)`: grads in the order of `variables`.
    """
    variables = list(variables)
    outer = get_stateless_scope()
    mapping = dict(outer.state_mapping) if outer is not None else {}
    values = [mapping.get(id(v), v._value) for v in variables]
    if any(x is None for x in values):
        raise ValueError(
            "value_and_grad expected built variables; found one without a value. Fix: build "
            "the model first (call it on a batch, or give its first layer an input shape)."
        )

    def compute(current: list[Any]) -> tuple[Any, tuple[Any, dict[int, Any]]]:
        scope = StatelessScope(initialize_variables=False)
        scope.state_mapping = dict(mapping)
        scope.state_mapping.update({id(v): x for v, x in zip(variables, current, strict=True)})
        with scope:
            out = fn()
        loss, aux = out if has_aux else (out, None)
        changed = {
            key: value
            for key, value in scope.state_mapping.items()
            if mapping.get(key) is not value and key not in own
        }
        return loss, (aux, changed)

    own = {id(v) for v in variables}
    created = _bridge.uninitialized_count()
    (loss, (aux, changed)), grads = jax.value_and_grad(compute, has_aux=True)(values)
    if outer is not None and _bridge.uninitialized_count() > created:
        # `fn` built the model (its first call): `variables` was read before it had any.
        # strategy.run initializes them and traces the step again.
        raise _bridge.VariablesCreated
    if outer is not None:
        outer.state_mapping.update(changed)
    elif changed:
        by_id = {id(v): v for v in _all_variables(fn)}
        for key, value in changed.items():
            if key in by_id:
                by_id[key].assign(value)
    return ((loss, aux) if has_aux else loss), list(grads)


def _all_variables(fn: Callable[..., Any]) -> list[Any]:
    from mirrored.keras import _bind

    return _bridge.variables_of(_bind._captured_objects(fn))
