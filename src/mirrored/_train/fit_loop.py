"""`Trainer.fit`: the epoch loop, device-resident data, callbacks, validation."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mirrored._core.devices import owning_processes
from mirrored._core.values import PerReplica, StackedBatches, to_host
from mirrored._data.input import DistributedDataset, source_length
from mirrored._proof import profile as _profile
from mirrored._run import numerics as _numerics
from mirrored._strategy.strategy import Strategy
from mirrored._train import arguments as _arguments
from mirrored._train import auto_steps as _auto_steps
from mirrored._train import objectives as _objectives
from mirrored._train.batches import (
    Chunk,
    _batch_args,
    _check_batch_size,
    _eager_when_asked,
    _epoch_batches,
    _is_arrays,
    _next_chunk,
    pass_position,
)
from mirrored._train.callbacks.base import Callback, History
from mirrored._train.callbacks.callback_list import CallbackList
from mirrored._train.resident import indices as _indices
from mirrored._train.steps import _gathering, run_chunk

logger = logging.getLogger("mirrored")


def _per_example(a: Any) -> tuple[int, ...]:
    """The shape of one example of batch leaf `a` (its batch size left out)."""
    return tuple(getattr(a, "shape", ())[1:])


def _numerics_in_fit_terms(method: Callable[..., Any]) -> Callable[..., Any]:
    """`fit`, its NonFiniteError saying the epoch and batch of the step it names."""

    @functools.wraps(method)
    def wrapped(self: FitLoop, *args: Any, **kwargs: Any) -> Any:
        self._dispatched.clear()
        try:
            return method(self, *args, **kwargs)
        except _numerics.NonFiniteError as error:
            raise self._in_fit_terms(error) from None

    return wrapped


def _fitting(fit: Callable[..., Any]) -> Callable[..., Any]:
    """`fit`, with `trainer._fitting` set while it runs (an evaluate or predict from a
    callback then leaves the model in train mode)."""

    @functools.wraps(fit)
    def fitting(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._fitting = True
        try:
            return fit(self, *args, **kwargs)
        finally:
            self._fitting = False

    return fitting


def _first_of(chunk: Chunk, strategy: Any, data: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """The first batch of `chunk` (with `data` on the devices, its rows of `data`)."""
    if isinstance(chunk, StackedBatches):
        return _batch_args(chunk.first)
    return chunk[0] if data is None else _rows(strategy, data, chunk[0][0])


def _rows(strategy: Any, data: tuple[Any, ...], index: Any) -> tuple[Any, ...]:
    """The distributed batch of `data`'s rows `index` (a distributed index batch)."""
    rows = np.asarray(strategy.gather(index, axis=0))
    host = jax.tree.map(lambda a: np.asarray(a)[rows], data)
    return tuple(next(iter(strategy.experimental_distribute_dataset([host]))))


class FitLoop:
    """The training half of `Trainer`: `fit` and its epoch loop."""

    # Set by `Trainer.__init__`; the methods that read them are Trainer's.
    strategy: Strategy
    model: Any
    optimizer: Any
    loss: Any
    rngs: Any
    steps_per_execution: int
    stop_training: bool
    _stateful: Any
    _train_step: Any
    _train_additions: Any
    _predict_step: Any
    _inputs_checked: set[Any]
    _train_totals: Any
    _epoch: int
    _interrupted: bool
    _start: Any
    _dataset: Callable[..., DistributedDataset]
    _zeros: Callable[..., Any]
    _read: Callable[..., dict[str, float]]
    _batch_logs: Callable[..., Any]
    _reset_metrics: Callable[[], None]
    _eval_dataset: Callable[..., Any]
    _run_eval: Callable[..., Any]
    _validate: Callable[..., dict[str, Any]]
    _host_rows: Callable[..., Any]
    # The prediction shape of each input structure whose first batch was looked at.
    _predictions_seen: dict[Any, tuple[int, ...]]
    # In-memory arrays on the devices, or None to read from the host (`Evaluation`'s).
    _resident: Callable[..., tuple[Any, ...] | None]
    # A checked step's non-finite values, found right after it (a callback that
    # `checks_numerics`, e.g. TerminateOnNaN, reads it at the batch's end); None if none.
    _non_finite: _numerics.NonFiniteError | None
    # Each dispatch's first step number (of the step function), epoch, first batch and
    # size: a NonFiniteError, found a few steps late, says the epoch and batch it was.
    _dispatched: collections.deque[tuple[int, int, int, int]]

    @_eager_when_asked
    @_numerics_in_fit_terms
    @_fitting
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
        callbacks: Sequence[Callback] | Callback | None = (),
        initial_epoch: int = 0,
        verbose: int | str = 1,
        seed: int = 0,
        class_weight: Mapping[int, float] | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
    ) -> History:
        """Train for `epochs` epochs; returns the `History`.

        `batch_size` is the GLOBAL batch (default 32), split over the replicas. Without
        `steps_per_epoch`, an epoch is ceil(examples / batch_size) steps; the last, ragged
        batch is padded and masked so every example counts exactly once. With it, as in
        Keras, epochs continue through the data: an epoch that reaches the end of a pass stops
        there (with a warning), and the next starts a new pass. Shuffling is seeded by `seed`
        and differs per pass.

        As in Keras: `sample_weight` (one weight per example of `x`) weights the loss that is
        trained and logged; `validation_data` may be `(x, y)` or `(x, y, sample_weight)`;
        `validation_split` holds out the last `n - floor(n * (1 - validation_split))`
        examples before shuffling. `class_weight` (`{class: weight}`, in-memory labels)
        weights each example by its class, as Keras does (training only; not with
        `sample_weight`). `validation_steps`, `validation_batch_size` and `validation_freq`
        (every n-th epoch, or the epochs listed, 1-based) are Keras'.

        Every argument is checked before anything runs or changes (types, ranges, lengths,
        the callbacks' paths, the model against one example of x).
        """
        callbacks = _arguments.as_callbacks(callbacks)
        verbose = _arguments.check_verbose(verbose)
        validation_data = _arguments.as_validation_data(validation_data)
        validates = _arguments.check_fit(
            x=x,
            y=y,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            shuffle=shuffle,
            validation_data=validation_data,
            validation_steps=validation_steps,
            validation_freq=validation_freq,
        )
        _check_batch_size(batch_size)
        _check_batch_size(validation_batch_size)
        for callback in callbacks:
            callback.check()
        _arguments.check_fit_inputs(self.model, x, self.rngs, validation_data, self._inputs_checked)
        if not isinstance(validation_split, float | int) or not 0.0 <= validation_split < 1.0:
            raise ValueError(
                f"Expected validation_split in [0, 1); found {validation_split!r}. Fix: e.g. "
                "validation_split=0.1 holds out the last 10% of the arrays."
            )
        if validation_split and validation_data is not None:
            raise ValueError(
                "Expected validation_data or validation_split, not both; found both. Fix: "
                "keep validation_data (held-out arrays) or validation_split (a fraction of x)."
            )
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
        if class_weight is not None:  # training batches only (Keras): after the split
            sample_weight = _arguments.class_sample_weights(y, class_weight, sample_weight)
        # In-memory arrays that fit on the devices are placed there once; each step gathers
        # its rows on the devices (`data`), from the same index batches as the host path.
        # Checked steps (check_numerics, TerminateOnNaN) read batches from the host, so a
        # non-finite value is named by the batch leaf that held it.
        checked = _numerics.check_numerics_enabled() or any(c.checks_numerics for c in callbacks)
        data = self._resident(x, y, sample_weight, epochs=epochs - initial_epoch, checked=checked)
        train = self._dataset(
            _indices(x) if data is not None else x,
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
        history = self.history = callback_list.history  # Keras' `model.history`
        assert history is not None
        global_batch = batch_size or 32
        callback_list.set_trainer(
            self, {"epochs": epochs, "steps": steps, "batch_size": global_batch, "verbose": verbose}
        )
        self.stop_training = False
        self._start = None
        self._interrupted = True
        fixed = checked or data is not None or not _is_arrays(x)  # auto: host arrays only
        owners = owning_processes(self.strategy.extended.worker_devices)  # they agree
        per_step, fixed = callback_list.agree_batch_hooks("train", owners, fixed)
        callback_list.on_train_begin({})
        logs: dict[str, float] = {}
        first_epoch, first_step = self._start or (initial_epoch, 0)
        if self._start is None:
            self._train_totals = self._zeros()
        # Keras: with steps_per_epoch over data of known length, epochs continue through the
        # data (batches [0, 1], [2, 3], [4], then a new pass), not from its start every epoch.
        length = source_length(train) if steps_per_epoch is not None else None
        current: tuple[int, Iterator[Any]] | None = None  # the pass being read, its batches
        passes = 0  # the passes begun over a source of unknown length
        # In-memory arrays, one pass an epoch: the next epoch's batches are prepared (its
        # prefetch thread) before this epoch's logs are read; their order depends on the epoch.
        ahead: Iterator[Any] | None = None
        read_ahead = (data is not None or _is_arrays(x)) and length is None and steps is not None
        # From the host, K steps per execution: K batches gathered and placed at once.
        k = self.steps_per_execution
        chunked = k if k > 1 and _is_arrays(x) and data is None and not checked else 0
        span = (first_epoch, first_step, epochs, steps if length is None else None, batch_size)
        read = _auto_steps.plan(self, train, (x, y, sample_weight), chunked, fixed, span)
        self.model.train()
        self._non_finite = None
        # check_numerics, if on, raises instead (the error it was asked for).
        checked_steps = checked and not _numerics.check_numerics_enabled()
        for epoch in range(first_epoch, epochs):
            self._epoch = epoch
            if epoch != first_epoch or first_step == 0:
                self._train_totals = self._zeros()
                self._reset_metrics()
            callback_list.on_epoch_begin(epoch, {})
            skip = first_step if epoch == first_epoch else 0
            epoch_steps = steps
            if steps_per_epoch is not None and length is None:
                # A source of unknown length (a generator, a Grain IterDataset): as Keras,
                # one pass read on through the epochs, a new one only once it runs out.
                if current is None:
                    passes += 1
                    current = (passes, _epoch_batches(train, passes, skip, chunked))
                batches = current[1]
            elif length is None or steps is None:
                batches = ahead if ahead is not None else read.batches(epoch + 1, skip)
                ahead = None
            else:
                data_pass, position = pass_position(epoch, steps, length)
                if current is None or current[0] != data_pass:
                    current = (data_pass, train.epoch_iterator(data_pass + 1, skip=position + skip))
                batches = current[1]
                epoch_steps = min(steps, length - position)
            step = skip
            while epoch_steps is None or step < epoch_steps:
                # Keras' steps_per_execution: K steps in one program; the batch hooks see the
                # first step of each execution begin and the last one end.
                size = k if epoch_steps is None else min(k, epoch_steps - step)
                with jax.profiler.TraceAnnotation(_profile.INPUT):  # the host waits for data
                    chunk = _next_chunk(batches, size)
                if not chunk:
                    break
                if per_step:
                    callback_list.on_train_batch_begin(step, logs={})
                if epoch == first_epoch and step == first_step:
                    first = _first_of(chunk, self.strategy, data)
                    if not _is_arrays(x):  # arrays were checked before anything began
                        _arguments.check_model_input(
                            self.model, first[0], self.rngs, "fit", self._inputs_checked
                        )
                    self._check_first_batch(first, y)
                self._train_checked(chunk, data, epoch, step, checked_steps)
                read.ran(chunk)
                step += len(chunk)
                if per_step:
                    callback_list.on_train_batch_end(
                        step - 1, logs=self._batch_logs(self._train_totals)
                    )
                if self.stop_training:
                    break
            if steps is not None and step < steps and not self.stop_training:
                current = None  # the next epoch starts a new pass; a generator cannot
                self.stop_training = _ran_out(step, steps, epoch, isinstance(x, Iterator))
            if read_ahead and epoch + 1 < epochs and not self.stop_training:
                ahead = read.batches(epoch + 2, 0)
            logs = self._read(self._train_totals)
            if validation_data is not None and validates(epoch + 1):
                held = validation_batch_size or batch_size  # in_use: the training arrays stay
                options: dict[str, Any] = {"epochs": epochs - initial_epoch, "in_use": data}
                options.update(checked=checked, steps=validation_steps, passes=(epoch, epochs))
                logs.update(self._validate(validation_data, held, callback_list, **options))
            callback_list.on_epoch_end(epoch, logs)
            self._last_logs = logs
            if self.stop_training:
                break
        self._interrupted = False
        callback_list.on_train_end(logs)  # Keras: the last epoch's logs
        return history

    def _train_checked(
        self,
        chunk: Chunk,
        data: tuple[Any, ...] | None,
        epoch: int,
        step: int,
        checked: bool,
    ) -> None:
        """`_train_on`, remembering which batches it dispatched; `checked` (a callback that
        `checks_numerics`): the steps are checked and looked at right away (one wait per
        execution, as TerminateOnNaN's per-batch read of the loss in Keras)."""
        with _numerics.checking() if checked else contextlib.nullcontext():
            self._train_on(chunk, data)
        self._dispatched.append((self.strategy._runner.last_first_step, epoch, step, len(chunk)))
        if not checked:
            return
        try:
            self.strategy._check_pending()
        except _numerics.NonFiniteError as error:
            self._non_finite = self._in_fit_terms(error)

    def _in_fit_terms(self, error: _numerics.NonFiniteError) -> _numerics.NonFiniteError:
        """`error` with the epoch and batch of the step it names, if it is one of fit's."""
        for first, epoch, batch, size in reversed(self._dispatched):
            if first <= error.step < first + size and error.epoch is None:
                return error.in_fit(epoch, batch + error.step - first)
        return error

    def _train_on(self, chunk: Chunk, data: tuple[Any, ...] | None) -> None:
        """Train on the batches of `chunk`: one `run` per batch, or all in one program;
        with `data` on the devices, the batches are index batches into it."""
        state = (self.model, self.optimizer)
        train_step, additions_step = self._train_step, self._train_additions
        rows: tuple[Any, ...] = ()
        if data is not None:
            train_step, additions_step = _gathering(train_step), _gathering(additions_step)
            rows = (data,)
        self._train_totals = run_chunk(
            self.strategy,
            self.steps_per_execution,
            chunk,
            train_step,
            additions_step,
            self._train_totals,
            state,
            (self._stateful, self.rngs, *rows),
        )

    def _check_first_batch(self, batch: Any, all_labels: Any) -> None:
        """Keras' silent traps, on the first batch: logits given to a loss expecting
        probabilities (a warning) and sparse labels outside the class range (an error).

        The predictions are looked at once per input structure (the first `fit` with it: a
        predict and a wait for its result); later calls check their labels against the
        prediction shape seen then, without a step or a wait."""
        if not _objectives.is_crossentropy(self.loss):
            return
        args = _batch_args(batch)
        if len(args) < 2:
            return
        x, y = args[0], args[1]
        leaves, treedef = jax.tree.flatten(x)
        key = (treedef, tuple((_per_example(a), str(getattr(a, "dtype", ""))) for a in leaves))
        shape = self._predictions_seen.get(key)
        warning = None
        if shape is None:
            self.model.eval()  # no dropout draw, no BatchNorm update
            try:  # unchecked: a non-finite batch is the training step's to report
                with _numerics.checking(False):
                    out = self.strategy.run(self._predict_step, args=(self.model, x))
            finally:
                self.model.train()
            if not isinstance(out, jax.Array | PerReplica):
                return
            y_pred = self._host_rows(out)
            shape = self._predictions_seen[key] = tuple(np.shape(y_pred))
            warning = _objectives.logits_warning(self.loss, y_pred)
        labels = all_labels if _is_arrays(all_labels) else y
        if isinstance(labels, PerReplica):
            labels = self.strategy.gather(labels, axis=0)
        if isinstance(labels, np.ndarray | jax.Array):
            host = jax.tree.map(to_host, labels)
            _objectives.check_labels(self.loss, host, shape)
        if warning:
            logger.warning(warning)


def _ran_out(step: int, steps: int, epoch: int, one_shot: bool) -> bool:
    """Warn that the data ran out within epoch `epoch`; whether training stops (a one-shot
    iterator, a generator, cannot start a new pass: Keras' "interrupting training")."""
    logger.warning(
        "The training data ran out after %d of %d steps in epoch %d%s. Fix: lower "
        "steps_per_epoch, or leave it unset to run one pass over the data.",
        step,
        steps,
        epoch + 1,
        "; interrupting training (a generator cannot start again)" if one_shot else "",
    )
    return one_shot
