"""Mixed precision for mirrored: Keras' policies and a loss-scaling optimizer."""

from mirrored._optim.mixed_precision import (
    LossScaleOptimizer,
    Policy,
    global_policy,
    set_global_policy,
)

__all__ = ["LossScaleOptimizer", "Policy", "global_policy", "set_global_policy"]
