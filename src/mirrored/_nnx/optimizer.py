"""`nnx.Optimizer.update(model, grads, **extra)` inside a step: Optax's extra arguments
(`value=` of `reduce_on_plateau` and the line searches) must be the same on every replica;
under check_numerics the gradients it applies are recorded (one patch does both).

The loss a replica differentiates is its share of the global loss (`compute_average_loss`);
handed to `value=` it makes each replica's optimizer state different, and JAX failed deep in
Optax ("the manual axis types do not match"). The fix is the global loss, which is the sum
of the shares.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import patching

_UPDATE = patching.target(
    "flax.nnx.Optimizer",
    "update",
    reason="(while a step is traced) Optax's extra arguments must be the same on every "
    "replica; check_numerics records the gradients a step applies",
    checked="flax 0.12.8",
)


def _per_replica_error(name: str, fix: str) -> ValueError:
    return ValueError(
        f"Expected the optimizer's {name} to be the same on every replica (Optax keeps it in "
        "the optimizer state, which is mirrored); found a per-replica value: most likely this "
        "replica's share of the loss (compute_average_loss), not the global loss.\n"
        f"Fix: pass the global value, the sum of the shares:\n{fix}"
    )


def _is_per_replica(value: Any) -> bool:
    return any(_context.is_varying(x) for x in jax.tree.leaves(value) if isinstance(x, jax.Array))


def _checked_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a line search's `value_fn`), whose results must be the same on every replica."""

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if _is_per_replica(result):
            raise _per_replica_error(
                f"{name}= results",
                "  ctx = mirrored.get_replica_context()\n"
                f"  {name}=lambda state: ctx.all_reduce('SUM', loss_share_of(state))",
            )
        return result

    return checked


def _checked_update(original: Callable[..., Any], seen: list[Any] | None) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        if seen is not None:
            seen.append(grads)
        for name, value in kwargs.items():
            if callable(value) and not isinstance(value, jax.Array):
                kwargs[name] = _checked_function(name, value)
            elif _is_per_replica(value):
                raise _per_replica_error(
                    f"{name}=",
                    "  ctx = mirrored.get_replica_context()\n"
                    f"  optimizer.update(model, grads, {name}=ctx.all_reduce('SUM', loss))",
                )
        return original(self, model, grads, **kwargs)

    return update


@contextlib.contextmanager
def checked_optimizer_update(seen: list[Any] | None = None) -> Iterator[None]:
    """While a step is traced: a per-replica extra argument to `nnx.Optimizer.update` raises;
    the gradients it is given are appended to `seen` (check_numerics), if given."""
    original = vars(nnx.Optimizer)["update"]
    with patching.temporarily(_UPDATE, _checked_update(original, seen)):
        yield
