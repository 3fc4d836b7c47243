"""`ShardedOptimizer`: the optimizer state split over the replicas (ZeRO stage 1).

Adam keeps two float32 moments per parameter; mirrored on N replicas, each device holds all
of them. Here each state leaf is split over the replicas along its first dimension divisible
by N (MaxText's rule; leaves with none, and scalars, stay whole), so each device holds 1/N of
it. The model stays mirrored. Inside `strategy.run`, `update` records its call; the update
then runs in the same compiled program in the global view (`mirrored._run.deferred`), where
XLA partitions it: each device updates its shard of the state, and the new parameters are
gathered whole on every replica. Any Optax transformation gives the replicated run's numbers,
`clip_by_global_norm` included, since nothing sees a shard alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICATED, sharded, sharded_spec


class ShardedOptimizer(nnx.Optimizer):  # type: ignore[type-arg]
    """`nnx.Optimizer` with its state split over the replicas (ZeRO-1); made in the scope.

    A drop-in for `nnx.Optimizer`: `update(model, grads)` inside `strategy.run` (or outside
    it), `step`, `opt_state`; checkpoints save and restore it as any state. Optimizer-state
    bytes per device fall to about 1/N; the numbers are the replicated run's.

    Args:
        model: the model whose `wrt` Variables it updates (mirrored, as usual).
        tx: any Optax transformation.
        wrt: which Variables (default `nnx.Param`).
        shard_gradients: ZeRO-2: inside `strategy.run` each replica reduce-scatters the
            gradients of the model's `wrt` parameters (one reduce-scatter instead of an
            all-reduce; the summed gradient is never whole on a device) and updates its
            shard. The parameters are marked for it: every step that takes the gradients
            of this model hands them to this optimizer. Numbers within float rounding of
            the replicated run (the sum is taken in another order).

    Differs from tf.distribute: TensorFlow mirrors every optimizer slot (Keras 3's
    `DataParallel` too); it has no equivalent. Inside `strategy.run` its `update` returns
    None (the update happens right after the step's per-replica part; with
    `strategy.run_steps`, after each of the K steps).

    Example:
        >>> with strategy.scope():
        ...     model = MLP(rngs=nnx.Rngs(0))
        ...     optimizer = mirrored.ShardedOptimizer(model, optax.adam(1e-3))
        >>> strategy.run(train_step, args=(model, optimizer, x, y))
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        wrt: Any = nnx.Param,
        shard_gradients: bool = False,
    ) -> None:
        strategy = _context.entered_strategy()
        if strategy is None:
            raise ValueError(
                "Expected ShardedOptimizer to be made inside strategy.scope(), where it knows "
                "the replicas to split its state over; found no strategy in scope. Fix:\n"
                "  with strategy.scope():\n"
                "      optimizer = mirrored.ShardedOptimizer(model, optax.adam(1e-3))"
            )
        if not isinstance(shard_gradients, bool):
            raise TypeError(
                "Expected shard_gradients to be True (ZeRO-2: gradients reduce-scattered) or "
                f"False (ZeRO-1); found {shard_gradients!r}. Fix: pass a bool."
            )
        super().__init__(model, tx, wrt=wrt)
        self.shard_gradients = shard_gradients
        n, mesh = strategy.num_replicas_in_sync, strategy._mesh
        for variable in jax.tree.leaves(
            self.opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        ):
            if not isinstance(variable, nnx.Variable):
                continue
            value = variable.get_raw_value()
            spec = sharded_spec(tuple(getattr(value, "shape", ())), n)
            variable.set_metadata(sharded=spec)
            if spec != REPLICATED:
                variable.set_raw_value(jax.device_put(value, sharded(mesh, spec)))
        if shard_gradients:  # ZeRO-2: each step reduce-scatters these parameters' gradients
            for variable in jax.tree.leaves(
                nnx.state(model, wrt), is_leaf=lambda x: isinstance(x, nnx.Variable)
            ):
                if isinstance(variable, nnx.Variable):
                    shape = tuple(getattr(variable.get_raw_value(), "shape", ()))
                    variable.set_metadata(gradient_shards=sharded_spec(shape, n))

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        """Apply `grads` to `model` (the replicas' summed gradients, as `jax.grad` gives them
        inside `strategy.run`). Inside `run` the update follows the step's per-replica part
        and this returns None; outside, it returns the updates, as `nnx.Optimizer.update`."""
        ctx = _context.current_replica_context()
        if ctx is None:
            return self.apply_update(model, grads, **kwargs)
        callables = sorted(k for k, v in kwargs.items() if callable(v))
        if callables:
            raise NotImplementedError(
                "ShardedOptimizer.update inside strategy.run takes array arguments only; found "
                f"the function(s) {callables}. Fix: use nnx.Optimizer for a transformation "
                "that needs one (a line search's value_fn, say)."
            )
        ctx.deferred_updates.append((self, model, grads, kwargs))
        return None

    def apply_update(self, model: Any, grads: Any, *, only_if: Any = None, **kwargs: Any) -> Any:
        """`nnx.Optimizer.update`, on arrays of the global view (XLA partitions it); with
        `only_if` (a LossScaleOptimizer's "every gradient is finite"), no change where False."""
        if only_if is None:
            return nnx.Optimizer.update(self, model, grads, **kwargs)
        return update_only_if(only_if, self, model, grads, **kwargs)


def update_only_if(finite: Any, optimizer: Any, model: Any, grads: Any, **kwargs: Any) -> None:
    """`nnx.Optimizer.update(optimizer, model, grads)` where `finite`, else no change.

    Only what the update writes is selected (the `wrt` parameters and the optimizer's own
    state): the model's other Variables (random keys folded per replica, BatchNorm statistics)
    are left as the step made them, not written back."""

    def updated() -> Any:
        return nnx.state(model, optimizer.wrt), nnx.state(optimizer, nnx.OptState)

    before = jax.tree.map(lambda v: v, updated())  # a snapshot: nnx.state shares Variables
    nnx.Optimizer.update(optimizer, model, grads, **kwargs)
    chosen = jax.tree.map(lambda a, b: jnp.where(finite, a, b), updated(), before)
    nnx.update(model, chosen[0])
    nnx.update(optimizer, chosen[1])
