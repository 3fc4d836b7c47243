"""Mixed precision: policies, and dynamic loss scaling that skips a bad step on every replica.

Variables stay float32 (master weights); modules compute in the policy's compute dtype; losses
are computed in float32. With float16 a `LossScaleOptimizer` keeps small gradients from
flushing to zero. Gradients of mirrored parameters are already summed over replicas inside
`strategy.run`, so one non-finite value on any replica makes the summed gradient non-finite on
every replica: all of them skip the same update, with no extra collective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._optim.sharded import ShardedOptimizer, update_only_if

_POLICIES = {
    "float32": jnp.float32,
    "mixed_float16": jnp.float16,
    "mixed_bfloat16": jnp.bfloat16,
}


class Policy:
    """A dtype policy: `"float32"`, `"mixed_float16"` or `"mixed_bfloat16"` (Keras' names).

    Example:
        >>> mirrored.mixed_precision.set_global_policy("mixed_bfloat16")
    """

    def __init__(self, name: str) -> None:
        if name not in _POLICIES:
            raise ValueError(
                f"Expected a policy name from {sorted(_POLICIES)}; found {name!r}. Fix: "
                "'mixed_bfloat16' on TPUs and recent GPUs, 'mixed_float16' (with loss "
                "scaling) on older GPUs."
            )
        self.name = name

    @property
    def compute_dtype(self) -> Any:
        return _POLICIES[self.name]

    @property
    def variable_dtype(self) -> Any:
        return jnp.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.name == "mixed_float16"

    def apply(self, model: nnx.Module) -> nnx.Module:
        """Make submodules without a dtype of their own compute in `compute_dtype`.

        A layer built with an explicit `dtype=` keeps it, as a Keras layer keeps an explicit
        dtype policy; parameters stay in their `param_dtype` (float32 by default).
        """
        if self.name == "float32":
            return model  # every layer computes as it was built
        for _, module in nnx.iter_modules(model):
            if hasattr(module, "param_dtype") and getattr(module, "dtype", 0) is None:
                setattr(module, "dtype", self.compute_dtype)  # noqa: B010 (not every module has it)
        return model

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f'<Policy "{self.name}">'


# Process-wide, like Keras' global policy.
_global: list[Policy] = [Policy("float32")]


def set_global_policy(policy: Policy | str) -> None:
    """Set the policy the `Trainer` applies to models it is given (process-wide, as in Keras)."""
    _global[0] = policy if isinstance(policy, Policy) else Policy(policy)


def global_policy() -> Policy:
    """The current global policy (default `"float32"`)."""
    return _global[0]


def _all_finite(tree: Any) -> jax.Array:
    """Whether every value of `tree` is finite, on every replica (a replica's own gradients,
    accumulating, may differ: one non-finite replica skips the step on all)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    finite = jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
    if _context.is_varying(finite):
        finite = jax.lax.pmin(finite.astype(jnp.int32), REPLICA_AXIS) == 1
    return finite


class LossScaleOptimizer(nnx.Pytree):
    """An optimizer with loss scaling, for float16 training; its state is mirrored and saved.

    Dynamic scaling (default): start at `initial_scale`, halve it and skip the update whenever a
    gradient is not finite, double it after `growth_interval` finite steps in a row. With
    `dynamic=False` the scale stays fixed (non-finite steps are still skipped).

    In a custom loop, inside `strategy.run`:

        loss, grads = nnx.value_and_grad(
            lambda m: optimizer.get_scaled_loss(loss_fn(m)))(model)
        optimizer.apply(model, optimizer.get_unscaled_gradients(grads))

    Create it in `strategy.scope()` like `nnx.Optimizer`.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        dynamic: bool = True,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
    ) -> None:
        if initial_scale <= 0 or growth_interval < 1 or growth_factor <= 1:
            raise ValueError(
                f"Expected initial_scale > 0, growth_interval >= 1 and growth_factor > 1; found "
                f"{initial_scale}, {growth_interval}, {growth_factor}."
            )
        self.optimizer = nnx.Optimizer(model, tx, wrt=wrt)
        self.dynamic = dynamic
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.scale = nnx.Variable(jnp.asarray(initial_scale, jnp.float32))
        self.good_steps = nnx.Variable(jnp.zeros((), jnp.int32))

    @property
    def step(self) -> Any:
        return self.optimizer.step

    def get_scaled_loss(self, loss: Any) -> Any:
        return loss * self.scale[...].astype(jnp.asarray(loss).dtype)

    def get_unscaled_gradients(self, grads: Any) -> Any:
        inverse = 1.0 / self.scale[...]
        return jax.tree.map(lambda g: g.astype(jnp.float32) * inverse, grads)

    def apply(self, model: nnx.Module, grads: Any, **kwargs: Any) -> jax.Array:
        """Apply unscaled `grads` unless one is not finite; returns whether it applied.
        `kwargs` go to the transformation's update (`examples=` of the Trainer's
        accumulation)."""
        finite = _all_finite(grads)
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        if isinstance(self.optimizer, ShardedOptimizer):  # its update comes after the step
            self.optimizer.update(model, safe, only_if=finite, **kwargs)
        else:
            update_only_if(finite, self.optimizer, model, safe, **kwargs)
        if self.dynamic:
            good = jnp.where(finite, self.good_steps[...] + 1, 0)
            grow = good >= self.growth_interval
            scale = self.scale[...]
            scale = jnp.where(finite, jnp.where(grow, scale * self.growth_factor, scale), scale / 2)
            self.scale[...] = jnp.maximum(scale, 1.0)
            self.good_steps[...] = jnp.where(grow, 0, good)
        return finite

    def update(self, model: nnx.Module, grads: Any, **kwargs: Any) -> jax.Array:
        """`nnx.Optimizer`'s spelling of `apply`."""
        return self.apply(model, grads, **kwargs)
