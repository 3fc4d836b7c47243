"""Debugging a distributed step: TensorFlow's `tf.debugging.enable_check_numerics`.

`enable_check_numerics()` makes every `strategy.run` / `run_steps` step (and so `Trainer.fit`)
check, inside its compiled program, that its outputs (the loss), the gradients it hands to
`nnx.Optimizer.update` and the state it writes back are finite: one fused reduction per step
and one small transfer, no host sync (the flags are read with the dispatch bound's lag of two
steps). On the first non-finite value the step's update is dropped, and so are those of the
steps dispatched after it (the model and optimizer stay as they were before it), and
`NonFiniteError` says the step, the replica(s) where it appeared and the first offending
parameter. It is raised by the call two steps later, by the next `strategy.reduce`, `gather`
or `experimental_local_results`, when a loop over a distributed dataset ends, at the end of a
`fit` epoch, `evaluate` or `predict`, or by `disable_check_numerics()`, whichever comes first.

Example:
    >>> mirrored.debug.enable_check_numerics()
    >>> strategy.run(train_step, args=(model, optimizer, x, y))
    NonFiniteError: Expected finite values; found NaN or infinity at step 3 of 'train_step'
    ... first in the gradients of hidden.kernel ...
    >>> mirrored.debug.disable_check_numerics()

For eager debugging (`print`, `breakpoint()` inside the step) see
`mirrored.config.run_functions_eagerly`.
"""

from mirrored._run.numerics import (
    NonFiniteError,
    check_numerics_enabled,
    disable_check_numerics,
    enable_check_numerics,
)

__all__ = [
    "NonFiniteError",
    "check_numerics_enabled",
    "disable_check_numerics",
    "enable_check_numerics",
]
