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
from flax import nnx
from jax.sharding import Mesh

from mirrored._core import context as _context
from mirrored._core.mesh import REPLICATED, sharded, sharded_spec


@dataclasses.dataclass(frozen=True)
class Deferred:
    """One recorded update: how to rebuild the optimizer and model over the step's state."""

    graphdef: Any  # of (model, optimizer)
    treedef: Any  # of their state, whose leaves are the slots' arrays
    slots: tuple[int, ...]  # the runner's state slot of each leaf
    grads_treedef: Any  # of (gradients, the update's keyword arguments)
    grads: int  # how many leaves it takes from the step's extra outputs


def collect(ctx: Any, fresh: Sequence[Any], fn_name: str) -> tuple[list[Deferred], list[Any]]:
    """The step's recorded updates and their gradients (mirrored leaves), in call order."""
    slot_of = {id(v.get_raw_value()): i for i, v in enumerate(fresh)}
    records, leaves = [], []
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
        leaves.extend(grad_leaves)
    return records, leaves


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
