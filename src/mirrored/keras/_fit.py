"""Keras' `fit`/`evaluate`/`predict` on a strategy: Keras' own loops, mirrored's step.

Keras drives the epoch (its data adapters, callbacks, progress bar, `History`); mirrored
replaces only the compiled step, which Keras calls as `function(state, iterator)`. Each batch
is padded to the first batch's size and split over the replicas; the step runs under
`strategy.run`: losses average over the global batch's real rows, metrics count real rows
only and are summed over replicas inside the step, gradients of the mirrored weights are
summed over replicas, and `predict` returns exactly the real rows, in order.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.trainers.data_adapters import data_adapter_utils

from mirrored._core import context as _context
from mirrored._core import settings as config
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._core.values import StackedBatches
from mirrored._data import chunks as _chunks
from mirrored._data import input as _input
from mirrored._data.prefetch import Prefetcher
from mirrored._run.array_step import Direct
from mirrored._run.state_rules import summed_over_replicas
from mirrored._train import objectives as _objectives
from mirrored.keras import _bridge, _patches

logger = logging.getLogger("mirrored")


class _Placer:
    """Keras' host batches as split, padded, masked batches on the strategy's devices."""

    def __init__(self, strategy: Any) -> None:
        self._n = strategy.num_replicas_in_sync
        self._processes = _input.process_info(strategy)
        self._dataset = _input.DistributedDataset(
            strategy,
            lambda epoch: iter(()),
            length=None,
            options=_input.InputOptions(experimental_fetch_to_device=False),
        )
        self._target: int | None = None
        # A full batch of NumPy arrays in one process, the common case, placed without
        # re-deriving what the first such batch established: its structure, mask and count.
        self._full: tuple[Any, Any, Any] | None = None  # (treedef, mask, count)
        self._stacked_masks: dict[Any, Any] = {}  # K batches' masks and counts, by their rows

    def __call__(self, batch: Any) -> Any:
        full, target = self._full, self._target
        if full is not None and target is not None:
            leaves, treedef = jax.tree.flatten(batch)
            if treedef == full[0] and all(
                type(x) is np.ndarray and x.shape[:1] == (target,) for x in leaves
            ):
                placed = self._dataset._to_devices(leaves, target)
                return self._dataset._per_replica(treedef, placed, full[1], full[2])
        host = self._host(batch)
        placed = self._dataset._place(host)
        if host.real == host.size and self._processes[0] == 1:
            leaf = jax.tree.leaves(placed)[0]
            self._full = (jax.tree.structure(batch), leaf._mask, leaf._count)
        return placed

    def _host(self, batch: Any) -> _input.HostBatch:
        target = self._target
        # A first batch of fewer rows than replicas (predict on 5 examples of a fresh model):
        # padded to one row per replica, without fixing the later batches' size by it.
        leaves = jax.tree.leaves(batch)
        small = target is None and bool(leaves) and 0 < np.shape(leaves[0])[0] < self._n
        host = _input.host_batch(
            batch, self._n if small else target, num_replicas=self._n, processes=self._processes
        )
        if self._target is None and not small:
            self._target = host.size
        return host

    def chunk(self, batches: list[Any]) -> StackedBatches | list[Any]:
        """Keras' next K host batches for one program: in one process, NumPy arrays of one
        shape and dtype, stacked into one aligned block per leaf and device and placed in one
        transfer (`chunks.place_batches`); else each placed as it comes (run as K steps of
        one program when their shapes agree, one by one when not)."""
        if len(batches) < 2 or self._processes[0] != 1:
            return [self(b) for b in batches]
        hosts = [self._host(b) for b in batches]
        first = hosts[0]
        if _nbytes([h.leaves for h in hosts]) <= _chunks.CHUNK_BYTES and all(
            h.treedef == first.treedef
            and h.size == first.size
            and all(
                type(x) is np.ndarray and x.shape == f.shape and x.dtype == f.dtype
                for x, f in zip(h.leaves, first.leaves, strict=True)
            )
            for h in hosts
        ):
            stacked = _chunks.place_batches(self._dataset._strategy, self._stacked_masks, hosts)
            # One argument of the step (Keras' batch), not one per element of its tuple.
            return StackedBatches(
                stacked.treedef, stacked.leaves, stacked.mask, stacked.count, (stacked.first,)
            )
        return [self._dataset._place(h) for h in hosts]


def _rows(x: Any) -> tuple[Any, Any]:
    """This replica's real rows in the batch being traced (varying by construction, so that
    additions of them psum to the global ones), and the global batch's real rows."""
    ctx = _context.current_replica_context()  # `verify` runs the step on 1 device too
    assert ctx is not None
    mask = ctx.example_mask
    if mask is None:
        first = next(i for i in jax.tree.leaves(x) if i is not None)
        rows = jnp.asarray(first.shape[0], jnp.float32)
        total_rows = rows * ctx.num_replicas_in_sync
    else:
        rows, total_rows = jnp.sum(mask), ctx.example_count
    return jnp.asarray(rows, jnp.float32) + 0 * jax.lax.axis_index(REPLICA_AXIS), total_rows


@contextlib.contextmanager
def _fit_loss(model: Any, rows: Any, total_rows: Any) -> Iterator[None]:
    """While `fit`'s step computes the loss: `_patches.whole_loss` on a split batch (nothing on
    an unsplit one, `verify`'s one device), and a multi-output model's per-output loss
    trackers (`cls_loss`, ...) kept as the loss tracker is.

    Keras adds each output's loss times `y_pred.shape[0]` (under TensorFlow the replica's
    share times N, `unscale_loss_for_distribution`), which here would count the padded rows.
    Inside `whole_loss` each output's loss is N times the replica's share: the trackers get
    the share (`_track_loss`: times the global real rows, and the real rows)."""
    ctx = _patches.split_context()
    n = 1 if ctx is None else ctx.num_replicas_in_sync
    compile_loss = getattr(model, "_compile_loss", None)
    trackers = [m for m in getattr(compile_loss, "metrics", None) or [] if m is not None]
    with contextlib.ExitStack() as stack:
        if ctx is not None:
            stack.enter_context(_patches.whole_loss(model, ctx))
        for tracker in trackers:

            def update_state(
                values: Any, sample_weight: Any = None, *, tracker: Any = tracker
            ) -> None:
                del sample_weight  # y_pred.shape[0]: the padded rows
                _track_loss(tracker, values / n, rows, total_rows)

            stack.enter_context(_context.instance_attribute(tracker, "update_state", update_state))
        yield


class _Step:
    """One Keras step (`train`, `test` or `predict`) under `strategy.run`."""

    def __init__(self, model: Any, strategy: Any, kind: str) -> None:
        self.model = model
        self.strategy = strategy
        self.kind = kind
        self.__name__ = f"keras_{kind}_step"
        groups = [model.trainable_variables, model.non_trainable_variables]
        if kind == "train":
            groups.append(model.optimizer.variables)
        if kind != "predict":
            groups.append(model.metrics_variables)
        self.sizes = [len(g) for g in groups]
        variables = [v for g in groups for v in g]
        objects = [model, *([model.optimizer] if kind == "train" else [])]
        kinds = _bridge.slot_kinds(objects, variables, sums=False)
        self.bridge = _bridge.Bridge(variables, kinds)
        self.seeds = [i for i, k in enumerate(kinds) if k is _bridge.SeedSlot]
        self.place = _Placer(strategy)
        self.direct: Direct | None = None  # after a first step through the runner

    # -- on the host, per batch -----------------------------------------------------------------

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step on a batch already placed (`self.place`) on the devices."""
        flat = [x for group in state for x in group]
        done = None if self.direct is None or self.model.run_eagerly else self.direct(flat, batch)
        if done is not None:  # the arrays the last step returned: no Variables in between
            outputs, values = done
        else:
            outputs, values = self._full(flat, batch)
        return outputs, self.grouped(values)

    def grouped(self, values: list[Any]) -> tuple[list[Any], ...]:
        """The step's values (the variables' order) as Keras' state groups."""
        starts = list(itertools.accumulate(self.sizes, initial=0))
        return tuple(values[a:b] for a, b in itertools.pairwise(starts))

    def execution(self, state: Any, batches: StackedBatches | list[Any]) -> tuple[Any, Any]:
        """Keras' K steps of one execution (`compile(steps_per_execution=K)`, `_Placer.chunk`'s
        batches) in one program: the last step's logs and the state after it, what Keras'
        loop of K calls returns. Batches of different structures or shapes, or K over
        `chunks.CHUNK_BYTES` together, run one by one, as Keras runs them."""
        if isinstance(batches, StackedBatches):
            return self._steps(state, batches)
        kinds = {
            (jax.tree.structure(b), tuple((x.shape, x.dtype) for x in jax.tree.leaves(b)))
            for b in batches
        }
        if len(batches) > 1 and len(kinds) == 1 and _nbytes(batches) <= _chunks.CHUNK_BYTES:
            return self._steps(state, [(batch,) for batch in batches])
        outputs = None
        for batch in batches:
            outputs, state = self(state, batch)
        return outputs, state

    def _steps(self, state: Any, batches: StackedBatches | list[Any]) -> tuple[Any, Any]:
        flat = [x for group in state for x in group]
        runner = self.strategy._step_runner()
        self.bridge.pull(flat)
        outputs = runner.call_steps(self.traced, (self.bridge.holder,), {}, batches)
        values = self.bridge.values()
        return _last(outputs), self.grouped(values)

    def _full(self, flat: list[Any], batch: Any) -> tuple[Any, list[Any]]:
        runner = self.strategy._step_runner()
        self.bridge.pull(flat)
        # The runner's own call: this step's Keras state is explicit already (no bridge).
        # compile(run_eagerly=True): the step op by op, as mirrored.config's eager mode.
        with config.eager_within(bool(self.model.run_eagerly)):
            outputs = runner.call(self.traced, (self.bridge.holder, batch), {})
        if self.kind == "predict":
            outputs = jax.tree.map(lambda x: self.strategy.gather(x, axis=0), outputs)
        values = self.bridge.values()
        if self.kind != "predict":
            self.direct = runner.direct(self.traced, self.bridge.slots)
            if self.direct is not None:
                self.direct.returned(values)
        return outputs, values

    # -- traced, per replica --------------------------------------------------------------------

    def traced(self, holder: _bridge.Holder, batch: Any) -> Any:
        slots = list(holder.slots)
        values = _bridge.fold_seeds([s.get_raw_value() for s in slots], self.seeds)
        groups = self.grouped(values)
        model = self.model
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(batch)
        if self.kind == "predict":
            kwargs = {"training": False} if model._call_has_training_arg else {}
            outputs, new_non_trainable = model.stateless_call(groups[0], groups[1], x, **kwargs)
            new = [*groups[0], *new_non_trainable]
            self._write(slots, values, new)
            return outputs
        rows, total_rows = _rows(x)
        if self.kind == "train":
            trainable, non_trainable, optimizer_vars, metric_vars = groups
            grad_fn = jax.value_and_grad(model.compute_loss_and_updates, has_aux=True)
            with _fit_loss(model, rows, total_rows):
                (_, aux), grads = grad_fn(
                    trainable,
                    non_trainable,
                    metric_vars,
                    x,
                    y,
                    sample_weight,
                    training=True,
                    optimizer_variables=optimizer_vars,
                )
            loss, y_pred, non_trainable, metric_vars = aux
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, grads, trainable
            )
            new = [*trainable, *non_trainable, *optimizer_vars]
        else:
            trainable, non_trainable, metric_vars = groups
            with _fit_loss(model, rows, total_rows):
                loss, aux = model.compute_loss_and_updates(
                    trainable, non_trainable, metric_vars, x, y, sample_weight, training=False
                )
            _, y_pred, non_trainable, metric_vars = aux
            new = [*trainable, *non_trainable]
        logs, metric_vars = self._metrics(
            groups[-1], metric_vars, loss, (rows, total_rows), x, y, y_pred, sample_weight
        )
        self._write(slots, values, [*new, *metric_vars])
        return logs

    def _metrics(
        self,
        original: list[Any],
        before: list[Any],
        loss: Any,
        counts: tuple[Any, Any],
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
    ) -> tuple[Any, list[Any]]:
        """Update the metrics with this replica's real rows; sum the updates over replicas
        (`original`: the values before the step, `before`: after the loss's own trackers;
        `counts`: this replica's real rows and the global batch's, from `_rows`)."""
        model = self.model
        references = model.metrics_variables
        ctx = _context.current_replica_context()
        assert ctx is not None
        rows, total_rows = counts
        with StatelessScope(state_mapping=list(zip(references, before, strict=True))) as scope:
            _track_loss(model._loss_tracker, loss, rows, total_rows)
            model.compute_metrics(x, y, y_pred, sample_weight)
        combined = []
        for ref, old, current in zip(references, original, before, strict=True):
            new = scope.get_current_value(ref)
            if new is None:
                new = current
            if new is old:
                combined.append(old)
                continue
            combined.append(summed_over_replicas(old, new, ctx.num_replicas_in_sync))
        with StatelessScope(state_mapping=list(zip(references, combined, strict=True))):
            logs = model.get_metrics_result()
        return logs, combined

    def _write(self, slots: list[Any], before: list[Any], after: list[Any]) -> None:
        for i, (slot, old, new) in enumerate(zip(slots, before, after, strict=True)):
            if new is old:
                continue
            if i in self.seeds:
                new = _bridge.mirrored_seed(new)
            slot.set_raw_value(jnp.asarray(new, dtype=old.dtype))


def _nbytes(tree: Any) -> int:
    """Bytes of the arrays in `tree` (host or placed)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _executions(place: _Placer, iterator: Iterator[Any], k: int) -> Iterator[Any]:
    """Keras' batches K at a time (fewer at the end), as its loop takes them per execution."""
    while batches := list(itertools.islice(iterator, k)):
        yield place.chunk(batches)


@jax.jit
def _last(outputs: Any) -> Any:
    """The last step's entry of each of K steps' stacked outputs."""
    return jax.tree.map(lambda x: x[-1], outputs)


def _reattach(step: _Step, state: Any) -> None:
    """After a failed step: the state it was given back in the model's variables. Keras' loops
    detach them (`_purge_model_variables`) and reattach them only when the epoch ends, so an
    error in a step (a shape Keras' symbolic build let through, say) left a model whose every
    variable read raised `'NoneType' object is not callable`. A value the step consumed
    (donated to its program) is replaced by what the runner last wrote in its place: with
    `check_numerics`, the state from before the step that was not finite."""
    model = step.model
    groups, written = step.grouped(step.bridge.variables), step.grouped(step.bridge.values())
    for variables, values, last_written in zip(groups, state, written, strict=False):
        for v, value, last in zip(variables, values, last_written, strict=False):
            for candidate in (value, last):
                deleted = isinstance(candidate, jax.Array) and candidate.is_deleted()
                if v._value is None and not deleted:
                    v._value = candidate
    model._jax_state = None
    model._jax_state_synced = True


def _track_loss(tracker: Any, share: Any, rows: Any, total_rows: Any) -> None:
    """Keras' loss tracker after this replica's rows: as on one device, `total` gains the batch
    mean loss times the batch's real rows and `count` the rows. A replica holds its share of
    the mean (its losses over the global rows), so its additions are `share * total_rows` and
    `rows`: summed over replicas they are the global ones. Nothing here waits for the other
    replicas, so XLA sends these sums in the gradients' all-reduce (one per step, measured)
    instead of a second one after it. A tracker that is not Keras' own `Mean` gets the
    global loss, summed first, through its class's `update_state` (not the instance's, which
    `_fit_loss` replaces with this function)."""
    import keras

    if type(tracker) is keras.metrics.Mean:
        dtype = tracker.total.dtype
        tracker.total.assign_add(jnp.asarray(share, dtype) * jnp.asarray(total_rows, dtype))
        tracker.count.assign_add(jnp.asarray(rows, tracker.count.dtype))
    else:
        type(tracker).update_state(tracker, jax.lax.psum(share, REPLICA_AXIS), sample_weight=rows)


_CROSSENTROPY_NAMES = frozenset(
    {"sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy"}
)


def logits_trap(model: Any) -> str | None:
    """Keras' silent trap, read from the model: a crossentropy loss with `from_logits=False`
    (Keras' default) after a last layer with no activation, which outputs logits."""
    import keras

    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        name, from_logits = loss, loss not in _CROSSENTROPY_NAMES
    elif isinstance(
        loss,
        keras.losses.SparseCategoricalCrossentropy
        | keras.losses.CategoricalCrossentropy
        | keras.losses.BinaryCrossentropy,
    ):
        name, from_logits = type(loss).__name__, bool(loss.from_logits)
    else:
        return None
    layers = getattr(model, "layers", None)
    if from_logits or not layers or len(getattr(model, "outputs", None) or [None]) != 1:
        return None
    last = layers[-1]
    if getattr(last, "activation", None) is not keras.activations.linear:
        return None
    return _objectives.from_logits_warning(
        name, f"the model's last layer {last.name!r} has no activation: it outputs logits"
    )


# The dicts Keras' JAX loops assign to `model._jax_state` after every step.
_LOOP_STATE_KEYS = frozenset(
    {"trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables"}
)


def _untracked_loop_state(model: Any) -> None:
    """Keras' epoch loops set `model._jax_state = {...: [arrays]}` after every step, and the
    layer's attribute tracker walks it (wrapping each list, testing each array for a Variable,
    Layer, Metric or SeedGenerator), though arrays are never any of them: measured about 1% of a
    step of the seed MLP. Here a plain dict with only those keys passes untouched (a user's own
    attribute shaped like it would too); everything else is tracked as before."""
    tracker = getattr(model, "_tracker", None)
    if tracker is None or getattr(tracker, "_mirrored_loop_state", False):
        return
    track = tracker.track

    def track_all_but_loop_state(attr: Any) -> Any:
        if type(attr) is dict and attr.keys() <= _LOOP_STATE_KEYS:
            return attr
        return track(attr)

    tracker.track = track_all_but_loop_state
    tracker._mirrored_loop_state = True


def _refuse_overridden_step(model: Any, kind: str) -> None:
    """mirrored's step replaces Keras' `train_step` / `test_step` / `predict_step`: a model
    that overrides one would silently not run its own."""
    from keras.src.backend.jax.trainer import JAXTrainer

    name = f"{kind}_step"
    if getattr(type(model), name) is getattr(JAXTrainer, name):
        return
    owner = next(c for c in type(model).__mro__ if name in vars(c))
    raise NotImplementedError(
        f"Expected a model that leaves Keras' {name} as it is under a mirrored strategy; found "
        f"{owner.__name__}.{name}, which mirrored's step (split over the replicas, losses over "
        "the global batch) would not call: your step would silently not run. Fix: move the "
        "loss into an override of compute_loss (and metrics into compute_metrics), which "
        "mirrored's step calls; or run your step's body in a custom loop with strategy.run "
        "and mirrored.keras.value_and_grad (docs/keras.md)."
    )


def make_function(model: Any, strategy: Any, kind: str) -> Callable[[Any, Iterator[Any]], Any]:
    """Keras' `train_function` / `test_function` / `predict_function` for `model` on `strategy`."""
    _refuse_overridden_step(model, kind)
    if kind == "train" and (warning := logits_trap(model)):
        logger.warning(warning)
    step = _Step(model, strategy, kind)
    _untracked_loop_state(model)
    keras_step = model._make_function(step, concatenate_outputs=kind == "predict")
    # Keras hands the same iterator every call of an epoch: on accelerators its batches are
    # split and placed one or two ahead, on a background thread, while the devices compute.
    # Not on CPU (measured: 0.87× on 2 cores; Keras skips its look-ahead there too), nor
    # across processes (placed in order on the calling thread, as distributed datasets are).
    prefetch = _input.process_info(strategy)[0] == 1 and jax.default_backend() != "cpu"
    current: list[Any] = [None, None, False]  # Keras' iterator, its placed batches, fused

    def function(state: Any, iterator: Iterator[Any]) -> Any:
        if current[0] is not iterator:
            if isinstance(current[1], Prefetcher):
                current[1].close()
            # compile(steps_per_execution=K): Keras' K calls of the step become one program
            # of K steps (Keras' JAX loop dispatches each; train and test, not predict).
            k = int(model.steps_per_execution)
            fused = kind != "predict" and k > 1 and not model.run_eagerly
            placed: Iterator[Any] = (
                _executions(step.place, iterator, k) if fused else map(step.place, iterator)
            )
            # Two batches ahead, or one execution (K batches) ahead.
            ahead = Prefetcher(placed, 1 if fused else 2) if prefetch else placed
            current[:] = [iterator, ahead, fused]
        try:
            if current[2]:
                return step.execution(state, next(current[1]))  # StopIteration: epoch's end
            return keras_step(state, current[1])
        except BaseException:
            _reattach(step, state)
            raise

    function.mirrored = strategy  # type: ignore[attr-defined]
    return function
