"""`Trainer`: Keras' compile/fit/evaluate/predict on a strategy, exact by construction."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from mirrored._core.values import PerReplica, to_host
from mirrored._data.input import DistributedDataset
from mirrored._optim import learning_rate as _learning_rate
from mirrored._optim.accumulation import accumulate_by_examples
from mirrored._optim.mixed_precision import LossScaleOptimizer, Policy, global_policy
from mirrored._optim.sharded import ShardedOptimizer
from mirrored._persist import checkpoint as _checkpoint
from mirrored._run.errors import peer_failures
from mirrored._strategy.strategy import Strategy, get_strategy
from mirrored._train import arguments as _arguments
from mirrored._train import objectives as _objectives
from mirrored._train import resident as _resident
from mirrored._train.batches import (
    _batch_args,
    _check_batch_size,
    _is_arrays,
    _Placed,
    _placed_batches,
    _PyDatasetEpochs,
    _ratio,
    _sample_weights,
)
from mirrored._train.evaluation import Evaluation
from mirrored._train.fit_loop import FitLoop
from mirrored._train.keras_model import KerasModelMethods
from mirrored._train.keras_objectives import build_from_saved
from mirrored._train.steps import _additions, _eval_additions, _make_steps, building_keras_metrics

logger = logging.getLogger("mirrored")


class Trainer(FitLoop, Evaluation, KerasModelMethods):
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
        gradient_accumulation_steps: apply one update per this many batches, with the mean
            gradient over all their examples: one step on the k-times larger batch, a ragged
            batch weighing by its examples (Keras 3 and `optax.MultiSteps` average the
            batches' mean gradients instead; pass `optax.MultiSteps(tx, k)` for that).
            Each replica accumulates its own gradients: one all-reduce per update.
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
            batch; Keras runs K there as well). `"auto"` (the default; Keras' is 1): `fit` and
            `evaluate` (and fit's validation) on in-memory arrays that no callback reads
            batch by batch (the progress bar aside) time their first steps and run up to 32
            per program when that pays (same numbers; the choice is logged); otherwise, and
            in `predict`, one step per program. `1` asks for one step per program always.
        run_eagerly: Keras' argument: `fit`, `evaluate` and `predict` run their steps op by
            op, not compiled (`mirrored.config.run_functions_eagerly` for this trainer), for
            debugging with `print` and `breakpoint()` inside the loss or model; the same
            numbers, much slower.
        shard_optimizer_state: split the optimizer state over the replicas
            (`mirrored.ShardedOptimizer`, ZeRO stage 1): about 1/N of it per device, the
            replicated run's numbers (float16 loss scaling and `steps_per_execution`
            included; with gradient accumulation, to float rounding: the accumulator is
            split too). `"gradients"` (ZeRO-2) reduce-scatters the gradients too (within
            float rounding of the replicated run; not with float16 loss scaling).

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
        metrics: Sequence[Any] | None = (),
        *,
        weighted_metrics: Sequence[Any] | None = (),
        from_logits: bool = False,
        strategy: Strategy | None = None,
        policy: Policy | str | None = None,
        global_clipnorm: float | None = None,
        gradient_accumulation_steps: int = 1,
        rngs: nnx.Rngs | None = None,
        steps_per_execution: int | str = "auto",
        run_eagerly: bool = False,
        shard_optimizer_state: bool | str = False,
    ) -> None:
        if not isinstance(run_eagerly, bool):
            raise TypeError(
                f"Expected run_eagerly to be True or False; found {run_eagerly!r}. Fix: "
                "Trainer(..., run_eagerly=True) to debug the step op by op."
            )
        self.run_eagerly = run_eagerly
        # 'auto': fit and evaluate choose per input (`auto_steps`); predict runs one per program.
        self._auto_steps = _arguments.check_steps_per_execution(steps_per_execution)
        self.steps_per_execution = 1 if self._auto_steps else int(steps_per_execution)
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
        metrics = () if metrics is None else metrics  # Keras' compile default
        weighted_metrics = () if weighted_metrics is None else weighted_metrics
        for name, given in (("metrics", metrics), ("weighted_metrics", weighted_metrics)):
            if isinstance(given, str) or not isinstance(given, Sequence):
                raise TypeError(
                    f"Expected {name} to be a list of metrics (names, functions or metric "
                    f"objects), as Keras' compile; found {given!r}. Fix: {name}=[{given!r}]."
                )
        optimizer = _named_optimizer(optimizer)
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
        self._names, self._stateful_names, self._directions = _logged_names(
            resolved, self.metrics, self.weighted_metrics, stateful
        )
        self.strategy._check_mirrored(model, "the model")
        self.optimizer = _optimizer_for(
            self, optimizer, global_clipnorm, gradient_accumulation_steps, shard_optimizer_state
        )
        self.strategy._check_mirrored(self.optimizer, "the optimizer")
        self._train_step, self._eval_step, self._predict_step = _make_steps(
            self.loss,
            self.metrics,
            self.weighted_metrics,
            [w for _, w in stateful],
            accumulating=gradient_accumulation_steps > 1,
        )
        self._train_additions = _additions(self._train_step, self._width)
        self._eval_additions = _eval_additions(self._eval_step, self._width)
        self._train_totals = self._zeros()
        self.stop_training = False
        self._epoch = 0
        self._start: tuple[int, int] | None = None
        self._interrupted = False
        self._non_finite = None
        self._dispatched = collections.deque(maxlen=4096)
        self._predictions_seen, self._device_data = {}, _resident.DeviceData()
        self._auto_measured: dict[Any, Any] = {}  # steps_per_execution='auto': each input's step
        self._inputs_checked: set[Any] = set()  # check_model_input's, passed

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
        with self.strategy.scope():  # a fresh F1Score: sized by its saved sums, mirrored
            build_from_saved(self._metric_objects(), arrays)
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
        # batch_size batches a Grain dataset of single examples; a source of batches (a
        # generator, a list of (x, y) batches, a tf.data Dataset, batched already) gives its
        # own, as Keras ignores it.
        grain = type(x).__module__.startswith("grain") and hasattr(x, "batch")
        x = _PyDatasetEpochs.wrap(x, shuffle=shuffle, seed=seed)
        return self.strategy.experimental_distribute_dataset(
            x, batch_size=batch_size if grain else None
        )

    @property
    def _width(self) -> int:
        """The running sums: the loss and each metric, the example count and weight sum, then
        each metric's denominator."""
        return 2 * len(self._names) + 1

    def _zeros(self, first: np.ndarray | None = None) -> Any:
        """Per-replica running sums, all zero (or `first` on replica 0)."""
        size = self._width

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

    def _read(self, totals: Any, prefix: str = "", results: Any = None) -> dict[str, Any]:
        self.strategy._check_pending()  # check_numerics: the steps behind these sums
        sums = self._sums(totals)
        names = len(self._names)
        count, denominators = sums[names], sums[names + 2 :]
        logs: dict[str, Any] = {
            prefix + name: _ratio(value, count if i == 0 else denominators[i - 1])
            for i, (name, value) in enumerate(zip(self._names, sums[:names], strict=True))
        }
        if results is None:
            results = tuple(metric.result() for metric in self._stateful)
        for name, result in zip(self._stateful_names, results, strict=True):
            # A dict of results (a Keras metric of several): its entries, as Keras logs them
            for key, value in (result if isinstance(result, dict) else {name: result}).items():
                value = np.asarray(to_host(value), np.float64)
                # One number, or Keras' array of several (F1Score per class, thresholds)
                logs[prefix + key] = float(value.reshape(-1)[0]) if value.size == 1 else value
        return logs

    def _reset_metrics(self) -> None:
        for metric in self._stateful:
            metric.reset_state()

    # -- fit ---------------------------------------------------------------------------------------

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

        def checked(strategy: Any, state: tuple[Any, ...]) -> Any:
            return verify(
                strategy,
                self._train_step,
                (*state, self.rngs, *_batch_args(batch)),
                expected_replicas=expected_replicas,
                dataset_size=size,
                steps_per_epoch=steps_per_epoch,
                scaling=scaling,
            )

        # A Keras metric sized by the data (F1Score) is built on this batch first, as in fit
        state = (self.model, self.optimizer, self._zeros(), self._stateful)
        return building_keras_metrics(checked)(self.strategy, state)

    # -- evaluate / predict -------------------------------------------------------------------


def _as_policy(policy: Policy | str) -> Policy:
    return policy if isinstance(policy, Policy) else Policy(policy)


# Keras' optimizer names with Keras' default hyperparameters (compile(optimizer="adam")).
_OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "sgd": lambda: optax.sgd(0.01),
    "adam": lambda: optax.adam(1e-3, b1=0.9, b2=0.999, eps=1e-7),
    "adamw": lambda: optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-7, weight_decay=0.004),
    "rmsprop": lambda: optax.rmsprop(1e-3, decay=0.9, eps=1e-7, eps_in_sqrt=False),
    "adagrad": lambda: optax.adagrad(1e-3, initial_accumulator_value=0.1, eps=1e-7),
    "adamax": lambda: optax.adamax(1e-3, b1=0.9, b2=0.999, eps=1e-7),
    "nadam": lambda: optax.nadam(1e-3, b1=0.9, b2=0.999, eps=1e-7),
    "adadelta": lambda: optax.adadelta(1e-3, rho=0.95, eps=1e-7),
    "lion": lambda: optax.lion(1e-3, b1=0.9, b2=0.99, weight_decay=0.0),
}


def _logged_names(
    resolved: Sequence[Any],
    metrics: Sequence[Any],
    weighted_metrics: Sequence[Any],
    stateful: Sequence[tuple[Any, bool]],
) -> tuple[list[str], list[str], dict[str, str | None]]:
    """The logged names of the loss and the per-example metrics, those of the stateful
    metrics, and each name's direction ("up", "down", None: unknown) for callbacks' "auto"."""
    unweighted = {m.name for m in resolved}
    names = [
        "loss",
        *(m.name for m in metrics),
        # Keras names a weighted metric that shares an unweighted one's name "weighted_...".
        *(f"weighted_{m.name}" if m.name in unweighted else m.name for m in weighted_metrics),
    ]
    stateful_names = [
        f"weighted_{m.name}" if weighted and m.name in unweighted else m.name
        for m, weighted in stateful
    ]
    if len(set(names + stateful_names)) != len(names) + len(stateful_names):
        raise ValueError(
            f"Expected distinct metric names; found {names + stateful_names}. Fix: "
            "give metrics distinct name= arguments."
        )
    given = [*metrics, *weighted_metrics, *(m for m, _ in stateful)]
    directions: dict[str, str | None] = {"loss": "down"}
    for name, metric in zip([*names[1:], *stateful_names], given, strict=True):
        # mirrored's metrics say `direction`, Keras' `_direction`.
        directions[name] = getattr(metric, "direction", None) or getattr(metric, "_direction", None)
    return names, stateful_names, directions


def _named_optimizer(optimizer: Any) -> Any:
    """Keras' `compile(optimizer="adam")`: a name is the Optax transformation with Keras'
    default hyperparameters; anything else must be an Optax transformation or an optimizer."""
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _OPTIMIZERS:
            raise ValueError(
                f"Expected an optimizer name from {sorted(_OPTIMIZERS)}; found {optimizer!r}. "
                "Fix: one of those (Keras' defaults), or an Optax transformation such as "
                "optax.adam(1e-3)."
            )
        return _OPTIMIZERS[key]()
    if isinstance(optimizer, nnx.Optimizer | LossScaleOptimizer) or (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):  # an Optax transformation, or one like optax.MultiSteps
        return optimizer
    raise TypeError(
        "Expected optimizer to be an Optax transformation (optax.adam(1e-3)), an "
        f"nnx.Optimizer, or a Keras optimizer name ('adam'); found {type(optimizer).__name__} "
        f"{optimizer!r}. Fix: e.g. Trainer(model, optax.adam(1e-3), ...)."
    )


def _optimizer_for(
    trainer: Any, optimizer: Any, clipnorm: float | None, accumulation: int, shard: bool | str
) -> Any:
    """The optimizer the Trainer steps, made in its strategy's scope: clipping, accumulation
    and loss scaling as asked, its state split over the replicas when `shard` says so."""
    if shard not in (False, True, "gradients"):
        raise ValueError(
            "Expected shard_optimizer_state to be False, True (the optimizer state split over "
            f"the replicas) or 'gradients' (and the gradients); found {shard!r}. Fix: "
            "shard_optimizer_state=True."
        )
    with trainer.strategy.scope():
        built = _build_optimizer(
            trainer.model, optimizer, trainer.policy, clipnorm, accumulation, shard is not False
        )
        if shard is not False or isinstance(built, ShardedOptimizer):
            return _sharded(built, shard, trainer)
        return built


def _sharded(optimizer: Any, shard: bool | str, trainer: Any) -> Any:
    """The Trainer's optimizer with its state split over the replicas (ZeRO-1)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer
    if isinstance(optimizer, LossScaleOptimizer) and type(optimizer.optimizer) is nnx.Optimizer:
        if shard == "gradients":
            raise NotImplementedError(
                "Loss scaling (mixed_float16) checks the whole gradient for inf/NaN in the "
                "step, which ZeRO-2's reduce-scattered gradients are not; found "
                "shard_optimizer_state='gradients'. Fix: shard_optimizer_state=True (the "
                "optimizer state split, the gradients whole), or policy='mixed_bfloat16'."
            )
        inner = optimizer.optimizer
        optimizer.optimizer = ShardedOptimizer(trainer.model, inner.tx, wrt=inner.wrt)
        return optimizer
    if not isinstance(optimizer, nnx.Optimizer) or type(optimizer) is not nnx.Optimizer:
        raise NotImplementedError(
            f"shard_optimizer_state does not wrap a {type(optimizer).__name__} yet; found "
            "one. Fix: give the Trainer an Optax transformation (it builds the optimizer), "
            "or make a mirrored.ShardedOptimizer(model, tx) in the scope and pass it."
        )
    return ShardedOptimizer(
        trainer.model, optimizer.tx, wrt=optimizer.wrt, shard_gradients=shard == "gradients"
    )


def _build_optimizer(
    model: nnx.Module,
    optimizer: Any,
    policy: Policy,
    global_clipnorm: float | None,
    accumulation: int,
    sharded: bool = False,
) -> Any:
    """The optimizer the Trainer steps: clipping, accumulation and loss scaling as asked
    (`sharded`: a ShardedOptimizer will take it over, whose accumulator is not per replica)."""
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ValueError(
            f"Expected gradient_accumulation_steps to be a positive int; found {accumulation!r}. "
            "Fix: e.g. gradient_accumulation_steps=4 (one update per 4 batches), or 1."
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
    if accumulation > 1:  # weighted by examples: one step on the k-times larger batch
        tx = accumulate_by_examples(tx, accumulation, per_replica=not sharded)
    if policy.needs_loss_scaling:
        return LossScaleOptimizer(model, tx)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)
