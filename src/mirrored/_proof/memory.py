"""The doctor's "Memory per device": parameters, gradients and optimizer state, mirrored and as
they are now (a ShardedOptimizer splits its state over the replicas), from the arrays' shard
shapes; and the collectives of the compiled step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from mirrored._core.mesh import REPLICA_AXIS, scattered_gradient_spec, sharded_spec
from mirrored._proof.checks import FAIL, INFO, PASS, Check


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _on_first_device(leaf: Any) -> int:
    shards = getattr(leaf, "addressable_shards", None)
    if not shards:
        return int(getattr(leaf, "nbytes", 0))
    device = shards[0].device
    return sum(int(s.data.nbytes) for s in shards if s.device == device)


def _count(text: str, op: str) -> int:
    return text.count(f" {op}(") + text.count(f" {op}-start(")


def check_memory(args: Sequence[Any], hlo_text: str, n: int, analysis: Any = None) -> Check | None:
    """The memory line for the step's optimizer (the first `nnx.Optimizer` among `args`), or
    None when the step has none; `analysis`: the compiled step's `memory_analysis()`."""
    from mirrored._optim.sharded import ShardedOptimizer

    optimizer = next((a for a in args if isinstance(a, nnx.Optimizer)), None)
    model = next((a for a in args if isinstance(a, nnx.Module) and a is not optimizer), None)
    if optimizer is None or model is None:
        return None
    variables = jax.tree.leaves(
        nnx.state(model, optimizer.wrt), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    params = [v.get_raw_value() for v in variables if isinstance(v, nnx.Variable)]
    params = [x for x in params if hasattr(x, "nbytes")]
    # ZeRO-2: each device keeps its shard of a reduce-scattered gradient.
    now_grads = sum(
        int(v.get_raw_value().nbytes) // (n if scattered_gradient_spec(v) is not None else 1)
        for v in variables
        if isinstance(v, nnx.Variable) and hasattr(v.get_raw_value(), "nbytes")
    )
    state = [x for x in jax.tree.leaves(nnx.state(optimizer.opt_state)) if hasattr(x, "nbytes")]
    whole_params = sum(int(x.nbytes) for x in params)
    whole_state = sum(int(x.nbytes) for x in state)
    now_state = sum(_on_first_device(x) for x in state)
    whole_leaves = [x for x in state if sharded_spec(tuple(x.shape), n) == sharded_spec((), n)]
    remainder = sum(int(x.nbytes) for x in whole_leaves)
    split_state = sum(int(x.nbytes) for x in state) - remainder
    ideal_state = remainder + split_state // n
    rows = {
        "params": (whole_params, whole_params),
        "grads": (whole_params, now_grads),
        "optimizer state": (whole_state, now_state),
        "total": (2 * whole_params + whole_state, whole_params + now_grads + now_state),
    }
    data: dict[str, Any] = {
        name: {"replicated": a, "now": b, "ratio": round(b / a, 4) if a else 1.0}
        for name, (a, b) in rows.items()
    }
    data["collectives"] = {
        op: _count(hlo_text, op) for op in ("all-reduce", "reduce-scatter", "all-gather")
    }
    data["whole"] = {"bytes": remainder, "leaves": len(whole_leaves)}
    compiled = {
        key: int(getattr(analysis, f"{key}_size_in_bytes", -1))
        for key in ("argument", "output", "temp")
    }
    data["compiled"] = compiled if analysis is not None else {}
    table = "; ".join(
        f"{name} {_size(a)}" + (f" → {_size(b)} ({b / a:.2f}×)" if a and b != a else "")
        for name, (a, b) in rows.items()
    )
    left = (
        f"; {_size(remainder)} in {len(whole_leaves)} "
        f"{'leaf' if len(whole_leaves) == 1 else 'leaves'} not divisible by {n} "
        f"{'stays' if len(whole_leaves) == 1 else 'stay'} whole"
        if whole_leaves and n > 1
        else ""
    )
    ops = ", ".join(f"{count} {op}" for op, count in data["collectives"].items())
    temp = f"; compiled step's temporaries {_size(compiled['temp'])}" if analysis else ""
    summary = f"per device: {table}{left}; collectives: {ops}{temp}"
    sharded = isinstance(optimizer, ShardedOptimizer)
    if sharded and n > 1 and split_state and now_state >= whole_state:
        return Check(
            "Memory per device",
            FAIL,
            f"ShardedOptimizer's state is still whole on every device: {summary}",
            "Sharding was asked for, but every state leaf is replicated (the silent no-op): "
            "it was placed anew outside its plan (device_put, a restore into a fresh "
            "replicated array). Fix: make the ShardedOptimizer inside strategy.scope() and "
            f"restore into it; its leaves are then split over {REPLICA_AXIS!r}.",
            data,
        )
    if sharded or n == 1 or not whole_state:
        return Check("Memory per device", PASS if sharded else INFO, summary, "", data)
    saved = whole_state - ideal_state
    return Check(
        "Memory per device",
        INFO,
        f"{summary}; mirrored.ShardedOptimizer would hold {_size(ideal_state)} of optimizer "
        f"state per device instead of {_size(whole_state)} (saving {_size(saved)})",
        "The optimizer state is mirrored: every device holds all of it. "
        "mirrored.ShardedOptimizer(model, tx) (Trainer(shard_optimizer_state=True)) splits it "
        "over the replicas with the same numbers.",
        data,
    )
