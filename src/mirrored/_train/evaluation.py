"""`Trainer.evaluate` and `Trainer.predict` (and fit's validation): the eval loops."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from mirrored._core.devices import owning_processes
from mirrored._core.values import to_host
from mirrored._data.input import DistributedDataset, source_length
from mirrored._run import numerics as _numerics
from mirrored._strategy.strategy import Strategy
from mirrored._train import arguments as _arguments
from mirrored._train import auto_steps as _auto_steps
from mirrored._train.batches import (
    _eager_when_asked,
    _has_per_replica,
    _is_arrays,
    _Logs,
    _next_chunk,
)
from mirrored._train.callbacks.base import Callback
from mirrored._train.callbacks.callback_list import CallbackList
from mirrored._train.resident import DeviceData
from mirrored._train.resident import indices as _indices
from mirrored._train.steps import _gathering, run_chunk

logger = logging.getLogger("mirrored")


_MODES = ("deterministic", "use_running_average")  # what `eval()` / `train()` set


def _keeping_the_mode(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (which calls the model in eval mode), called during `fit` (from a callback),
    leaves the model's mode as it found it: it must not switch Dropout off for the rest of
    training (Keras passes `training=` per call, so nothing persists there). Outside `fit`
    the model stays in eval mode afterwards, ready for inference."""

    @functools.wraps(method)
    def keeping(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_fitting", False):
            return method(self, *args, **kwargs)
        modes = [
            (module, name, getattr(module, name))
            for _, module in nnx.iter_graph(self.model)
            if isinstance(module, nnx.Module)
            for name in _MODES
            if isinstance(getattr(module, name, None), bool)
        ]
        try:
            return method(self, *args, **kwargs)
        finally:
            for module, name, value in modes:
                setattr(module, name, value)

    return keeping


class Evaluation:
    """The evaluation half of `Trainer`: `evaluate`, `predict`, fit's validation."""

    # Set by `Trainer.__init__`; the methods that read them are Trainer's.
    strategy: Strategy
    model: Any
    steps_per_execution: int
    _stateful: Any
    _eval_step: Any
    _eval_additions: Any
    _predict_step: Any
    _inputs_checked: set[Any]
    _device_data: DeviceData
    _dataset: Callable[..., DistributedDataset]
    _zeros: Callable[..., Any]
    _read: Callable[..., dict[str, float]]
    _reset_metrics: Callable[[], None]

    def _resident(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        epochs: int = 1,
        checked: bool = False,
        in_use: tuple[Any, ...] | None = None,
    ) -> tuple[Any, ...] | None:
        """The arrays of a `fit`, `evaluate` or `predict` on the devices, or None to read
        batches from the host (`resident.DeviceData.arrays`; `epochs`: the passes the call
        makes over them). A checked run (`check_numerics`, or a callback that
        `checks_numerics`: `checked`) reads from the host, so a non-finite value is named
        by the batch leaf that held it."""
        if checked or _numerics.check_numerics_enabled():
            return None
        return self._device_data.arrays(
            self.strategy,
            self.steps_per_execution,
            x,
            y,
            sample_weight,
            uses=epochs,
            in_use=in_use,
        )

    def forget_data(self) -> None:
        """Release the arrays `fit`, `evaluate` and `predict` keep on the devices between calls.

        With `steps_per_execution` > 1, in-memory arrays placed on the devices stay there for
        the next call on the same arrays (recognised by the objects, shapes, dtypes and a
        sample of rows). After changing such an array in place, call this (or pass a new
        array) so the next call places the new values."""
        self._device_data.forget()

    def _eval_dataset(
        self,
        data: Any,
        batch_size: int | None,
        *,
        epochs: int = 1,
        checked: bool = False,
        in_use: tuple[Any, ...] | None = None,
    ) -> tuple[DistributedDataset, tuple[Any, ...] | None, Any]:
        """The batches of `data` ((x, y), (x, y, sample_weight) or a dataset), the arrays
        they index on the devices when kept there (`_resident`; None: the batches hold the
        examples), and `_run_eval`'s `inputs`. `in_use`: arrays kept on the devices that the
        caller still reads (they stay)."""
        weights, inputs = None, None
        if isinstance(data, tuple) and len(data) in (2, 3) and _is_arrays(data[0]):
            x, y = data[0], data[1]
            weights = data[2] if len(data) == 3 else None
            inputs = ((x, y, weights), batch_size)
        else:
            x, y = data, None
        placed = None
        if y is not None:
            placed = self._resident(x, y, weights, epochs=epochs, checked=checked, in_use=in_use)
        if placed is not None:  # index batches into the arrays on the devices
            x, y, weights = _indices(x), None, None
        dataset = self._dataset(
            x, y, batch_size=batch_size, shuffle=False, seed=0, sample_weight=weights
        )
        return dataset, placed, inputs

    def _batch_logs(self, totals: Any) -> _Logs:
        """A batch hook's logs: these sums and the stateful metrics' state now (immutable
        arrays: kept by reference, ~0.1 ms), their results computed only if a callback
        looks, however late (computing them at every batch cost ~9 ms per metric)."""
        # `nnx.split`'s state shares the Variables; mapped, it holds this batch's arrays
        snapshots = tuple(
            (graphdef, jax.tree.map(lambda a: a, state))
            for graphdef, state in map(nnx.split, self._stateful)
        )

        def read() -> dict[str, Any]:
            results = tuple(nnx.merge(*snapshot).result() for snapshot in snapshots)
            return self._read(totals, results=results)

        return _Logs(read)

    def _validate(
        self,
        data: Any,
        batch_size: int | None,
        callbacks: CallbackList,
        *,
        steps: int | None = None,
        passes: tuple[int, int] = (0, 1),
        **options: Any,
    ) -> dict[str, float]:
        """`fit`'s validation after an epoch: `val_` logs; the model back in train mode.
        `passes`: this epoch and the end epoch."""
        dataset, placed, inputs = self._eval_dataset(data, batch_size, **options)
        options = {"placed": placed, "steps": steps, "inputs": inputs, "passes": passes}
        logs = self._run_eval(dataset, callbacks, prefix="val_", **options)
        self.model.train()
        return logs

    @_keeping_the_mode
    def _run_eval(
        self,
        dataset: DistributedDataset,
        callbacks: CallbackList,
        *,
        prefix: str = "",
        placed: tuple[Any, ...] | None = None,
        steps: int | None = None,
        inputs: tuple[tuple[Any, ...], int | None] | None = None,
        passes: tuple[int, int] = (0, 1),
    ) -> dict[str, float]:
        """One pass over `dataset` (its first `steps` batches); `callbacks` get Keras' test
        hooks (fit's, when validating). With `placed`, the batches are index batches into
        those arrays on the devices. `inputs`: the in-memory arrays of `dataset` (x, y and
        the weights) and the batch size, None for another source; `passes`: this pass's
        number and how many the caller makes (fit's validation: its epochs), both for
        `steps_per_execution="auto"`."""
        owners = owning_processes(self.strategy.extended.worker_devices)  # they agree
        per_step, _ = callbacks.agree_batch_hooks("test", owners)
        callbacks.on_test_begin({})
        self.model.eval()
        totals = self._zeros()
        self._reset_metrics()
        k = self.steps_per_execution  # in-memory arrays: K batches gathered at once
        stacked = k > 1 and placed is None and steps is None
        # "auto": in-memory arrays from the host, no batch hooks, every batch: K measured.
        fixed = per_step or placed is not None or steps is not None or inputs is None
        fixed |= _numerics.check_numerics_enabled()  # checked steps: one a program, as fit
        arrays, batch_size = inputs or ((), None)
        # As epochs of one fit from this pass on (each reads the dataset's first epoch).
        span = (0, 0, passes[1] - passes[0], None if fixed else len(dataset), batch_size)
        read = _auto_steps.plan(
            self, dataset, arrays, k if stacked else 0, fixed, span, lambda: totals
        )
        batches = read.batches(1, 0)
        eval_step, eval_additions = self._eval_step, self._eval_additions
        rows: tuple[Any, ...] = ()
        if placed is not None:
            eval_step, eval_additions = _gathering(eval_step), _gathering(eval_additions)
            rows = (placed,)
        step = 0
        # steps_per_execution: K evaluation steps in one program, hooks every K steps (Keras).
        while (size := k if steps is None else min(k, steps - step)) and (
            chunk := _next_chunk(batches, size)
        ):
            if per_step:
                callbacks.on_test_batch_begin(step, logs={})
            totals = run_chunk(
                self.strategy,
                k,
                chunk,
                eval_step,
                eval_additions,
                totals,
                (self.model,),
                (self._stateful, *rows),
            )
            read.ran(chunk)
            step += len(chunk)
            if per_step:
                callbacks.on_test_batch_end(step - 1, logs=self._batch_logs(totals))
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
        callbacks: Sequence[Callback] | Callback | None = (),
        verbose: int | str = 0,
        steps: int | None = None,
        return_dict: bool = True,
    ) -> Any:
        """Loss and metrics over all of `x`/`y` (or a dataset), aggregated exactly over replicas.

        `sample_weight` weights the loss (and `weighted_metrics`) as in Keras. `callbacks` get
        Keras' test hooks (`on_test_begin`, `on_test_batch_end`, ...). `verbose=1` shows a
        progress bar on a terminal (one line elsewhere), as `fit` does; the default is quiet.
        `steps`: only the first `steps` batches, as Keras. Returns `{name: value}`, or with
        `return_dict=False` Keras' list `[loss, *metrics]` (the loss alone without metrics).
        """
        _arguments.check_count("steps", steps, minimum=1, none=True, fix="e.g. steps=10")
        if y is None and sample_weight is not None:
            raise ValueError(
                "Expected labels y together with sample_weight; found y=None. Fix: "
                "evaluate(x, y, sample_weight=w), or a dataset of (x, y, w) batches."
            )
        callbacks = _arguments.as_callbacks(callbacks)
        verbose = _arguments.check_verbose(verbose)
        _arguments.check_labels_given(x, y, "evaluate")
        if _is_arrays(x):
            _arguments.check_model_input(self.model, x, None, "evaluate", self._inputs_checked)
        weighted = sample_weight is not None
        data = x if y is None else (x, y, sample_weight) if weighted else (x, y)
        checked = any(c.checks_numerics for c in callbacks)
        dataset, placed, inputs = self._eval_dataset(data, batch_size, checked=checked)
        callback_list = CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose)
        callback_list.set_trainer(
            self,
            {
                "epochs": 1,
                "steps": steps or source_length(dataset),
                "batch_size": batch_size or 32,
                "verbose": verbose,
            },
        )
        logs = self._run_eval(dataset, callback_list, placed=placed, steps=steps, inputs=inputs)
        if return_dict:
            return logs
        values = list(logs.values())  # Keras' order: the loss, then the metrics as compiled
        return values[0] if len(values) == 1 else values

    @_eager_when_asked
    @_keeping_the_mode
    def predict(
        self,
        x: Any,
        *,
        batch_size: int | None = None,
        verbose: int | str = 0,
        callbacks: Sequence[Callback] | Callback | None = (),
        steps: int | None = None,
    ) -> Any:
        """Model outputs for every example of `x` (of its first `steps` batches), as NumPy, in
        input order, without padding.

        `callbacks` get Keras' predict hooks (`on_predict_begin`, `on_predict_batch_end` with
        `logs["outputs"]`, ...).
        """
        callbacks = _arguments.as_callbacks(callbacks)
        _arguments.check_count("steps", steps, minimum=1, none=True, fix="e.g. steps=10")
        verbose = _arguments.check_verbose(verbose)
        if _is_arrays(x):
            _arguments.check_model_input(self.model, x, None, "predict", self._inputs_checked)
        placed = self._resident(x, checked=any(c.checks_numerics for c in callbacks))
        predict_step = self._predict_step if placed is None else _gathering(self._predict_step)
        held: tuple[Any, ...] = () if placed is None else (placed,)
        if placed is not None:  # index batches into the arrays on the devices
            x = _indices(x)
        dataset = self._dataset(x, None, batch_size=batch_size, shuffle=False, seed=0)
        callback_list = CallbackList(callbacks)
        callback_list.set_trainer(self, {"steps": steps or source_length(dataset), "verbose": 0})
        owners = owning_processes(self.strategy.extended.worker_devices)  # they agree
        per_step, _ = callback_list.agree_batch_hooks("predict", owners)
        callback_list.on_predict_begin({})
        self.model.eval()
        outputs = []
        for step, batch in enumerate(dataset.epoch_iterator(1)):
            if steps is not None and step >= steps:
                break
            if per_step:
                callback_list.on_predict_batch_begin(step, {})
            out = self.strategy.run(
                predict_step,
                args=(self.model, *held, batch[0] if isinstance(batch, tuple | list) else batch),
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
