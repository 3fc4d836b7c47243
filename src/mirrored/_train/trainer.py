"""`Trainer`: Keras' compile/fit/evaluate/predict on a strategy, exact by construction."""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import settings as config
from mirrored._core.values import PerReplica, is_per_replica, to_host
from mirrored._data import batching as _batching
from mirrored._data.input import DistributedDataset, source_length
from mirrored._optim import learning_rate as _learning_rate
from mirrored._optim.mixed_precision import LossScaleOptimizer, Policy, global_policy
from mirrored._persist import checkpoint as _checkpoint
from mirrored._proof import profile as _profile
from mirrored._run.errors import peer_failures
from mirrored._strategy.losses import compute_average_loss, weighted_losses
from mirrored._strategy.strategy import Strategy, get_strategy
from mirrored._train import objectives as _objectives
from mirrored._train.callbacks.base import Callback, History
from mirrored._train.callbacks.callback_list import CallbackList

logger = logging.getLogger("mirrored")


def _make_steps(
    loss_fn: Any,
    metrics: Sequence[_objectives.Metric],
    weighted_metrics: Sequence[_objectives.Metric] = (),
    stateful_weighted: Sequence[bool] = (),
) -> tuple[Callable[..., Any], ...]:
    """The per-replica train, eval and predict steps. They close over configuration only.

    Metrics that are means over examples are running sums in `totals`; other metrics
    (`mirrored.metrics.Precision`, `AUC`, your own) come as `stateful`, a tuple of metric
    modules passed as state, updated with the weights when `stateful_weighted` says so.
    """

    def update_stateful(stateful: Any, y: Any, y_pred: Any, w: Any) -> None:
        for metric, weighted in zip(stateful, stateful_weighted, strict=True):
            metric.update_state(y, y_pred, sample_weight=w if weighted else None)

    def accumulate(totals: Any, per_example: Any, y: Any, y_pred: Any, w: Any) -> Any:
        # Each replica keeps its own running sums (loss, metrics..., weighted metrics...,
        # count, weight sum), like TensorFlow's SYNC_ON_READ variables: no collective per step;
        # they are summed when read. As in Keras, the loss is weighted by sample_weight and
        # divided by the example count; `metrics` ignore the weights and `weighted_metrics`
        # divide by the weights' sum.
        ctx = _context.current_replica_context()
        assert ctx is not None
        ones = per_example * 0 + 1  # replica-local, like the examples themselves
        real = ones if ctx.example_mask is None else ones * ctx.example_mask
        real = real.astype(jnp.float32)
        weight = real if w is None else weighted_losses(real, w)
        loss = per_example.astype(jnp.float32)
        local = [jnp.sum(loss * weight)]
        local += [jnp.sum(_values(m, y, y_pred) * real) for m in metrics]
        local += [jnp.sum(_values(m, y, y_pred) * weight) for m in weighted_metrics]
        return totals + jnp.stack([*local, jnp.sum(real), jnp.sum(weight)])

    def train_step(
        model: Any,
        optimizer: Any,
        totals: Any,
        stateful: Any,
        rngs: Any,
        x: Any,
        y: Any,
        w: Any = None,
    ) -> Any:
        # The call-time random stream goes through the gradient as an argument (not a
        # capture), so the draws it makes inside are written back.
        def loss_of(model: Any, rngs: Any) -> Any:
            # Losses in float32 whatever the compute dtype; call-time randomness if given.
            y_pred = _float32(model(x) if rngs is None else model(x, rngs=rngs))
            per_example = _objectives.per_example(loss_fn(y, y_pred))
            return compute_average_loss(per_example, sample_weight=w), (y_pred, per_example)

        scaled = isinstance(optimizer, LossScaleOptimizer)
        if scaled:  # float16: scale the loss up, the gradients back down, skip non-finite steps

            def scaled_loss_of(model: Any, rngs: Any) -> Any:
                loss, aux = loss_of(model, rngs)
                return optimizer.get_scaled_loss(loss), aux

            (_, (y_pred, per_example)), grads = nnx.value_and_grad(scaled_loss_of, has_aux=True)(
                model, rngs
            )
            optimizer.apply(model, optimizer.get_unscaled_gradients(grads))
        else:
            value_and_grad = nnx.value_and_grad(loss_of, has_aux=True)
            (_, (y_pred, per_example)), grads = value_and_grad(model, rngs)
            optimizer.update(model, grads)
        update_stateful(stateful, y, y_pred, w)
        return accumulate(totals, per_example, y, y_pred, w)

    def eval_step(model: Any, totals: Any, stateful: Any, x: Any, y: Any, w: Any = None) -> Any:
        y_pred = _float32(model(x))
        update_stateful(stateful, y, y_pred, w)
        return accumulate(totals, _objectives.per_example(loss_fn(y, y_pred)), y, y_pred, w)

    def predict_step(model: Any, x: Any) -> Any:
        return model(x)

    return train_step, eval_step, predict_step


def _additions(train_step: Callable[..., Any], width: int) -> Callable[..., Any]:
    """The training step for `run_steps`: what one step adds to the running sums (they are
    summed over the K steps on the devices afterwards, `_add_steps`)."""

    def train_additions(model: Any, optimizer: Any, stateful: Any, rngs: Any, *batch: Any) -> Any:
        zeros = jnp.zeros((width,), jnp.float32)
        return train_step(model, optimizer, zeros, stateful, rngs, *batch)

    return train_additions


def _eval_additions(eval_step: Callable[..., Any], width: int) -> Callable[..., Any]:
    """The evaluation step for `run_steps`: what one step adds to the running sums."""

    def eval_additions(model: Any, stateful: Any, *batch: Any) -> Any:
        return eval_step(model, jnp.zeros((width,), jnp.float32), stateful, *batch)

    return eval_additions


def _gathering(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step(*head, *batch)` as `(*head, data, index)`: the batch is `data`'s rows `index`,
    gathered on this replica's device (the data is mirrored on every device)."""

    def gathered(*args: Any) -> Any:
        *head, data, index = args
        batch = jax.tree.map(lambda a: jnp.take(a, index, axis=0), data)
        return step(*head, *batch)

    gathered.__name__ = getattr(step, "__name__", "train_step")
    return gathered


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


def _values(metric: _objectives.Metric, y: Any, y_pred: Any) -> Any:
    return _objectives.per_example(metric.values(y, y_pred)).astype(jnp.float32)


def _float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
    )


class _Logs(Mapping[str, float]):
    """Epoch-so-far logs, read from the devices only when a callback looks at them."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read
        self._values: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._values is None:
            self._values = self._read()
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _is_arrays(x: Any) -> bool:
    if isinstance(x, np.ndarray | jax.Array):
        return True
    if isinstance(x, dict):
        return all(isinstance(v, np.ndarray | jax.Array) for v in jax.tree.leaves(x))
    return False


def _placed_batches(x: Any) -> bool:
    """A list of batches already distributed (their leaves are PerReplica values)."""
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(v, PerReplica) for v in jax.tree.leaves(x[0], is_leaf=is_per_replica))
    )


class _Placed:
    """Batches the caller already distributed: every epoch replays them in order."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches

    def __len__(self) -> int:
        return len(self._batches)

    def epoch_iterator(self, epoch: int, *, skip: int = 0) -> Iterator[Any]:
        del epoch
        return iter(self._batches[skip:])


def _batch_args(batch: Any) -> tuple[Any, ...]:
    if not isinstance(batch, tuple | list) or not 1 <= len(batch) <= 3:
        raise ValueError(
            "Expected the dataset to yield (x, y) or (x, y, sample_weight) tuples; found a "
            f"{type(batch).__name__}. Fix: yield tuples, e.g. map each element to (x, y)."
        )
    return tuple(batch)


def _eager_when_asked(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` with its steps run eagerly when the trainer's `run_eagerly` is set."""

    @functools.wraps(method)
    def wrapped(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        with config.eager_within(self.run_eagerly):
            return method(self, *args, **kwargs)

    return wrapped


class Trainer:
    """Keras-style training on a strategy: `fit`, `evaluate`, `predict`.

    Create it inside `strategy.scope()` (with the model); the optimizer state is created there.

    Args:
        model: an NNX module called as `model(x)` (`model(x, rngs=rngs)` in `fit` when `rngs`
            is given).
        optimizer: an Optax transformation, or an `nnx.Optimizer` made in the scope.
        loss: a Keras loss name (`"sparse_categorical_crossentropy"`,
            `"categorical_crossentropy"`, `"binary_crossentropy"`, `"mse"`, `"mae"`), a
            `mirrored.losses.Loss` (e.g. `SparseCategoricalCrossentropy(from_logits=True)`), or a
            callable `(y_true, y_pred)` returning one loss per example.
        metrics: names (`"accuracy"`, `"sparse_categorical_accuracy"`, `"mse"`, `"mae"`) or
            callables `(y_true, y_pred)` returning one value per example. As in Keras, they
            ignore `sample_weight`.
        weighted_metrics: metrics weighted by `sample_weight` (Keras' `weighted_metrics`):
            the weighted sum divided by the sum of the weights.
        from_logits: for loss names: whether the model outputs logits (Keras' default: False).
        policy: a `mirrored.mixed_precision` policy (default: the global one); applied to the
            model, and `"mixed_float16"` adds dynamic loss scaling.
        global_clipnorm: clip the (replica-summed) gradient to this global norm.
        gradient_accumulation_steps: apply one update per this many batches, with the mean of
            their mean gradients (Keras' and `optax.MultiSteps`' rule: one step on a k-times
            larger batch when the batches are full; a ragged one weighs as much as a full one).
        rngs: for a model that takes its randomness at call time (Flax's tutorial style,
            `__call__(self, x, rngs=None)`): `fit` calls `model(x, rngs=rngs)`, each replica
            drawing its own numbers, new ones every step, reproducible from the seed;
            `evaluate` and `predict` call `model(x)` in eval mode (`model.eval()`: Dropout off,
            BatchNorm on its moving statistics). Create it inside `strategy.scope()`.
        steps_per_execution: Keras' argument: `fit` compiles this many training steps into
            one program (`strategy.run_steps`), one dispatch from Python per K steps; results
            equal K single steps, ragged last batch included. The batch callbacks then see
            `on_train_batch_begin` of each execution's first step and `on_train_batch_end`
            of its last, as in Keras. `evaluate` (and fit's validation) runs K steps per
            program too; `predict` runs one per program (its outputs go to the host every
            batch; Keras runs K there as well).
        run_eagerly: Keras' argument: `fit`, `evaluate` and `predict` run their steps op by
            op, not compiled (`mirrored.config.run_functions_eagerly` for this trainer), for
            debugging with `print` and `breakpoint()` inside the loss or model; the same
            numbers, much slower.

    Example:
        >>> with strategy.scope():
        ...     model = MLP(rngs=nnx.Rngs(0))
        ...     trainer = mirrored.Trainer(model, optax.adam(1e-3),
        ...                                loss="sparse_categorical_crossentropy",
        ...                                metrics=["accuracy"], from_logits=True)
        >>> history = trainer.fit(x, y, batch_size=256, epochs=5, validation_split=0.1)
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation | nnx.Optimizer,
        loss: Any,
        metrics: Sequence[Any] = (),
        *,
        weighted_metrics: Sequence[Any] = (),
        from_logits: bool = False,
        strategy: Strategy | None = None,
        policy: Policy | str | None = None,
        global_clipnorm: float | None = None,
        gradient_accumulation_steps: int = 1,
        rngs: nnx.Rngs | None = None,
        steps_per_execution: int = 1,
        run_eagerly: bool = False,
    ) -> None:
        if not isinstance(run_eagerly, bool):
            raise TypeError(
                f"Expected run_eagerly to be True or False; found {run_eagerly!r}. Fix: "
                "Trainer(..., run_eagerly=True) to debug the step op by op."
            )
        self.run_eagerly = run_eagerly
        if (
            not isinstance(steps_per_execution, int)
            or isinstance(steps_per_execution, bool)
            or steps_per_execution < 1
        ):
            raise ValueError(
                f"Expected steps_per_execution to be a positive int (steps compiled into one "
                f"program); found {steps_per_execution!r}. Fix: e.g. steps_per_execution=32."
            )
        self.steps_per_execution = steps_per_execution
        self.strategy = strategy or get_strategy()
        if rngs is not None:
            if not isinstance(rngs, nnx.Rngs):
                raise TypeError(
                    f"Expected rngs to be an nnx.Rngs, given to the model's call in fit as "
                    f"model(x, rngs=rngs); found {type(rngs).__name__}. Fix: "
                    "rngs=nnx.Rngs(dropout=0), created inside strategy.scope()."
                )
            self.strategy._check_mirrored(rngs, "rngs")
        self.rngs = rngs
        self.policy = global_policy() if policy is None else _as_policy(policy)
        self.model = self.policy.apply(model)
        self.loss = _objectives.get_loss(loss, from_logits=from_logits)
        with self.strategy.scope():  # stateful metrics hold mirrored sums
            resolved = [_objectives.get_metric(m, self.loss) for m in metrics]
            resolved_weighted = [_objectives.get_metric(m, self.loss) for m in weighted_metrics]
        self.metrics = [m for m in resolved if isinstance(m, _objectives.Metric)]
        self.weighted_metrics = [m for m in resolved_weighted if isinstance(m, _objectives.Metric)]
        stateful = [(m, False) for m in resolved if not isinstance(m, _objectives.Metric)]
        stateful += [(m, True) for m in resolved_weighted if not isinstance(m, _objectives.Metric)]
        for metric, _ in stateful:
            self.strategy._check_mirrored(metric, f"the metric {metric.name!r}")
        self._stateful = tuple(m for m, _ in stateful)
        unweighted = {m.name for m in resolved}
        names = [
            "loss",
            *(m.name for m in self.metrics),
            # Keras names a weighted metric that shares an unweighted one's name "weighted_...".
            *(
                f"weighted_{m.name}" if m.name in unweighted else m.name
                for m in self.weighted_metrics
            ),
        ]
        self._stateful_names = [
            f"weighted_{m.name}" if weighted and m.name in unweighted else m.name
            for m, weighted in stateful
        ]
        if len(set(names + self._stateful_names)) != len(names) + len(self._stateful_names):
            raise ValueError(
                f"Expected distinct metric names; found {names + self._stateful_names}. Fix: "
                "give metrics distinct name= arguments."
            )
        self._names = names
        self.strategy._check_mirrored(model, "the model")
        with self.strategy.scope():
            self.optimizer = _build_optimizer(
                model, optimizer, self.policy, global_clipnorm, gradient_accumulation_steps
            )
        self.strategy._check_mirrored(self.optimizer, "the optimizer")
        self._train_step, self._eval_step, self._predict_step = _make_steps(
            self.loss, self.metrics, self.weighted_metrics, [w for _, w in stateful]
        )
        self._train_additions = _additions(self._train_step, len(names) + 2)
        self._eval_additions = _eval_additions(self._eval_step, len(names) + 2)
        self._train_totals = self._zeros()
        self.stop_training = False
        self._epoch = 0
        self._start: tuple[int, int] | None = None
        self._interrupted = False

    # -- state for checkpoints --------------------------------------------------------------

    def _state_objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def _training_state(self) -> dict[str, np.ndarray]:
        arrays = _checkpoint.state_arrays({**self._state_objects(), **self._metric_objects()})
        arrays["totals/sums"] = self._sums(self._train_totals)
        return arrays

    def _metric_objects(self) -> dict[str, Any]:
        return {f"metrics/{i}": m for i, m in enumerate(self._stateful)}

    def _load_training_state(self, arrays: dict[str, np.ndarray], source: str) -> None:
        arrays = dict(arrays)
        sums = arrays.pop("totals/sums")
        objects = {**self._state_objects(), **self._metric_objects()}
        _checkpoint.load_state_arrays(objects, arrays, source)
        self._train_totals = self._zeros(first=sums)  # the sums may come from N' replicas

    def _resume_at(self, epoch: int, step: int) -> None:
        self._start = (epoch, step)

    # -- learning rate ----------------------------------------------------------------------------

    @property
    def learning_rate(self) -> float:
        """The optimizer's learning rate, Keras' `optimizer.learning_rate`; settable between steps.

        It lives in the optimizer state when the optimizer is built with
        `optax.inject_hyperparams` (found inside `optax.chain`, `optax.MultiSteps` and the
        Trainer's own clipping, accumulation and loss-scaling wrappers). Setting it writes the
        value into that mirrored state with the same dtype and placement, so the compiled step
        is reused, not recompiled. With a schedule, `inject_hyperparams(optax.adam)(
        learning_rate=schedule)`, it reads the rate the most recent step used (the first
        step's before training) and cannot be set. Any other optimizer (`optax.adam(1e-3)`,
        `optax.adam(schedule)`) keeps the rate inside its compiled update: reading or setting
        raises an error that shows the fix.

        Example:
            >>> with strategy.scope():
            ...     trainer = mirrored.Trainer(
            ...         model, optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "mse")
            >>> trainer.learning_rate = trainer.learning_rate / 10

        Differs from Keras: Keras optimizers own a learning-rate variable
        (`self.model.optimizer.learning_rate` in a callback); an Optax optimizer has one only
        when `inject_hyperparams` gives it one, and callbacks use `self.model.learning_rate`.
        """
        return _learning_rate.read(self.optimizer)

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        _learning_rate.write(self.optimizer, value)

    # -- data -------------------------------------------------------------------------------------

    def _dataset(
        self,
        x: Any,
        y: Any,
        *,
        batch_size: int | None,
        shuffle: bool,
        seed: int,
        sample_weight: Any = None,
    ) -> DistributedDataset:
        _check_batch_size(batch_size)
        if isinstance(x, DistributedDataset) or _placed_batches(x):
            if y is not None or sample_weight is not None:
                raise ValueError(
                    "Expected y=None and sample_weight=None with a distributed dataset; it "
                    "yields (x, y) or (x, y, sample_weight) batches itself."
                )
            return x if isinstance(x, DistributedDataset) else _Placed(x)  # type: ignore[return-value]
        if y is not None or _is_arrays(x):
            if y is not None and not (_is_arrays(x) and _is_arrays(y)):
                raise TypeError(
                    f"Expected x and y to be arrays (or dicts of arrays); found "
                    f"{type(x).__name__} and {type(y).__name__}. Fix: pass arrays, or a dataset "
                    "of (x, y) batches as x with y=None."
                )
            arrays: tuple[Any, ...] = (x,) if y is None else (x, y)
            if sample_weight is not None:
                if y is None:
                    raise ValueError(
                        "Expected labels y together with sample_weight; found y=None. Fix: "
                        "fit(x, y, sample_weight=w)."
                    )
                arrays = (x, y, _sample_weights(sample_weight, x))
            return self.strategy.experimental_distribute_dataset(
                arrays, batch_size=batch_size or 32, shuffle=shuffle, seed=seed
            )
        if sample_weight is not None:
            raise ValueError(
                f"Expected sample_weight=None with a dataset ({type(x).__name__}); found "
                "weights. Fix: let the dataset yield (x, y, sample_weight) batches."
            )
        return self.strategy.experimental_distribute_dataset(x, batch_size=batch_size)

    def _zeros(self, first: np.ndarray | None = None) -> Any:
        """Per-replica running sums, all zero (or `first` on replica 0)."""
        size = len(self._names) + 2  # + example count, weight sum

        def row(ctx: Any) -> np.ndarray:
            if first is not None and ctx.replica_id_in_sync_group == 0:
                return np.asarray(first, np.float32)
            return np.zeros(size, np.float32)

        return self.strategy.experimental_distribute_values_from_function(row)

    def _sums(self, totals: Any) -> np.ndarray:
        # Running sums are not per example: read them without any batch's padding mask.
        sums = PerReplica(totals.global_value, num_replicas=totals.num_replicas, stacked=True)
        with peer_failures():  # the first read after a worker died surfaces here
            return np.asarray(self.strategy.reduce("SUM", sums), np.float64)

    def _read(self, totals: Any, prefix: str = "") -> dict[str, float]:
        self.strategy._check_pending()  # check_numerics: the steps behind these sums
        *sums, count, weight = self._sums(totals)
        weighted_from = 1 + len(self.metrics)
        logs = {
            prefix + name: _ratio(value, weight if i >= weighted_from else count)
            for i, (name, value) in enumerate(zip(self._names, sums, strict=True))
        }
        for name, metric in zip(self._stateful_names, self._stateful, strict=True):
            logs[prefix + name] = float(np.asarray(to_host(metric.result())).reshape(-1)[0])
        return logs

    def _reset_metrics(self) -> None:
        for metric in self._stateful:
            metric.reset_state()

    # -- fit ---------------------------------------------------------------------------------------

    @_eager_when_asked
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        validation_data: Any = None,
        validation_split: float = 0.0,
        sample_weight: Any = None,
        shuffle: bool = True,
        callbacks: Sequence[Callback] = (),
        initial_epoch: int = 0,
        verbose: int = 1,
        seed: int = 0,
    ) -> History:
        """Train for `epochs` epochs; returns the `History`.

        `batch_size` is the GLOBAL batch (default 32), split over the replicas. Without
        `steps_per_epoch`, an epoch is ceil(examples / batch_size) steps; the last, ragged
        batch is padded and masked so every example counts exactly once. Shuffling is seeded by
        `seed` and differs per epoch.

        As in Keras: `sample_weight` (one weight per example of `x`) weights the loss that is
        trained and logged; `validation_data` may be `(x, y)` or `(x, y, sample_weight)`;
        `validation_split` holds out the last `n - floor(n * (1 - validation_split))`
        examples before shuffling.
        """
        if not 0.0 <= validation_split < 1.0:
            raise ValueError(
                f"Expected validation_split in [0, 1); found {validation_split!r}. Fix: e.g. "
                "validation_split=0.1 holds out the last 10% of the arrays."
            )
        if validation_split and validation_data is not None:
            raise ValueError("Pass validation_data or validation_split, not both.")
        if validation_split:
            if not (_is_arrays(x) and _is_arrays(y)):
                raise ValueError(
                    "validation_split needs in-memory arrays x and y; found a dataset. Fix: "
                    "pass validation_data=... instead."
                )
            rows = len(jax.tree.leaves(x)[0])
            cut = math.floor(rows * (1.0 - validation_split))  # Keras' split_at
            if cut == 0 or cut == rows:
                raise ValueError(
                    f"validation_split={validation_split} of {rows} examples leaves "
                    f"{rows - cut} for validation and {cut} for training; both need at "
                    "least one. Fix: adjust validation_split."
                )
            # Keras holds out the LAST examples, before shuffling, weights included.
            arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
            validation_data = jax.tree.map(lambda a: a[cut:], arrays)
            x, y, *weights = jax.tree.map(lambda a: a[:cut], arrays)
            sample_weight = weights[0] if weights else None
        # In-memory arrays that fit on the devices are placed there once; each step gathers
        # its rows on the devices (`data`), from the same index batches as the host path.
        data = self._resident(x, y, sample_weight, epochs=epochs - initial_epoch)
        train = self._dataset(
            np.arange(len(jax.tree.leaves(x)[0])) if data is not None else x,
            None if data is not None else y,
            batch_size=batch_size,
            shuffle=shuffle,
            seed=seed,
            sample_weight=None if data is not None else sample_weight,
        )
        # Keras: without steps_per_epoch, an epoch is one pass; for a source of unknown length
        # that is "until it runs out".
        steps: int | None = steps_per_epoch if steps_per_epoch is not None else source_length(train)
        # Keras' order: History (and the progress bar) after the user's callbacks, so they see
        # the keys those add to the epoch logs (e.g. LearningRateScheduler's learning_rate).
        callback_list = CallbackList(
            callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose
        )
        history = callback_list.history
        assert history is not None
        global_batch = batch_size or 32
        callback_list.set_trainer(
            self, {"epochs": epochs, "steps": steps, "batch_size": global_batch, "verbose": verbose}
        )
        self.stop_training = False
        self._start = None
        self._interrupted = True
        per_step = callback_list.overrides("on_train_batch_begin") or callback_list.overrides(
            "on_train_batch_end"
        )
        callback_list.on_train_begin({})
        logs: dict[str, float] = {}
        first_epoch, first_step = self._start or (initial_epoch, 0)
        if self._start is None:
            self._train_totals = self._zeros()
        self.model.train()
        for epoch in range(first_epoch, epochs):
            self._epoch = epoch
            if epoch != first_epoch or first_step == 0:
                self._train_totals = self._zeros()
                self._reset_metrics()
            callback_list.on_epoch_begin(epoch, {})
            batches = train.epoch_iterator(
                epoch + 1, skip=first_step if epoch == first_epoch else 0
            )
            step = first_step if epoch == first_epoch else 0
            while steps is None or step < steps:
                # Keras' steps_per_execution: K steps in one program; the batch hooks see the
                # first step of each execution begin and the last one end.
                size = self.steps_per_execution
                with jax.profiler.TraceAnnotation(_profile.INPUT):  # the host waits for data
                    chunk = [
                        _batch_args(b)
                        for b in itertools.islice(
                            batches, size if steps is None else min(size, steps - step)
                        )
                    ]
                if not chunk:
                    break
                if per_step:
                    callback_list.on_train_batch_begin(step, logs={})
                if epoch == first_epoch and step == first_step:
                    first = chunk[0] if data is None else self._rows(data, chunk[0][0])
                    self._check_first_batch(first, y)
                self._train_on(chunk, data)
                step += len(chunk)
                if per_step:
                    callback_list.on_train_batch_end(
                        step - 1, logs=_Logs(lambda: self._read(self._train_totals))
                    )
                if self.stop_training:
                    break
            if steps is not None and step < steps and not self.stop_training:
                logger.warning(
                    "The training data ran out after %d of %d steps in epoch %d. Fix: lower "
                    "steps_per_epoch, or leave it unset to run one pass over the data.",
                    step,
                    steps,
                    epoch + 1,
                )
            logs = self._read(self._train_totals)
            if validation_data is not None:
                dataset = self._eval_dataset(validation_data, batch_size)
                logs.update(self._run_eval(dataset, callback_list, prefix="val_"))
                self.model.train()
            callback_list.on_epoch_end(epoch, logs)
            if self.stop_training:
                break
        self._interrupted = False
        callback_list.on_train_end(logs)  # Keras: the last epoch's logs
        return history

    def _resident(
        self, x: Any, y: Any, sample_weight: Any, *, epochs: int
    ) -> tuple[Any, ...] | None:
        """With `steps_per_execution` > 1, the training arrays placed on every device, or None
        to read batches from the host. From the host: one step per execution (measured: as
        fast as from the devices), `epochs` ≤ the replica count (placing N copies up front
        moves more than N epochs read, and measured slower), a dataset, several processes,
        or arrays over `mirrored.config.device_data_bytes()`."""
        if self.steps_per_execution == 1 or jax.process_count() > 1:
            return None
        if epochs <= self.strategy.num_replicas_in_sync:
            return None
        if not (_is_arrays(x) and _is_arrays(y)):
            return None
        arrays: tuple[Any, ...] = (x, y)
        if sample_weight is not None:
            arrays = (x, y, _sample_weights(sample_weight, x))
        arrays = jax.tree.map(_batching.as_host_array, arrays)
        if sum(a.nbytes for a in jax.tree.leaves(arrays)) > config.device_data_bytes():
            return None
        _batching.leading_size(jax.tree.leaves(arrays))  # one length, or its error
        return tuple(jax.device_put(arrays, self.strategy._replicated))

    def _rows(self, data: tuple[Any, ...], index: Any) -> tuple[Any, ...]:
        """The distributed batch of `data`'s rows `index` (a distributed index batch)."""
        rows = np.asarray(self.strategy.gather(index, axis=0))
        host = jax.tree.map(lambda a: np.asarray(a)[rows], data)
        return tuple(next(iter(self.strategy.experimental_distribute_dataset([host]))))

    def _train_on(self, chunk: list[tuple[Any, ...]], data: tuple[Any, ...] | None) -> None:
        """Train on the batches of `chunk`: one `run` per batch, or all in one program;
        with `data` on the devices, the batches are index batches into it."""
        state = (self.model, self.optimizer)
        train_step, additions_step = self._train_step, self._train_additions
        rows: tuple[Any, ...] = ()
        if data is not None:
            train_step, additions_step = _gathering(train_step), _gathering(additions_step)
            rows = (data,)
        if self.steps_per_execution == 1:
            (batch,) = chunk
            self._train_totals = self.strategy.run(
                train_step,
                args=(*state, self._train_totals, self._stateful, self.rngs, *rows, *batch),
            )
            return
        additions = self.strategy.run_steps(
            additions_step,
            iter(chunk),
            steps=len(chunk),
            args=(*state, self._stateful, self.rngs, *rows),
        )
        self._train_totals = _plus_steps(self._train_totals, additions)

    def _check_first_batch(self, batch: Any, all_labels: Any) -> None:
        """Keras' silent traps, on the first batch: logits given to a loss expecting
        probabilities (a warning) and sparse labels outside the class range (an error)."""
        if not isinstance(self.loss, _objectives.CROSSENTROPIES):
            return
        args = _batch_args(batch)
        if len(args) < 2:
            return
        x, y = args[0], args[1]
        self.model.eval()  # no dropout draw, no BatchNorm update
        try:
            out = self.strategy.run(self._predict_step, args=(self.model, x))
        finally:
            self.model.train()
        if not isinstance(out, jax.Array | PerReplica):
            return
        y_pred = self._host_rows(out)
        labels = all_labels if _is_arrays(all_labels) else y
        if isinstance(labels, PerReplica):
            labels = self.strategy.gather(labels, axis=0)
        if isinstance(labels, np.ndarray | jax.Array):
            host = jax.tree.map(to_host, labels)
            _objectives.check_labels(self.loss, host, tuple(np.shape(y_pred)))
        warning = _objectives.logits_warning(self.loss, y_pred)
        if warning:
            logger.warning(warning)

    # -- verification -----------------------------------------------------------------------------

    def verify(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        expected_replicas: int | None = None,
        steps_per_epoch: int | None = None,
        scaling: bool = False,
    ) -> Any:
        """Run `mirrored.verify` on this Trainer's training step with the first batch of x/y.

        The model and optimizer are not changed (the checks run on copies). Use plain SGD to
        make the single-device equivalence check sensitive to gradient scale.
        """
        from mirrored._proof.verify import verify

        dataset = self._dataset(x, y, batch_size=batch_size, shuffle=False, seed=0)
        batch = next(iter(dataset.epoch_iterator(1)))
        size = len(jax.tree.leaves(x)[0]) if _is_arrays(x) else None
        return verify(
            self.strategy,
            self._train_step,
            (
                self.model,
                self.optimizer,
                self._zeros(),
                self._stateful,
                self.rngs,
                *_batch_args(batch),
            ),
            expected_replicas=expected_replicas,
            dataset_size=size,
            steps_per_epoch=steps_per_epoch,
            scaling=scaling,
        )

    # -- evaluate / predict -------------------------------------------------------------------

    def _eval_dataset(self, data: Any, batch_size: int | None) -> DistributedDataset:
        weights = None
        if isinstance(data, tuple) and len(data) in (2, 3) and _is_arrays(data[0]):
            x, y = data[0], data[1]
            weights = data[2] if len(data) == 3 else None
        else:
            x, y = data, None
        return self._dataset(
            x, y, batch_size=batch_size, shuffle=False, seed=0, sample_weight=weights
        )

    def _run_eval(
        self, dataset: DistributedDataset, callbacks: CallbackList, *, prefix: str = ""
    ) -> dict[str, float]:
        """One pass over `dataset`; `callbacks` get Keras' test hooks (fit's, when validating)."""
        per_step = callbacks.overrides("on_test_batch_begin") or callbacks.overrides(
            "on_test_batch_end"
        )
        callbacks.on_test_begin({})
        self.model.eval()
        totals = self._zeros()
        self._reset_metrics()
        batches = dataset.epoch_iterator(1)
        step = 0
        # steps_per_execution: K evaluation steps in one program, hooks every K steps (Keras).
        while chunk := [
            _batch_args(b) for b in itertools.islice(batches, self.steps_per_execution)
        ]:
            if per_step:
                callbacks.on_test_batch_begin(step, logs={})
            if self.steps_per_execution == 1:
                totals = self.strategy.run(
                    self._eval_step, args=(self.model, totals, self._stateful, *chunk[0])
                )
            else:
                additions = self.strategy.run_steps(
                    self._eval_additions,
                    iter(chunk),
                    steps=len(chunk),
                    args=(self.model, self._stateful),
                )
                totals = _plus_steps(totals, additions)
            step += len(chunk)
            if per_step:
                callbacks.on_test_batch_end(
                    step - 1, logs=_Logs(functools.partial(self._read, totals))
                )
        logs = self._read(totals)
        callbacks.on_test_end(logs)
        return {prefix + name: value for name, value in logs.items()}

    @_eager_when_asked
    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        sample_weight: Any = None,
        callbacks: Sequence[Callback] = (),
        verbose: int = 0,
    ) -> dict[str, float]:
        """Loss and metrics over all of `x`/`y` (or a dataset), aggregated exactly over replicas.

        `sample_weight` weights the loss (and `weighted_metrics`) as in Keras. `callbacks` get
        Keras' test hooks (`on_test_begin`, `on_test_batch_end`, ...). `verbose=1` shows a
        progress bar on a terminal (one line elsewhere), as `fit` does; the default is quiet.
        """
        if y is None and sample_weight is not None:
            raise ValueError(
                "Expected labels y together with sample_weight; found y=None. Fix: "
                "evaluate(x, y, sample_weight=w), or a dataset of (x, y, w) batches."
            )
        weighted = sample_weight is not None
        data = x if y is None else (x, y, sample_weight) if weighted else (x, y)
        dataset = self._eval_dataset(data, batch_size)
        callback_list = CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose)
        callback_list.set_trainer(
            self,
            {
                "epochs": 1,
                "steps": source_length(dataset),
                "batch_size": batch_size or 32,
                "verbose": verbose,
            },
        )
        return self._run_eval(dataset, callback_list)

    @_eager_when_asked
    def predict(
        self,
        x: Any,
        *,
        batch_size: int | None = None,
        verbose: int = 0,
        callbacks: Sequence[Callback] = (),
    ) -> Any:
        """Model outputs for every example of `x`, as NumPy, in input order, without padding.

        `callbacks` get Keras' predict hooks (`on_predict_begin`, `on_predict_batch_end` with
        `logs["outputs"]`, ...).
        """
        del verbose
        dataset = self._dataset(x, None, batch_size=batch_size, shuffle=False, seed=0)
        callback_list = CallbackList(callbacks)
        callback_list.set_trainer(self, {"steps": source_length(dataset), "verbose": 0})
        per_step = callback_list.overrides("on_predict_batch_begin") or callback_list.overrides(
            "on_predict_batch_end"
        )
        callback_list.on_predict_begin({})
        self.model.eval()
        outputs = []
        for step, batch in enumerate(dataset.epoch_iterator(1)):
            if per_step:
                callback_list.on_predict_batch_begin(step, {})
            out = self.strategy.run(
                self._predict_step,
                args=(self.model, batch[0] if isinstance(batch, tuple | list) else batch),
            )
            outputs.append(out)
            if per_step:  # the batch's outputs on the host, real rows only (a sync per batch)
                callback_list.on_predict_batch_end(step, {"outputs": self._host_rows(out)})
        callback_list.on_predict_end({})
        self.strategy._check_pending()
        rows = [self._host_rows(out) for out in outputs]
        return jax.tree.map(lambda *parts: np.concatenate(parts), *rows)

    def _host_rows(self, out: Any) -> Any:
        # Outputs per example of a padded batch carry its mask: gather keeps the real rows.
        return jax.tree.map(
            to_host, self.strategy.gather(out, axis=0) if _has_per_replica(out) else out
        )


def _check_batch_size(batch_size: Any) -> None:
    if batch_size is None:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
        raise TypeError(
            f"Expected batch_size to be a positive int (the GLOBAL batch size) or None; found "
            f"{batch_size!r} ({type(batch_size).__name__}). Fix: e.g. batch_size=256."
        )
    if batch_size < 1:
        raise ValueError(
            f"Expected batch_size to be a positive int (the GLOBAL batch size) or None; found "
            f"{batch_size}. Fix: e.g. batch_size=256, or leave it unset for Keras' default 32."
        )


def _sample_weights(sample_weight: Any, x: Any) -> np.ndarray:
    weights = np.asarray(sample_weight)
    rows = len(jax.tree.leaves(x)[0])
    if (
        weights.ndim not in (1, 2)
        or weights.shape[0] != rows
        or weights.shape[1:] not in ((), (1,))
    ):
        raise ValueError(
            f"Expected sample_weight with one weight per example of x: shape ({rows},) or "
            f"({rows}, 1); found shape {weights.shape}. Fix: pass one weight per row of x."
        )
    return weights


def _ratio(total: float, count: float) -> float:
    return float(total / count) if count else math.nan


def _as_policy(policy: Policy | str) -> Policy:
    return policy if isinstance(policy, Policy) else Policy(policy)


def _build_optimizer(
    model: nnx.Module,
    optimizer: Any,
    policy: Policy,
    global_clipnorm: float | None,
    accumulation: int,
) -> Any:
    """The optimizer the Trainer steps: clipping, accumulation and loss scaling as asked."""
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(
            f"Expected gradient_accumulation_steps to be a positive int; found {accumulation!r}."
        )
    if isinstance(optimizer, nnx.Optimizer) and policy.needs_loss_scaling:
        raise ValueError(
            f"policy {policy.name!r} needs dynamic loss scaling (float16 gradients of a small "
            "loss flush to zero), which the Trainer adds around an Optax transformation; found "
            "an already built nnx.Optimizer, which would train without it.\n"
            "Fix: pass the Optax transformation, e.g. Trainer(model, optax.adam(1e-3), ...), "
            "or build mirrored.mixed_precision.LossScaleOptimizer(model, tx) in the scope."
        )
    if isinstance(optimizer, nnx.Optimizer | LossScaleOptimizer):
        if global_clipnorm is not None or accumulation > 1:
            raise ValueError(
                "global_clipnorm and gradient_accumulation_steps wrap an Optax transformation; "
                f"found an already built {type(optimizer).__name__}. Fix: pass the Optax "
                "transformation itself, e.g. optax.adam(1e-3)."
            )
        return optimizer
    tx = optimizer
    if global_clipnorm is not None:
        # Gradients of mirrored parameters are already summed over replicas here, so every
        # replica clips the same global gradient by the same global norm.
        tx = optax.chain(optax.clip_by_global_norm(global_clipnorm), tx)
    if accumulation > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=accumulation)
    if policy.needs_loss_scaling:
        return LossScaleOptimizer(model, tx)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _has_per_replica(value: Any) -> bool:
    return any(is_per_replica(v) for v in jax.tree.leaves(value, is_leaf=is_per_replica))
