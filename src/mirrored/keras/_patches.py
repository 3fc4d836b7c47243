"""Where mirrored changes Keras (JAX backend). Each change is a no-op outside mirrored.

- Variables created inside `strategy.scope()` are mirrored on the strategy's devices.
- Inside `strategy.run` on a split batch, a Keras loss with a mean reduction averages over the
  GLOBAL batch's real rows (as Keras' own loops do under a TensorFlow strategy), metrics leave
  padded rows out, BatchNormalization leaves them out of its statistics (and, with
  `synchronized=True`, computes them over the global batch), `add_loss` / weight regularization
  losses are divided by the replica count (TensorFlow's `scale_regularization_loss`),
  activity regularization counts the global batch's real rows once, and recurrent layers'
  initial states vary across replicas as their later states do.
- In `fit`'s step, a model's `compute_loss` is divided by the replica count as a whole.
- `compile`, `fit`, `evaluate`, `predict` and the `*_on_batch` calls of a model tied to a
  strategy (created or compiled in its scope) run data-parallel on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from keras.src import backend, ops, tree
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.losses import loss as loss_module

from mirrored._core import context as _context
from mirrored._core.global_rows import is_per_example, on_global_rows, split_context
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._nnx import batch_norm

# The strategy each model is tied to (created or compiled in its scope).
_STRATEGY_OF: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


# -- variables ----------------------------------------------------------------------------------


def _initialize_layout(original: Callable[[Any], None]) -> Callable[[Any], None]:
    def initialize_layout(self: Any) -> None:
        strategy = _context.entered_strategy()
        if self._layout is None and strategy is not None:
            self._layout = strategy._replicated  # mirrored: one copy on every device
            return
        original(self)

    return initialize_layout


# -- losses -------------------------------------------------------------------------------------

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
# Inside `whole_loss`: the model's `compute_loss` is divided by N as a whole, so its parts
# are the global batch's values, not shares of them.
_WHOLE: contextvars.ContextVar[bool] = contextvars.ContextVar("mirrored_whole_loss", default=False)


def _loss_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        ctx = split_context()
        if ctx is None or self.reduction not in (*_MEAN_REDUCTIONS, "sum"):
            return original(self, y_true, y_pred, sample_weight)
        scale = ctx.num_replicas_in_sync if _WHOLE.get() else 1
        whole = functools.partial(_whole_batch_loss, original, self)
        return _replica_loss(self, ctx, y_true, y_pred, sample_weight, whole, scale=scale)

    return __call__


def _whole_batch_loss(
    original: Callable[..., Any], loss: Any, y_true: Any, y_pred: Any, sw: Any, mask: Any
) -> Any:
    """Keras' own loss call on the global batch's rows (its Keras mask put back on)."""
    if mask is not None:
        backend.set_keras_mask(y_pred, mask)
    return original(loss, y_true, y_pred, sw)


@contextlib.contextmanager
def whole_loss(model: Any, ctx: _context.ReplicaContext) -> Iterator[None]:
    """`fit`'s step on a split batch: the model's `compute_loss`, divided by N as a whole.

    Keras' losses in it give N times this replica's share of the global batch's loss (the
    global loss, estimated by this replica), `model.losses` the regularization as on one
    device. What a `compute_loss` override adds itself (a weight penalty, a scale) is then
    counted once over the replicas, not N times, as when every part is a share of its own;
    summed over replicas, the loss is exactly one device's for any affine combination of its
    parts. (Under TensorFlow only Keras' own parts are scaled, so a penalty added by hand
    trains with N times its gradient.)
    """
    compute_loss = model.compute_loss
    n = ctx.num_replicas_in_sync

    def divided(*args: Any, **kwargs: Any) -> Any:
        token = _WHOLE.set(True)
        try:
            total = compute_loss(*args, **kwargs)
        finally:
            _WHOLE.reset(token)
        ctx.mark_replica_aware()  # scaled for the sum over replicas
        return total if total is None else total / n

    with _context.instance_attribute(model, "compute_loss", divided):
        yield


def _replica_loss(
    loss: Any,
    ctx: Any,
    y_true: Any,
    y_pred: Any,
    sample_weight: Any,
    whole: Callable[..., Any],
    *,
    scale: int = 1,
) -> Any:
    """This replica's share of the loss over the global batch: summed over replicas (as the
    gradients of mirrored weights are), it is the loss of the whole batch on one device
    (`scale` times the share inside `whole_loss`). A loss that is not a mean of per-example
    terms (Dice, a `call` that reduces) is `whole(y_true, y_pred, sample_weight, mask)` on
    the global batch's real rows, divided among the replicas."""
    in_mask = backend.get_keras_mask(y_pred)
    with ops.name_scope(loss.name):
        y_pred = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_pred)
        y_true = tree.map_structure(lambda x: ops.convert_to_tensor(x, dtype=loss.dtype), y_true)
        values = ops.convert_to_tensor(loss.call(y_true, y_pred), dtype=loss.dtype)
    out_mask = backend.get_keras_mask(values)
    rows = tree.flatten(y_pred)[0].shape[0] if tree.flatten(y_pred) else None
    if not is_per_example(values, rows):  # one number for the batch: of the global batch
        ctx.mark_replica_aware()  # divided among the replicas below
        value = on_global_rows(whole, y_true, y_pred, sample_weight, in_mask)
        return value * (scale / ctx.num_replicas_in_sync)
    if loss.reduction != "sum" or scale != 1:
        # A mean's share is scaled for the sum over replicas; a "sum" is each replica's own
        # sum, which the step still has to divide by the GLOBAL batch (divided by the
        # replica's batch, it trains with N× the gradient): the step is warned about then.
        ctx.mark_replica_aware()
    masks = [m for m in (in_mask, out_mask) if m is not None]
    element_mask = None
    if masks:
        element_mask = masks[0] if len(masks) == 1 else masks[0] & masks[1]
        element_mask = ops.cast(element_mask, loss.dtype)
    rows = _context.row_mask(values)
    weights = None if rows is None else ops.cast(rows, loss.dtype)
    if sample_weight is not None:
        sample_weight = ops.cast(sample_weight, loss.dtype)
        weights = sample_weight if weights is None else _times(sample_weight, weights)
    if element_mask is not None:
        weights = element_mask if weights is None else _times(element_mask, weights)
    if weights is not None:
        values = _times(values, weights)
    total = ops.sum(values) * scale
    if loss.reduction == "sum":
        return total
    if loss.reduction == "mean_with_sample_weight" and sample_weight is not None:
        # Keras divides by the weights merged with the mask (`apply_mask`): masked entries'
        # weights count for nothing
        if element_mask is not None:
            sample_weight = _times(sample_weight, element_mask)
        counted = sample_weight if rows is None else sample_weight * _broadcast(rows, sample_weight)
        divisor = jax.lax.psum(ops.sum(counted), REPLICA_AXIS)
    elif element_mask is not None:
        counted = element_mask if rows is None else element_mask * _broadcast(rows, element_mask)
        divisor = jax.lax.psum(ops.sum(counted), REPLICA_AXIS)
    else:
        count = ctx.example_count
        if count is None:
            count = values.shape[0] * ctx.num_replicas_in_sync
        per_row = 1
        for size in values.shape[1:]:
            per_row *= size
        divisor = ops.cast(count, loss.dtype) * per_row
    return ops.divide_no_nan(total, ops.cast(divisor, loss.dtype))


def _times(a: Any, b: Any) -> Any:
    """`a * b` for per-element values and weights of the same leading (row) axis: Keras'
    rank matching first (a trailing axis of 1), then a per-row one over the other's trailing
    axes (a sequence model's per-token loss times the padded-row mask)."""
    a, b = loss_module.squeeze_or_expand_to_same_rank(a, b)
    if a.ndim > b.ndim:
        b = ops.reshape(b, tuple(b.shape) + (1,) * (a.ndim - b.ndim))
    elif b.ndim > a.ndim:
        a = ops.reshape(a, tuple(a.shape) + (1,) * (b.ndim - a.ndim))
    return a * b


def _broadcast(rows: Any, like: Any) -> Any:
    rows = ops.cast(rows, like.dtype)
    return ops.reshape(rows, (rows.shape[0],) + (1,) * (like.ndim - 1))


def _aggregate_additional_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def aggregate(self: Any, loss: Any) -> Any:
        total = original(self, loss)
        ctx = split_context()
        if ctx is None or _WHOLE.get():  # whole_loss divides the whole loss by N
            return total
        # Every replica adds the same regularization: divided by N, the sum over replicas
        # counts it once (TensorFlow's scale_regularization_loss).
        return total / ctx.num_replicas_in_sync

    return aggregate


def _rnn(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' JAX `rnn` (every recurrent layer's loop, a `lax.scan`) on a split batch.

    The initial states are zeros, the same on every replica; after a step on the replica's
    rows they differ, and JAX's scan refuses a carry whose replica-variance changes (LSTM,
    GRU and SimpleRNN failed inside `fit` with "carry input and carry output must have equal
    types"). The states are marked as varying from the start, as the new states will be.
    """

    @functools.wraps(original)
    def rnn(step_function: Any, inputs: Any, initial_states: Any, *args: Any, **kwargs: Any) -> Any:
        if split_context() is not None and any(
            _context.is_varying(x) for x in tree.flatten(inputs)
        ):
            initial_states = tree.map_structure(_context.as_varying, initial_states)
        return original(step_function, inputs, initial_states, *args, **kwargs)

    return rnn


def _activity_loss(regularizer: Any, ctx: _context.ReplicaContext, output: Any) -> Any:
    """A layer's activity regularization inside `strategy.run` on a split batch (`ctx`).

    Keras adds `regularizer(output) / output.shape[0]`, and the trainer divides additional
    losses by N (`_aggregate_additional_loss`): over replicas that averages the replicas'
    means, which counts padded rows and weighs a ragged batch's replicas wrongly. Here the
    padded rows are zeroed and both divisions undone for one by the global batch's real rows:
    summed over replicas, `regularizer(all real rows) / rows`, as on one device (exact for
    Keras' L1, L2 and L1L2, which sum over the rows).
    """
    if not getattr(output, "ndim", 0):
        return regularizer(output)
    mask = _context.row_mask(output)
    if mask is not None:
        output = output * _broadcast(mask, output)
    loss = regularizer(output)
    padded = output.shape[0] * ctx.num_replicas_in_sync
    count = ctx.example_count if mask is not None else padded
    ratio = ops.divide_no_nan(float(padded), ops.cast(count, "float32"))
    return loss * ops.cast(ratio, loss.dtype)


class _ActivityRegularizer:
    """`Layer.activity_regularizer`, stored on the layer as before; read inside `strategy.run`
    on a split batch, it is `_activity_loss` around the layer's regularizer. Outside, and for
    saving (`get_config`), it is the layer's own regularizer, unchanged."""

    def __get__(self, layer: Any, owner: Any = None) -> Any:
        if layer is None:
            return self
        regularizer = layer.__dict__.get("activity_regularizer")
        ctx = split_context()
        if regularizer is None or ctx is None:
            return regularizer
        return functools.partial(_activity_loss, regularizer, ctx)

    def __set__(self, layer: Any, value: Any) -> None:
        layer.__dict__["activity_regularizer"] = value


def _defining(base: type, name: str) -> Iterator[type]:
    """`base` and its loaded subclasses that define `name` themselves."""
    seen: set[type] = set()
    stack = [base]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if name in cls.__dict__:
            yield cls


# -- BatchNormalization -------------------------------------------------------------------------


def _batch_norm_init(original: Callable[..., None]) -> Callable[..., None]:
    """`BatchNormalization.__init__` accepting `synchronized=True` on JAX.

    Keras allows it on TensorFlow only; under mirrored it means what it means there:
    statistics over the global batch. Keras reads `__init__`'s exact signature (its configs),
    so the replacement is generated with the original's parameters.
    """
    signature = inspect.signature(original)
    names = list(signature.parameters)
    if "synchronized" not in names or "kwargs" not in names:
        return original
    for parameter in signature.parameters.values():
        default = parameter.default
        if default is not inspect.Parameter.empty and type(default) not in (
            int,
            float,
            str,
            bool,
            type(None),
        ):
            return original  # a default we cannot spell: keep Keras' own
    forwarded = ", ".join(
        f"**{n}" if signature.parameters[n].kind is inspect.Parameter.VAR_KEYWORD else f"{n}={n}"
        for n in names[1:]
        if n != "synchronized"
    )
    source = (
        f"def __init__{signature}:\n"
        f"    _original(self, synchronized=False, {forwarded})\n"
        "    self.synchronized = synchronized\n"
    )
    namespace: dict[str, Any] = {"_original": original}
    exec(source, namespace)
    replacement = namespace["__init__"]
    replacement.__doc__ = original.__doc__
    replacement.__qualname__ = original.__qualname__
    return replacement  # type: ignore[no-any-return]


def _batch_norm_moments(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _moments(self: Any, inputs: Any, mask: Any) -> Any:
        ctx = split_context()
        rows = _context.row_mask(inputs)
        if ctx is None and self.synchronized:  # one device: its batch is the global batch
            self.synchronized = False
            try:
                return original(self, inputs, mask)
            finally:
                self.synchronized = True
        # `verify` compares with one device on global statistics (`batch_norm.synchronizing`).
        synchronized = self.synchronized or batch_norm.synchronizing()
        if ctx is not None and not synchronized:
            batch_norm.note_per_replica_statistics("BatchNormalization", inputs.shape[0])
        if ctx is None or (rows is None and mask is None and not synchronized):
            return original(self, inputs, mask)
        axes = tuple(self._reduction_axes)
        weights = jnp.ones(inputs.shape[:1], inputs.dtype) if rows is None else rows
        weights = _broadcast(weights, inputs)
        if mask is not None:
            weights = weights * jnp.expand_dims(ops.cast(mask, inputs.dtype), -1)
        weights = jnp.broadcast_to(weights, inputs.shape).astype(inputs.dtype)
        total = jnp.sum(inputs * weights, axes, keepdims=True)
        count = jnp.sum(weights, axes, keepdims=True)
        if synchronized:
            total = jax.lax.psum(total, REPLICA_AXIS)
            count = jax.lax.psum(count, REPLICA_AXIS)
        mean = total / jnp.maximum(count, 1)
        squares = jnp.sum(jnp.square(inputs - mean) * weights, axes, keepdims=True)
        if synchronized:
            squares = jax.lax.psum(squares, REPLICA_AXIS)
        variance = squares / jnp.maximum(count, 1)
        return jnp.squeeze(mean, axes), jnp.squeeze(variance, axes)

    return _moments


# -- optimizers ---------------------------------------------------------------------------------


def _optimizer_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """`optimizer.apply(grads)` inside a step `strategy.run` traces: Keras' stateless update.

    The stateful path assigns variables inside `ops.cond` branches (LossScaleOptimizer's
    skip, gradient accumulation), which leaks the branches' tracers out of a traced step;
    `stateless_apply` is the path Keras' own JAX trainer takes.
    """

    @functools.wraps(original)
    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        from mirrored.keras import _bridge

        scope = _bridge.step_scope.get()
        if scope is None or get_stateless_scope() is not scope or len(grads) == 0:
            return original(self, grads, trainable_variables)
        if not self.built:
            self.build(trainable_variables)  # deferred variables: run() traces the step again
            raise _bridge.VariablesCreated
        own = list(self._trainable_variables)
        if trainable_variables is not None and [id(v) for v in trainable_variables] != [
            id(v) for v in own
        ]:
            return original(self, grads, trainable_variables)

        def current(v: Any) -> Any:
            value = scope.get_current_value(v)
            return v._value if value is None else value

        new_weights, new_state = self.stateless_apply(
            [current(v) for v in self.variables], list(grads), [current(v) for v in own]
        )
        for v, value in zip(own, new_weights, strict=True):
            scope.add_update((v, value))
        for v, value in zip(self.variables, new_state, strict=True):
            scope.add_update((v, value))
        return None

    return apply


# -- models: compile, fit, evaluate, predict ----------------------------------------------------


def strategy_of(model: Any) -> Any:
    """The strategy a model trains on: the scope it is used in, or the one it is tied to."""
    current = _context.entered_strategy()
    tied = _STRATEGY_OF.get(model)
    if current is not None and tied is not None and current is not tied:
        raise ValueError(
            f"Expected {type(model).__name__} to be used with the strategy it was created or "
            f"compiled under, {tied!r}; found it used inside the scope of {current!r}. Its "
            "variables live on the first strategy's devices.\n"
            "Fix: create, compile and train the model under one strategy."
        )
    return current or tied


def _adopt(variables: list[Any], strategy: Any) -> None:
    """Mirror variables that hold no training yet (an optimizer or metric made before the
    scope and handed to `compile`): TensorFlow creates their state under the model's strategy."""
    for v in variables:
        value = v._value
        if isinstance(value, jax.Array) and not strategy._is_mirrored(value):
            v._layout = strategy._replicated
            v._direct_assign(value)


def check_mirrored(model: Any, strategy: Any, *, what: str) -> None:
    """TensorFlow's error for variables created outside the strategy's scope."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    others = list(model.metrics_variables)
    if optimizer is not None:
        others += list(optimizer.variables)
    _adopt(others, strategy)
    runner = strategy._step_runner()
    for v in variables:
        value = v._value
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        if not (isinstance(value, jax.Array) and runner.is_mirrored(value)):
            where = ", ".join(sorted(str(d) for d in getattr(value, "devices", lambda: [])()))
            raise ValueError(
                f"Variable {v.path!r} was not created in the distribution strategy scope of "
                f"{strategy!r}: it lives on {where or 'the host'}, not mirrored on the "
                f"strategy's {strategy.num_replicas_in_sync} device(s), so {what} would train "
                "a single-device copy. It is most likely because the model, a layer or the "
                "optimizer was created (or built) outside the scope.\n"
                "Fix: create, build and compile everything inside the scope:\n"
                "  with strategy.scope():\n"
                "      model = make_model()\n"
                "      model.compile(optimizer='adam', loss=..., metrics=[...])\n"
                "  model.fit(x, y, batch_size=GLOBAL_BATCH)"
            )


def _tie_at_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        strategy = _context.entered_strategy()
        if strategy is not None:
            _STRATEGY_OF[self] = strategy

    return __init__


def _compile(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = strategy_of(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        if self.built:
            check_mirrored(self, strategy, what="compile")
        with strategy.scope():
            out = original(self, *args, **kwargs)
        _STRATEGY_OF[self] = strategy
        return out

    return compile


def _in_strategy(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`fit` and friends: run on the model's strategy, inside its scope."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        strategy = strategy_of(self)
        if strategy is None:
            return original(self, *args, **kwargs)
        check_mirrored(self, strategy, what=what)
        _STRATEGY_OF[self] = strategy
        with strategy.scope():
            out = original(self, *args, **kwargs)
        # check_numerics: a non-finite value in the last steps raises before fit returns.
        strategy._check_pending()
        return out

    return method
