"""A ShardedOptimizer's update, moved out of the per-replica step into the global view.

Inside `strategy.run` the step is one replica's program (`shard_map`); an Optax update there
would see one replica's shard of the optimizer state, and any transformation that looks at
the whole tree (`clip_by_global_norm`) would be wrong. `ShardedOptimizer.update` only records
its call (the traced optimizer, model and gradients). The gradients leave the per-replica
program whole (mirrored: they are already summed over the replicas), and the update runs
right after it, in the same compiled program, on global arrays whose optimizer state stays
split over the replicas: XLA partitions it, each device updating its own shard of the state
(ZeRO stage 1), and the new parameters are mirrored again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICA_AXIS, REPLICATED, sharded, sharded_spec


@dataclasses.dataclass(frozen=True)
class Deferred:
    """One recorded update: how to rebuild the optimizer and model over the step's state."""

    graphdef: Any  # of (model, optimizer)
    treedef: Any  # of their state, whose leaves are the slots' arrays
    slots: tuple[int, ...]  # the runner's state slot of each leaf
    grads_treedef: Any  # of (gradients, the update's keyword arguments)
    grads: int  # how many leaves it takes from the step's extra outputs


def collect(
    ctx: Any, fresh: Sequence[Any], fn_name: str, n: int, scatter: bool
) -> tuple[list[Deferred], list[Any], list[Any]]:
    """The step's recorded updates, their gradients (and keyword arguments) and each one's
    layout as it leaves the step, in call order. A `shard_gradients` optimizer's gradients
    are split like its state; with `scatter` (the parameters entered the step "reduced", so
    each replica holds its own part of every gradient's sum) each replica keeps the sum of
    its shard alone: a reduce-scatter instead of an all-reduce (ZeRO-2)."""
    slot_of = {id(v.get_raw_value()): i for i, v in enumerate(fresh)}
    records, leaves, specs = [], [], []
    for optimizer, model, grads, kwargs in ctx.deferred_updates:
        graphdef, state = nnx.split((model, optimizer))
        values, treedef = jax.tree.flatten(state)
        missing = [i for i, x in enumerate(values) if id(x) not in slot_of]
        if missing:
            raise ValueError(
                f"strategy.run expected {fn_name!r}'s ShardedOptimizer and the model it updates "
                "among run's arguments; found state of theirs that is not (it was captured, or "
                "made inside the step). Fix: pass both, e.g. "
                "strategy.run(step, args=(model, optimizer, x, y))."
            )
        grad_leaves, grads_treedef = jax.tree.flatten((grads, kwargs))
        if any(_context.is_varying(g) for g in grad_leaves):
            raise ValueError(
                f"ShardedOptimizer.update in {fn_name!r} expected gradients (and keyword "
                "arguments) that are the same on every replica (of a loss from "
                "mirrored.compute_average_loss, summed over the replicas by jax.grad); found "
                "values that differ per replica. Fix: take the gradients of the step's loss "
                "as is, and all_reduce a per-replica argument first."
            )
        slots = tuple(slot_of[id(x)] for x in values)
        records.append(Deferred(graphdef, treedef, slots, grads_treedef, len(grad_leaves)))
        gradients = len(jax.tree.leaves(grads))  # they come first; then the kwargs
        for i, g in enumerate(grad_leaves):
            split = optimizer.shard_gradients and i < gradients
            spec = sharded_spec(tuple(jnp.shape(g)), n) if split else REPLICATED
            leaves.append(_shard_of(g, spec, n) if scatter else g)
            specs.append(spec)
    return records, leaves, specs


def gradients_of(records: Sequence[Deferred], grads: Sequence[Any]) -> list[Any]:
    """The gradients each recorded update applies (without its keyword arguments)."""
    found, offset = [], 0
    for record in records:
        gradients, _ = jax.tree.unflatten(
            record.grads_treedef, grads[offset : offset + record.grads]
        )
        offset += record.grads
        found.append(gradients)
    return found


def updated_slots(records: Sequence[Deferred]) -> list[int]:
    """The state slots the recorded updates write (the model's and optimizers'), in order."""
    return sorted({slot for record in records for slot in record.slots})


def _shard_of(g: Any, spec: Any, n: int) -> Any:
    """This replica's part of gradient `g` as it leaves the step under `spec`: the sum of
    its shard over the replicas (a reduce-scatter) when each holds its own part of the sum,
    else its shard of the whole."""
    unreduced = _context.is_unreduced(g)
    if spec == REPLICATED:
        return jax.lax.psum(g, REPLICA_AXIS) if unreduced else g
    dim = list(spec).index(REPLICA_AXIS)
    if unreduced:
        return jax.lax.psum_scatter(g, REPLICA_AXIS, scatter_dimension=dim, tiled=True)
    size = g.shape[dim] // n
    start = jax.lax.axis_index(REPLICA_AXIS) * size
    return jax.lax.dynamic_slice_in_dim(g, start, size, axis=dim)


def apply(
    records: Sequence[Deferred],
    state: list[Any],
    grads: Sequence[Any],
    specs: Sequence[Any],
    mesh: Mesh,
) -> list[Any]:
    """`state` after the recorded updates, in the global view; each slot keeps its layout
    (`specs`: the optimizer state split over the replicas, the parameters whole)."""
    state = list(state)
    offset = 0
    for record in records:
        gradients, kwargs = jax.tree.unflatten(
            record.grads_treedef, grads[offset : offset + record.grads]
        )
        offset += record.grads
        arrays = jax.tree.unflatten(record.treedef, [state[s] for s in record.slots])
        model, optimizer = nnx.merge(record.graphdef, arrays)
        optimizer.apply_update(model, gradients, **kwargs)
        new = jax.tree.leaves(nnx.split((model, optimizer))[1])
        n = mesh.devices.size
        for slot, value in zip(record.slots, new, strict=True):
            if specs[slot] == REPLICATED:
                # A parameter: each device computes its shard of the new value (the same
                # fused arithmetic as an unsplit update, to the last bit), then all gather it.
                split = sharded_spec(tuple(value.shape), n)
                value = jax.lax.with_sharding_constraint(value, sharded(mesh, split))
            state[slot] = jax.lax.with_sharding_constraint(value, sharded(mesh, specs[slot]))
    return state


def scattered_gradient_error(fn_name: str, error: BaseException) -> ValueError:
    """JAX refused an operation on a ZeRO-2 gradient (each replica's part of its sum)."""
    return ValueError(
        f"strategy.run expected {fn_name!r} to hand the gradients of a "
        "ShardedOptimizer(shard_gradients=True) model to optimizer.update as they are; found "
        "an operation on them (or on the parameters) that JAX cannot do on a partial sum "
        f"held by each replica ({type(error).__name__}: {str(error).splitlines()[0]}). Fix: "
        "leave the gradients to the optimizer (put clipping in the Optax chain, e.g. "
        "optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)): it sees them whole), "
        "or use shard_gradients=False to work on them in the step."
    )


def scattered_write_error(fn_name: str, variable: Any) -> ValueError:
    """The step assigned to a parameter whose gradients are reduce-scattered."""
    return ValueError(
        f"strategy.run expected {fn_name!r} to leave the parameters of a "
        "ShardedOptimizer(shard_gradients=True) model to the optimizer; found an assignment "
        f"to a {type(variable).__name__} of shape {list(jnp.shape(variable.get_raw_value()))}. "
        "Fix: change parameters through optimizer.update, or outside strategy.run, or use "
        "shard_gradients=False."
    )
