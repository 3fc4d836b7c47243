"""How metric state combines across replicas: `MetricState` sums (TensorFlow's SYNC_ON_READ
SUM), and Flax's own `nnx.metrics` inside `strategy.run` (sums added across replicas, padded rows
masked, updates that are not sums refused)."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import patching

_METRIC_UPDATE = patching.target(
    "flax.nnx.metrics.Metric",
    "update",
    reason="(on each metric class in a step) padded rows masked, additions summed over replicas",
    checked="flax 0.12.8",
)

logger = logging.getLogger("mirrored.metrics")


class MetricState(nnx.Variable):  # type: ignore[type-arg]
    """A metric's running sum: replicas add their own rows, and the additions are summed.

    `strategy.run` writes back `old + Σ_replicas (new_r - old)`, so only additive state
    (sums, counts, confusion matrices) belongs here.
    """


def row_mask(values: Any) -> Any:
    """This replica's real-row mask (float) when `values` has one row per example, else None."""
    mask = _context.row_mask(values)
    return None if mask is None else mask.astype(jnp.float32)


# -- Flax's nnx.metrics inside strategy.run -------------------------------------------------------


def warn_if_a_loss_share(metric: str, values: Any) -> None:
    """Warn when a mean metric counts one scalar per replica in a step that called
    `compute_average_loss`: that scalar is most likely this replica's share of the batch loss
    (÷ the global batch), and the mean of N replicas' shares is loss / N."""
    ctx = _context.current_replica_context()
    if (
        ctx is None
        or not ctx.in_spmd
        or not ctx.warnings
        or not ctx.loss_shared
        or ctx.num_replicas_in_sync == 1
        or getattr(values, "ndim", None) != 0
        or not _context.is_varying(values)
    ):
        return
    n = ctx.num_replicas_in_sync
    logger.warning(
        "%s was updated with one scalar per replica in a step that calls "
        "compute_average_loss. If that scalar is the loss, it is this replica's share of the "
        "batch loss (divided by the GLOBAL batch), and the metric averages %d replicas' "
        "shares: it reports the loss / %d. Fix: give the metric the per-example losses "
        "(e.g. metrics.update(loss=per_example_loss, ...)), which count every real row once; "
        "or strategy.reduce('SUM', loss) outside the step for the batch loss. (A per-replica "
        "mean that is not a share averages correctly; then ignore this.)",
        metric,
        n,
        n,
    )


_flax_average_update = nnx.metrics.Average.update


def _flax_average(self: Any, mask: Any = None, **kwargs: Any) -> None:
    """`nnx.metrics.Average.update` under `run`: a padded batch's rows masked out, and a warning
    for one scalar per replica that is a share of the loss."""
    values = kwargs.get(self.argname)
    if isinstance(values, jax.Array | np.ndarray):
        warn_if_a_loss_share(f"nnx.metrics.{type(self).__name__}({self.argname!r})", values)
        rows = row_mask(jnp.asarray(values))
        if rows is not None:
            rows = jnp.broadcast_to(
                rows.reshape(rows.shape + (1,) * (values.ndim - 1)), values.shape
            )
            mask = rows.astype(bool) if mask is None else jnp.logical_and(mask, rows.astype(bool))
    _flax_average_update(self, mask=mask, **kwargs)


def summable_flax_states(tree: Any) -> set[int]:
    """Ids of the `MetricState`s of Flax `Average` metrics (and `Accuracy`) in `tree`: sums.

    They combine across replicas as `mirrored.metrics` do. Other Flax metrics are checked when
    their `update` runs (`flax_metric_updates`).
    """
    found: set[int] = set()
    for node in flax_metrics(tree):
        if isinstance(node, nnx.metrics.Average):
            found.update((id(node.total), id(node.count)))
    return found


def flax_metrics(tree: Any) -> Iterator[Any]:
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Pytree)):
        if isinstance(leaf, nnx.Pytree):
            for _, node in nnx.iter_graph(leaf):
                if isinstance(node, nnx.metrics.Metric):
                    yield node


def flax_metric_classes(tree: Any) -> set[type]:
    """The Flax metric classes whose `update` `run` watches while it traces a step on `tree`:
    `Average` (masking a padded batch) and each class defining `update` of the other metrics."""
    found: set[type] = set()
    for node in flax_metrics(tree):
        found.add(nnx.metrics.Average)
        if isinstance(node, nnx.metrics.Average | nnx.metrics.MultiMetric):
            continue
        owner = next(c for c in type(node).__mro__ if "update" in c.__dict__)
        if owner is not nnx.metrics.Metric:
            found.add(owner)
    return found


# Primitives that pass a value on unchanged but for its dtype or its replica-varying type.
_CASTS = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "pcast"})


def adds_to_its_state(update: Callable[..., None], metric: Any, args: Any, kwargs: Any) -> bool:
    """Whether `update(metric, ...)` only adds to the metric's state: every new value is
    `old + f(batch)` with `f` independent of the state (Flax's `Average`: `total += sum`).

    Read from the update's jaxpr, so a running mean (Welford's: `mean + (x - mean) / n`) is
    not taken for a sum."""
    graphdef, state = nnx.split(metric)
    leaves, treedef = jax.tree.flatten(state)

    def new_state(leaves: list[Any]) -> list[Any]:
        clone = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        update(clone, *args, **kwargs)
        return jax.tree.leaves(nnx.state(clone))

    jaxpr = jax.make_jaxpr(new_state)(leaves).jaxpr
    inputs = set(jaxpr.invars)
    made_by: dict[Any, Any] = {}
    reads_state: dict[Any, bool] = {}

    def reads(v: Any) -> bool:
        return not isinstance(v, jax.extend.core.Literal) and (
            v in inputs or reads_state.get(v, False)
        )

    for eqn in jaxpr.eqns:
        flag = any(reads(v) for v in eqn.invars)
        for out in eqn.outvars:
            made_by[out], reads_state[out] = eqn, flag

    def source(v: Any) -> Any:  # through dtype conversions and copies
        while v in made_by and made_by[v].primitive.name in _CASTS:
            v = made_by[v].invars[0]
        return v

    for old, new in zip(jaxpr.invars, jaxpr.outvars, strict=True):
        new = source(new)
        if new is old:
            continue
        eqn = made_by.get(new)
        if eqn is None or eqn.primitive.name != "add":
            return False
        a, b = eqn.invars
        if not ((source(a) is old and not reads(b)) or (source(b) is old and not reads(a))):
            return False
    return True


@contextlib.contextmanager
def flax_metric_updates(classes: set[type]) -> Iterator[None]:
    """While `run` traces a step: Flax's `Average`/`Accuracy` skip a padded batch's rows, and
    any other Flax metric (of `classes`) whose `update` only adds to its state has its state
    ids put in the replica context's `summed_states`, so its replicas' additions are summed
    as `Average`'s are.

    Such a metric cannot be told which arguments have a row per example, so on a padded
    batch it warns that the padded rows count. One that does not add (Welford's running
    mean) is left alone, and `run` refuses the state it leaves differing between replicas."""
    with contextlib.ExitStack() as patches:
        for owner in classes:
            if owner is nnx.metrics.Average:
                replacement = _flax_average
            else:
                replacement = _checked_update(owner.__dict__["update"])
            patches.enter_context(patching.temporarily(_METRIC_UPDATE, replacement, owner=owner))
        yield


_warned_padded: set[str] = set()


def _warn_padded(metric: str, padded: Any) -> None:
    if metric in _warned_padded:
        return
    _warned_padded.add(metric)
    logger.warning(
        "%s.update ran on a padded batch (a ragged last batch, padded to the full shape "
        "with %d rows). mirrored cannot tell which of its arguments hold one row "
        "per example, so the padded rows (copies of real rows) are counted in it. Fix: build "
        "it on nnx.metrics.Average (whose per-example values mirrored masks), or subclass "
        "mirrored.metrics.Metric and weight rows with self.weights(values); or drop the "
        "ragged batch.",
        metric,
        int(padded),
    )


def _warn_when_padded(metric: str, ctx: Any) -> None:
    """At run time, once: a batch with padded rows reached a metric that cannot mask them
    (a step of a dataset is traced once for full and ragged batches alike)."""
    rows = ctx.example_mask.shape[0] * ctx.num_replicas_in_sync
    padded = rows - jnp.asarray(ctx.example_count, jnp.int32)
    jax.lax.cond(
        padded > 0,
        lambda p: jax.debug.callback(functools.partial(_warn_padded, metric), p),
        lambda p: None,
        padded,
    )


def _checked_update(original: Callable[..., None]) -> Callable[..., None]:
    def update(self: Any, *args: Any, **kwargs: Any) -> None:
        ctx = _context.current_replica_context()
        if ctx is None or not ctx.in_spmd:
            return original(self, *args, **kwargs)
        states = {id(v) for _, v in nnx.iter_graph(self) if isinstance(v, nnx.Variable)}
        if not adds_to_its_state(original, self, args, kwargs):
            ctx.not_summed_states.update(states)  # every update of a step must be a sum
        else:
            ctx.summed_states.update(states)
            if ctx.example_mask is not None:
                _warn_when_padded(type(self).__name__, ctx)
        return original(self, *args, **kwargs)

    return update
