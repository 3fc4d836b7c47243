"""The Trainer's compiled steps: train (loss, gradients, metrics), evaluate and predict, and the
running sums their metrics add to."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mirrored._core import context as _context
from mirrored._core.global_rows import (
    first_replica,
    is_per_example,
    on_global_rows,
    split_context,
)
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.values import PerReplica, StackedBatches, is_per_replica
from mirrored._optim.mixed_precision import LossScaleOptimizer
from mirrored._optim.sharded import ShardedOptimizer
from mirrored._strategy.losses import compute_average_loss, weighted_losses
from mirrored._train import metrics as _metrics
from mirrored._train import objectives as _objectives
from mirrored._train.batches import Chunk
from mirrored._train.keras_objectives import KerasLoss, KerasMetric, MetricNotBuilt

logger = logging.getLogger("mirrored")


def _make_steps(
    loss_fn: Any,
    metrics: Sequence[_objectives.Metric],
    weighted_metrics: Sequence[_objectives.Metric] = (),
    stateful_weighted: Sequence[bool] = (),
    *,
    accumulating: bool = False,
) -> tuple[Callable[..., Any], ...]:
    """The per-replica train, eval and predict steps. They close over configuration only.

    Metrics that are means over examples are running sums in `totals`; other metrics
    (`mirrored.metrics.Precision`, `AUC`, your own) come as `stateful`, a tuple of metric
    modules passed as state, updated with the weights when `stateful_weighted` says so.
    `accumulating`: the optimizer accumulates gradients by examples (`accumulate_by_examples`):
    each update gives it the batch's real example count.
    """

    def extra(y_pred: Any) -> dict[str, Any]:
        return {"examples": _examples(y_pred)} if accumulating else {}

    def update_stateful(stateful: Any, y: Any, y_pred: Any, w: Any) -> None:
        for metric, weighted in zip(stateful, stateful_weighted, strict=True):
            metric.update_state(y, y_pred, sample_weight=w if weighted else None)

    def accumulate(totals: Any, loss: Any, y: Any, y_pred: Any, w: Any) -> Any:
        # Each replica keeps its own running sums (loss, metrics..., weighted metrics...,
        # count, weight sum, then each metric's denominator), like TensorFlow's SYNC_ON_READ
        # variables: no collective per step; they are summed when read. As in Keras, the loss
        # is weighted by sample_weight and divided by the example count; `metrics` ignore the
        # weights and `weighted_metrics` divide by the weights' sum. `loss`: the per-example
        # losses, or one number for the global batch (`_loss_terms`).
        ctx = _context.current_replica_context()
        assert ctx is not None
        # Replica-local, like the examples themselves: derived from a per-example value.
        first = jax.tree.leaves(y_pred)[0]  # a model of several outputs: its first
        rows = loss if jnp.ndim(loss) else first.reshape(first.shape[0], -1)[:, 0]
        ones = rows * 0 + 1
        real = ones if ctx.example_mask is None else ones * ctx.example_mask
        real = real.astype(jnp.float32)
        weight = real if w is None else weighted_losses(real, w)
        if jnp.ndim(loss) == 0:  # the global batch's loss, counted once per real example
            local = [loss * jnp.sum(real)]
        else:
            local = [jnp.sum(loss.astype(jnp.float32) * weight)]
        terms = [_metric_terms(m, y, y_pred, real, None) for m in metrics]
        terms += [_metric_terms(m, y, y_pred, real, weight) for m in weighted_metrics]
        local += [total for total, _ in terms]
        local += [jnp.sum(real), jnp.sum(weight)]
        local += [denominator for _, denominator in terms]
        return totals + jnp.stack(local)

    def train_step(
        model: Any,
        optimizer: Any,
        totals: Any,
        stateful: Any,
        rngs: Any,
        x: Any,
        y: Any,
        sample_weight: Any = None,
    ) -> Any:
        w = sample_weight  # named in full for check_numerics' messages

        # The call-time random stream goes through the gradient as an argument (not a
        # capture), so the draws it makes inside are written back.
        def loss_of(model: Any, rngs: Any) -> Any:
            # Losses in float32 whatever the compute dtype; call-time randomness if given.
            y_pred = _float32(model(x) if rngs is None else model(x, rngs=rngs))
            share, loss = _loss_terms(loss_fn, y, y_pred, w)
            return share, (y_pred, loss)

        # Accumulating: each replica keeps its own gradients (no all-reduce per micro-batch);
        # the optimizer all-reduces their sums once per update. A ShardedOptimizer takes the
        # summed gradients (its update, the accumulation included, is in the global view).
        sharded = isinstance(getattr(optimizer, "optimizer", optimizer), ShardedOptimizer)
        local = (
            _local_parameters(model) if accumulating and not sharded else contextlib.nullcontext()
        )
        scaled = isinstance(optimizer, LossScaleOptimizer)
        if scaled:  # float16: scale the loss up, the gradients back down, skip non-finite steps

            def scaled_loss_of(model: Any, rngs: Any) -> Any:
                loss, aux = loss_of(model, rngs)
                return optimizer.get_scaled_loss(loss), aux

            with local:
                value_and_grad = nnx.value_and_grad(scaled_loss_of, has_aux=True)
                (_, (y_pred, per_example)), grads = value_and_grad(model, rngs)
            optimizer.apply(model, optimizer.get_unscaled_gradients(grads), **extra(y_pred))
        else:
            with local:
                value_and_grad = nnx.value_and_grad(loss_of, has_aux=True)
                (_, (y_pred, per_example)), grads = value_and_grad(model, rngs)
            optimizer.update(model, grads, **extra(y_pred))
        update_stateful(stateful, y, y_pred, w)
        return accumulate(totals, per_example, y, y_pred, w)

    def eval_step(
        model: Any, totals: Any, stateful: Any, x: Any, y: Any, sample_weight: Any = None
    ) -> Any:
        w = sample_weight
        y_pred = _float32(model(x))
        update_stateful(stateful, y, y_pred, w)
        return accumulate(totals, _loss_terms(loss_fn, y, y_pred, w)[1], y, y_pred, w)

    def predict_step(model: Any, x: Any) -> Any:
        return model(x)

    return train_step, eval_step, predict_step


def _additions(train_step: Callable[..., Any], width: int) -> Callable[..., Any]:
    """The training step for `run_steps`: what one step adds to the running sums (they are
    summed over the K steps on the devices afterwards, `_add_steps`)."""

    def train_additions(
        model: Any,
        optimizer: Any,
        stateful: Any,
        rngs: Any,
        x: Any,
        y: Any,
        sample_weight: Any = None,
    ) -> Any:
        zeros = jnp.zeros((width,), jnp.float32)
        return train_step(model, optimizer, zeros, stateful, rngs, x, y, sample_weight)

    train_additions.not_per_example = True  # type: ignore[attr-defined]  # run_steps: sums
    return train_additions


def _eval_additions(eval_step: Callable[..., Any], width: int) -> Callable[..., Any]:
    """The evaluation step for `run_steps`: what one step adds to the running sums."""

    def eval_additions(model: Any, stateful: Any, x: Any, y: Any, sample_weight: Any = None) -> Any:
        return eval_step(model, jnp.zeros((width,), jnp.float32), stateful, x, y, sample_weight)

    eval_additions.not_per_example = True  # type: ignore[attr-defined]  # run_steps: sums
    return eval_additions


def _gathering(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step(*head, *batch)` as `(*head, data, index)`: the batch is `data`'s rows `index`,
    gathered on this replica's device (the data is mirrored on every device)."""

    def gathered(*args: Any) -> Any:
        *head, data, index = args
        batch = jax.tree.map(lambda a: jnp.take(a, index, axis=0), data)
        return step(*head, *batch)

    gathered.__name__ = getattr(step, "__name__", "train_step")
    gathered.not_per_example = getattr(step, "not_per_example", False)  # type: ignore[attr-defined]
    return gathered


def building_keras_metrics(run: Callable[..., PerReplica]) -> Callable[..., PerReplica]:
    """`run` again after building a Keras metric sized by the data (F1Score), which raised
    `MetricNotBuilt` when the first trace met it, before anything ran."""

    @functools.wraps(run)
    def building(strategy: Any, *arguments: Any) -> PerReplica:
        try:
            return run(strategy, *arguments)
        except MetricNotBuilt as unbuilt:
            with strategy.scope():  # its sums mirrored, as every metric's
                for _, node in nnx.iter_graph(arguments[-1]):  # the caller's (not the copy)
                    if isinstance(node, KerasMetric) and node._keras is unbuilt.keras:
                        node.build(unbuilt.y_true, unbuilt.y_pred)
        return building(strategy, *arguments)

    return building


@building_keras_metrics
def run_chunk(
    strategy: Any,
    steps_per_execution: int,
    chunk: Chunk,
    step: Callable[..., Any],
    additions: Callable[..., Any],
    totals: PerReplica,
    before: tuple[Any, ...],
    after: tuple[Any, ...],
) -> PerReplica:
    """The running sums `totals` after the batches of `chunk`: `step(*before, totals,
    *after, *batch)` one program per batch (one step per execution, or batches of different
    shapes: padded each to its own length, as Keras' steps run them), else all in one
    program of `additions(*before, *after, batch)` (`strategy.run_steps`). A Keras metric
    sized by the data is built when the first trace meets it, before anything runs."""
    if isinstance(chunk, StackedBatches) and len(chunk) == 1:  # one step: its own program
        chunk = [tuple(chunk.first)]
    if isinstance(chunk, list) and (
        steps_per_execution == 1 or len(chunk) == 1 or not _one_shape(chunk)
    ):
        for batch in chunk:
            totals = strategy.run(step, args=(*before, totals, *after, *batch))
        return totals
    batches = iter([chunk] if isinstance(chunk, StackedBatches) else chunk)
    added = strategy.run_steps(additions, batches, steps=len(chunk), args=(*before, *after))
    return _plus_steps(totals, added)


def _one_shape(chunk: list[tuple[Any, ...]]) -> bool:
    """Whether `chunk`'s batches can share one K-step program: of one shape and dtype
    (batches padded each to its own length are not)."""
    shapes = {
        tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch, is_leaf=is_per_replica))
        for batch in chunk
    }
    return len(shapes) == 1


def _plus_steps(totals: PerReplica, additions: PerReplica) -> PerReplica:
    """Per-replica running sums plus what `run_steps`' K steps added to them."""
    return PerReplica(
        _add_steps(totals.global_value, additions.global_value),
        num_replicas=totals.num_replicas,
        stacked=True,
    )


@jax.jit
def _add_steps(totals: Any, additions: Any) -> Any:
    """Running sums (replicas × width) plus K steps' additions (replicas × K × width)."""
    return totals + jnp.sum(additions, axis=1)


@contextlib.contextmanager
def _local_parameters(model: Any) -> Iterator[None]:
    """Inside a replica's step: the model's parameters typed as differing between replicas,
    so gradients with respect to them are this replica's own, not all-reduced (`grad` of
    mirrored parameters sums over the replicas). Their mirrored values come back on exit."""
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd:
        yield
        return
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    mirrored = [v.get_raw_value() for v in params]
    for variable, value in zip(params, mirrored, strict=True):
        variable.set_raw_value(_context.as_varying(value))
    try:
        yield
    finally:
        for variable, value in zip(params, mirrored, strict=True):
            variable.set_raw_value(value)


def _rows(y_pred: Any) -> int:
    """The rows of this replica's predictions (of its first output, for a dict or tuple)."""
    return int(jax.tree.leaves(y_pred)[0].shape[0])


def _one_output(y_pred: Any, what: str) -> None:
    """Refuse a model of several outputs for a loss or metric named by Keras' names."""
    if isinstance(y_pred, dict | tuple | list):
        found = (
            f"a dict of {sorted(y_pred)}"
            if isinstance(y_pred, dict)
            else (f"a {type(y_pred).__name__} of {len(y_pred)}")
        )
        raise ValueError(
            f"{what} expected the model to return one array; found {found} outputs. Fix: "
            "pass a function of (y_true, y_pred) that picks the output, e.g. loss=lambda y, "
            "p: optax.softmax_cross_entropy_with_integer_labels(p['logits'], y), or return "
            "one array from the model."
        )


def _examples(y_pred: Any) -> Any:
    """The global batch's real examples (the same number on every replica)."""
    ctx = _context.current_replica_context()
    rows = _rows(y_pred)
    if ctx is None or not ctx.in_spmd:
        return rows
    if ctx.example_count is not None:
        return ctx.example_count
    return rows * ctx.num_replicas_in_sync if ctx.batch_is_split else rows


def _loss_terms(loss_fn: Any, y: Any, y_pred: Any, w: Any) -> tuple[Any, Any]:
    """(this replica's share of the batch's loss, the loss for the running sums): per-example
    losses averaged over the global batch's real rows; a loss that gives one number for the
    batch (Dice, a function that takes the mean itself) evaluated once on the global batch,
    times the mean sample weight (Keras broadcasts such a number to the weights). A Keras loss
    object weighs and reduces as Keras does (`KerasLoss`)."""
    if isinstance(loss_fn, _objectives.Loss):
        _one_output(y_pred, f"loss={loss_fn.name!r}")
    if isinstance(loss_fn, KerasLoss):  # Keras' own weighting and reduction
        return loss_fn.terms(y, y_pred, w)
    if getattr(loss_fn, "ignore_class", None) is not None:
        return _masked_mean_terms(loss_fn, y, y_pred, w)
    values = loss_fn(y, y_pred)
    if is_per_example(values, _rows(y_pred)):
        per_example = _objectives.per_example(values)
        return compute_average_loss(per_example, sample_weight=w), per_example

    def whole(y: Any, y_pred: Any, w: Any) -> Any:
        value = jnp.mean(jnp.asarray(loss_fn(y, y_pred), jnp.float32))
        return value if w is None else value * jnp.mean(jnp.asarray(w, jnp.float32))

    value = on_global_rows(whole, y, y_pred, w)
    ctx = _context.current_replica_context()
    if ctx is None or not ctx.in_spmd:
        return value, value
    ctx.mark_replica_aware()
    return value / ctx.num_replicas_in_sync, value


def _masked_mean_terms(loss_fn: Any, y: Any, y_pred: Any, w: Any) -> tuple[Any, Any]:
    """A loss with `ignore_class` (Keras' masked mean): the weighted sum of the counted
    labels' losses over the global batch's count of counted labels, as Keras divides by the
    valid entries (`apply_mask`). (This replica's share, the batch's loss.)"""
    losses, valid = loss_fn.masked(y, y_pred)
    mask = _context.row_mask(losses)  # a padded batch's real rows
    counted = valid if mask is None else valid * _per_row(mask.astype(jnp.float32), valid)
    weighted = counted if w is None else counted * _per_row(jnp.asarray(w, jnp.float32), valid)
    total, count = jnp.sum(losses * weighted), jnp.sum(counted)
    ctx = split_context()
    if ctx is None:
        return (share := total / jnp.maximum(count, 1.0)), share
    ctx.mark_replica_aware()
    share = total / jnp.maximum(jax.lax.psum(count, REPLICA_AXIS), 1.0)
    return share, jax.lax.psum(share, REPLICA_AXIS)


def _per_row(weights: Any, like: Any) -> Any:
    """Per-row (or per-label) weights shaped to multiply `like` (rows first): Keras' rank
    matching of weights to values."""
    return _metrics._squeeze_or_expand(like, weights)[1]


def _metric_terms(
    metric: _objectives.Metric, y: Any, y_pred: Any, real: Any, weight: Any
) -> tuple[Any, Any]:
    """A metric's additions to its running sum and its denominator on this replica: per
    example, the (weighted) sum over the real rows and their count (weight); a metric that
    gives one number for the batch (`rmse`), that number on the global batch once (Keras'
    mean over batches), or weighted by the batch's sample weights."""
    if metric.named:
        _one_output(y_pred, f"the metric {metric.name!r}")
    values = metric.values(y, y_pred)
    if is_per_example(values, _rows(y_pred)):
        values = _objectives.per_example(values).astype(jnp.float32)
        weight = real if weight is None else weight
        return jnp.sum(values * weight), jnp.sum(weight)
    value = on_global_rows(
        lambda y, p: jnp.mean(jnp.asarray(metric.values(y, p), jnp.float32)), y, y_pred
    )
    if weight is None:
        once = jnp.asarray(first_replica(), jnp.float32)
        return value * once, once
    return value * jnp.sum(weight), jnp.sum(weight)


def _float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )
