"""Debugging a distributed step: TensorFlow's `tf.debugging.enable_check_numerics`.

`enable_check_numerics()` makes every `strategy.run` / `run_steps` step (and so `Trainer.fit`)
check, inside its compiled program, that its outputs (the loss), the gradients it hands to
`nnx.Optimizer.update` and the state it writes back are finite: one fused reduction per step
and one small transfer, no host sync (the flags are read with the dispatch bound's lag of two
steps). On the first non-finite value the step's update is dropped, and so are those of the
steps dispatched after it (the model and optimizer stay as they were before it), and
`NonFiniteError` says the step, the replica(s) where it appeared and the first offending
parameter. It is raised by the call two steps later, by the next `strategy.reduce`, `gather`
or `experimental_local_results`, at the end of a `fit` epoch, `evaluate` or `predict`, or by
`disable_check_numerics()`, whichever comes first.

Example:
    >>> mirrored.debug.enable_check_numerics()
    >>> strategy.run(train_step, args=(model, optimizer, x, y))
    NonFiniteError: non-finite values at step 3 of 'train_step' ... first in the gradients
    of hidden.kernel ...
    >>> mirrored.debug.disable_check_numerics()

For eager debugging (`print`, `breakpoint()` inside the step) see
`mirrored.config.run_functions_eagerly`.
"""

from __future__ import annotations

__all__ = [
    "NonFiniteError",
    "check_numerics_enabled",
    "disable_check_numerics",
    "enable_check_numerics",
]

_enabled = False


def enable_check_numerics() -> None:
    """Check every step's outputs, gradients and new state for NaN and infinity (off by
    default; steps compiled before are compiled again, with the check)."""
    global _enabled
    _enabled = True


def disable_check_numerics() -> None:
    """Stop checking (the unchecked programs are used again); first raise for any checked
    step not looked at yet."""
    global _enabled
    _enabled = False
    from mirrored._run import runner as _run

    _run.check_all_pending()


def check_numerics_enabled() -> bool:
    return _enabled


class NonFiniteError(FloatingPointError):
    """A step produced NaN or infinity; its update was not applied.

    Attributes:
        step: the step function's step, counting from 0 from its first call on this
            strategy, checked or not.
        replicas: where the first non-finite value appeared.
        stage: `"outputs"`, `"gradients"` or `"state"`, the first of them holding one.
        path: the first offending leaf of that stage.
        parameter: the first parameter it reached: its gradient (`"hidden.kernel"`), else
            its new value (`"model.hidden.kernel"`).
        paths: every offending leaf, by stage.
        batch_replicas: replicas whose batch itself held non-finite values.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        replicas: list[int],
        stage: str,
        path: str,
        parameter: str,
        paths: dict[str, list[str]],
        batch_replicas: list[int],
    ) -> None:
        super().__init__(message)
        self.step = step
        self.replicas = replicas
        self.stage = stage
        self.path = path
        self.parameter = parameter
        self.paths = paths
        self.batch_replicas = batch_replicas
