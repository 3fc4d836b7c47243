"""How `run_steps` runs its K steps: one program looping over them, or K calls of one step's.

One program (`lax.scan` over the steps) saves K - 1 dispatches and is what runs everywhere but
where the backend's code for an operation is much slower inside a loop body. Measured on
XLA:CPU (`benchmarks/loop_ops.py`; jax-ml/jax#12868): a convolution in XLA:CPU's own layout
(batch first and features last, kernel `..., in, out`: the channels-last forward pass of
Keras' and Flax's layers, strided, dilated, depthwise, transposed, 1-D and 3-D) runs as fast
inside a loop, but every other (each convolution's gradients, a channels-first convolution)
1.5 to 25 times slower, while matmuls, pooling and its gradient, softmax, gathers, scatters,
sorts and cumulative sums run as fast or faster inside one. So on CPU a program with a
convolution of another layout runs its K steps as K calls of one step's program, with the
inputs, outputs and numbers of the K-step program; every other runs as one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# StableHLO's convolution dimension numbers: `[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]`.
_DIMS = re.compile(r"dim_numbers = \[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]")


def slow_convolutions(lowered_text: str) -> list[str]:
    """The dimension numbers of the convolutions in a lowered program (StableHLO text) that
    XLA:CPU runs slowly inside a loop: all but batch-first, features-last ones with a
    `..., in, out` kernel. Empty when none."""
    slow = []
    found = _DIMS.findall(lowered_text)
    # A convolution whose dimension numbers this cannot read (another StableHLO printing,
    # say) counts as slow: K calls cost little where one loop would cost 5-25x.
    unread = lowered_text.count("stablehlo.convolution") - len(found)
    slow += ["(dimension numbers not read)"] * max(unread, 0)
    for lhs, rhs, out in found:
        lhs_, rhs_, out_ = (part.replace(" ", "").split(",") for part in (lhs, rhs, out))
        fast = (
            lhs_[0] == "b"
            and lhs_[-1] == "f"
            and rhs_[-2:] == ["i", "o"]
            and out_[0] == "b"
            and out_[-1] == "f"
        )
        if not fast:
            slow.append(f"[{lhs}]x[{rhs}]->[{out}]")
    return slow


def dispatched_steps(
    target: Any, one: Callable[..., Any], masked: bool, expand: Any, checking: bool
) -> Callable[..., Any]:
    """`run_steps`' K steps as K calls of `one` (a compiled step on one step's inputs), with
    the inputs, outputs and state of the K-step program: split inputs and (masked) counts
    stacked on a leading step axis in, outputs stacked by step (replica axis first) out."""

    def call(state: list[Any], split: list[Any], rep: list[Any]) -> Any:
        counts = rep[-1] if masked else None
        fixed = rep[:-1] if masked else rep
        each_step = _unstack(tuple(split), counts)
        outs_by_step = []
        token = jnp.zeros((), jnp.int32)
        for split_k, count_k in each_step:
            state, outs, token = one(state, list(split_k), [*fixed, count_k] if masked else fixed)
            outs_by_step.append(outs)
            target.bound_dispatch(token)
        flags = (True,) * len(outs_by_step[0]) if expand is None else (*expand, *[True] * checking)
        return state, _stack_outputs(outs_by_step, flags), token

    return call


@jax.jit
def _unstack(split: tuple[Any, ...], counts: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """Each step's split inputs (and real-example count) of inputs stacked by step."""
    steps = split[0].shape[0]
    return [
        (tuple(s[k] for s in split), None if counts is None else counts[k]) for k in range(steps)
    ]


@functools.partial(jax.jit, static_argnums=1)
def _stack_outputs(outs_by_step: list[list[Any]], per_replica: tuple[bool, ...]) -> list[Any]:
    """K steps' outputs stacked by step: after the replica axis for per-replica outputs."""
    return [
        jnp.stack(column, axis=1 if p else 0)
        for column, p in zip(zip(*outs_by_step, strict=True), per_replica, strict=True)
    ]
