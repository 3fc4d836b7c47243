"""All-reduces over one replica lowered as what they are: the identity.

JAX lowers every `psum`/`pmax`/`pmin` over a mesh axis to an XLA all-reduce, even when each
replica group has a single member, and XLA:CPU keeps it: every one-replica step (a
`OneDeviceStrategy`, `MirroredStrategy` on one device) paid for a gradient all-reduce that
moves nothing (measured: 2–3% of a one-device Keras `fit` step of the seed MLP). Here
JAX's own lowering rules are wrapped so that such an all-reduce lowers to its operand; every
other one, and every rule's abstract evaluation, autodiff and vma typing, stay JAX's. Installed
once, by the first strategy, so that `import mirrored` changes nothing in JAX.
"""

from __future__ import annotations

import functools
from typing import Any

from mirrored._core import patching

_INSTALLED: list[bool] = []
_LOWERINGS = patching.target(
    "jax._src.interpreters.mlir",
    "_lowerings",
    reason="(entries of psum, pmax, pmin) a one-member all-reduce lowers to its operand",
    checked="jax 0.10.2",
)
_PLATFORM_LOWERINGS = patching.target(
    "jax._src.interpreters.mlir",
    "_platform_specific_lowerings",
    reason="the same, for the platform-specific rules",
    checked="jax 0.10.2",
)


def _one_member_groups(ctx: Any, axes: tuple[Any, ...]) -> bool:
    """Whether an all-reduce over `axes` (names only) has one participant per group."""
    from jax._src.lax import parallel

    try:
        groups = parallel._replica_groups(ctx.module_context.axis_context, axes, None)
    except Exception:  # a context without a mesh (pmap, sharding-only): JAX's own rule decides
        return False
    return all(len(group) == 1 for group in groups)


def _identity_if_alone(
    rule: Any, ctx: Any, arg: Any, *, axes: tuple[Any, ...], **params: Any
) -> Any:
    named_only = axes and not any(isinstance(axis, int) for axis in axes)
    if named_only and params.get("axis_index_groups") is None and _one_member_groups(ctx, axes):
        return [arg]
    return rule(ctx, arg, axes=axes, **params)


def install() -> None:
    """Wrap the lowering of JAX's all-reduce primitives (idempotent)."""
    if _INSTALLED:
        return
    from jax._src.interpreters import mlir
    from jax._src.lax import parallel

    for primitive in (parallel.psum_p, parallel.psum_invariant_p, parallel.pmax_p, parallel.pmin_p):
        tables = [mlir._lowerings, *mlir._platform_specific_lowerings.values()]
        for table in tables:
            entry = table.get(primitive)
            if entry is not None:
                rule = functools.partial(_identity_if_alone, entry.rule)
                table[primitive] = mlir.LoweringRuleEntry(rule, entry.inline)
    _INSTALLED.append(True)
