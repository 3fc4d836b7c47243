"""What `mirrored.keras` lends the core (`_core.hooks.Extension`): binding Keras state a step
reaches, the trace-time patches of a padded batch, restore and verify preparation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from mirrored.keras import _bind, _metrics, _patches, _verify


class KerasExtension:
    """Keras 3 (JAX backend) models, optimizers and metrics under a strategy."""

    name = "keras"

    def bind(self, runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any) -> Any:
        return _bind.bind(runner, fn, args, kwargs)

    def bind_steps(
        self, runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any, batches: Any
    ) -> Any:
        return _bind.bind_steps(runner, fn, args, kwargs, batches)

    def masked_trace_patches(
        self,
    ) -> Sequence[Callable[[], contextlib.AbstractContextManager[None]]]:
        return (_metrics.masked_keras_metrics,)

    def prepare_restore(self, model: Any, optimizer: Any) -> None:
        # A Keras optimizer creates its slots on first use: create them now (mirrored on the
        # model's strategy), so that they restore.
        strategy = _patches.strategy_of(model)
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            optimizer.build(model.trainable_variables)

    def prepare_verify(
        self, strategy: Any, step_fn: Callable[..., Any], args: list[Any], batch_size: Any
    ) -> Any:
        return _verify.prepare(strategy, step_fn, args, batch_size)

    def __repr__(self) -> str:
        return "KerasExtension()"
