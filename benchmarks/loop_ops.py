"""Which operations run slower inside one compiled loop than as one program per step.

`strategy.run_steps` (and `Trainer(steps_per_execution=K)`) runs K steps either as one program
that loops over them (`lax.scan`) or as K calls of one step's program. Which is faster depends
on the backend's code for the step's operations inside a loop body. This benchmark times both
shapes for small steps built around one operation each, forward and with its gradient (what a
training step contains), on the default device. Prints JSON (each row on stderr as it comes);
`scanned_over_per_step` > 1 means the loop is slower (per step), < 1 that it is faster.

    python benchmarks/loop_ops.py [--steps 32] [--repeats 3] [--only conv_grad_weights,...]
                                  [--devices 8]

Then the CNN of examples/cnn_digits.py evaluated with `strategy.run_steps(..., steps=32)` (a
forward pass only) at 1 and `--devices` devices, as the one program mirrored runs and as the K
calls of one step's program it ran before (forced), seconds per pass over the data.

mirrored's rule (`_run/program.py`): on CPU, a K-step program containing a convolution runs as
K calls of one step's program (XLA:CPU, jax-ml/jax#12868); every other program is one loop.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _cases() -> dict[str, tuple[Callable[[Any], Any], Any]]:
    """name -> (one step: state -> state of the same shape, the first state)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def normal(*shape: int, scale: float = 1.0) -> Any:
        return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

    images = normal(128, 28, 28, 16)
    kernel = normal(3, 3, 16, 16, scale=0.05)
    depthwise = normal(3, 3, 1, 16, scale=0.05)
    sequence, kernel_1d = normal(64, 100, 16), normal(5, 16, 16, scale=0.05)
    volume, kernel_3d = normal(8, 12, 12, 12, 8), normal(3, 3, 3, 8, 8, scale=0.05)
    matrix = normal(512, 512)
    table, ids = normal(1000, 64), jnp.asarray(rng.integers(0, 1000, size=(64, 32)))
    nhwc = ("NHWC", "HWIO", "NHWC")

    def conv(x: Any, w: Any, groups: int = 1) -> Any:
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=nhwc, feature_group_count=groups
        )

    def strided(x: Any, w: Any) -> Any:
        return jax.lax.conv_general_dilated(x, w, (2, 2), "SAME", dimension_numbers=nhwc)

    def dilated(x: Any, w: Any) -> Any:
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", rhs_dilation=(2, 2), dimension_numbers=nhwc
        )

    def conv3d(v: Any, w: Any) -> Any:
        dims = ("NDHWC", "DHWIO", "NDHWC")
        return jax.lax.conv_general_dilated(v, w, (1, 1, 1), "SAME", dimension_numbers=dims)

    def descend(loss: Callable[[Any], Any], rate: float) -> Callable[[Any], Any]:
        return lambda v: v - rate * jax.grad(loss)(v)

    def max_pool(x: Any) -> Any:
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    def sum_pool(x: Any) -> Any:
        return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")

    return {
        "conv_forward": (lambda x: jnp.tanh(conv(x, kernel)), images),
        "conv_forward_strided": (
            lambda x: jnp.tanh(strided(x, kernel)).repeat(2, 1).repeat(2, 2),
            images,
        ),
        "depthwise_conv_forward": (lambda x: jnp.tanh(conv(x, depthwise, groups=16)), images),
        "conv_forward_dilated": (lambda x: jnp.tanh(dilated(x, kernel)), images),
        "conv_transpose_forward": (
            lambda x: jnp.tanh(
                jax.lax.conv_transpose(x, kernel, (2, 2), "SAME", dimension_numbers=nhwc)
            )[:, ::2, ::2, :],
            images,
        ),
        "conv1d_forward": (
            lambda s: jnp.tanh(
                jax.lax.conv_general_dilated(
                    s, kernel_1d, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
                )
            ),
            sequence,
        ),
        "conv3d_forward": (lambda v: jnp.tanh(conv3d(v, kernel_3d)), volume),
        "conv3d_grad": (descend(lambda w: jnp.mean(conv3d(volume, w) ** 2), 0.01), kernel_3d),
        "conv_forward_channels_first": (
            lambda x: jnp.tanh(jax.lax.conv(x, kernel.transpose(3, 2, 0, 1), (1, 1), "SAME")),
            images.transpose(0, 3, 1, 2),
        ),
        "conv_grad_weights": (
            descend(lambda w: jnp.mean(jnp.tanh(conv(images, w)) ** 2), 0.01),
            kernel,
        ),
        "conv_grad_input": (
            descend(lambda x: jnp.mean(jnp.tanh(conv(x, kernel)) ** 2), 0.01),
            images,
        ),
        "depthwise_conv_grad": (
            descend(lambda w: jnp.mean(conv(images, w, groups=16) ** 2), 0.01),
            depthwise,
        ),
        "conv1d_grad": (
            descend(
                lambda w: jnp.mean(
                    jax.lax.conv_general_dilated(
                        sequence, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
                    )
                    ** 2
                ),
                0.01,
            ),
            kernel_1d,
        ),
        "max_pool_grad": (descend(lambda x: jnp.sum(max_pool(x) ** 2), 1e-4), images),
        "sum_pool_grad": (descend(lambda x: jnp.sum(sum_pool(x) ** 2), 1e-5), images),
        "matmul": (lambda a: jnp.tanh(a @ matrix), matrix),
        "softmax": (lambda a: jax.nn.softmax(a, axis=-1) + a * 0.5, matrix),
        "embedding_grad": (descend(lambda t: jnp.mean(jnp.tanh(t[ids]) ** 2), 0.1), table),
        "cumsum_grad": (descend(lambda a: jnp.mean(jnp.cumsum(a, axis=1) ** 2), 0.1), matrix),
        "sort_grad": (descend(lambda a: jnp.mean(jnp.sort(a, axis=1)[:, :10] ** 2), 0.1), matrix),
        "fft": (lambda a: jnp.real(jnp.fft.fft(a)) * 1e-3, matrix),
        "top_k": (lambda a: a + jax.lax.top_k(a, 8)[0].sum() * 1e-6, matrix),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    import mirrored

    # examples/cnn_digits.py asks for 8 at import; the runs use the first --devices of them.
    mirrored.simulate_cpu_devices(max(8, args.devices))
    import jax

    cases = _cases()
    names = args.only.split(",") if args.only else list(cases)
    rows = []
    for name in names:
        step_fn, first = cases[name]
        step = jax.jit(step_fn)
        scanned = jax.jit(
            lambda x, f=step_fn: jax.lax.scan(lambda c, _: (f(c), None), x, None, args.steps)[0]
        )
        step(first).block_until_ready()  # compile both
        scanned(first).block_until_ready()

        def per_step(step: Any = step, first: Any = first) -> None:
            x = first
            for _ in range(args.steps):
                x = step(x)
            x.block_until_ready()

        times: dict[str, list[float]] = {"per_step": [], "scanned": []}
        for _ in range(args.repeats):  # alternating, so that drift hits both alike
            for shape, run in (
                ("per_step", per_step),
                ("scanned", functools.partial(scanned, first)),
            ):
                start = time.perf_counter()
                jax.block_until_ready(run())
                times[shape].append((time.perf_counter() - start) / args.steps)
        per, loop = statistics.median(times["per_step"]), statistics.median(times["scanned"])
        row = {
            "op": name,
            "per_step_ms": round(per * 1e3, 3),
            "scanned_ms": round(loop * 1e3, 3),
            "scanned_over_per_step": round(loop / per, 2),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    platform = jax.devices()[0].platform
    # Off CPU every program is one loop: nothing to compare.
    evaluation = (
        _cnn_evaluation(args.devices, args.steps, args.repeats) if platform == "cpu" else []
    )
    print(
        json.dumps(
            {
                "benchmark": "loop_ops",
                "platform": platform,
                "results": rows,
                "cnn_evaluation": evaluation,
            }
        )
    )


def _cnn_evaluation(devices: int, steps: int, repeats: int) -> list[dict[str, Any]]:
    """Seconds per evaluation pass of the examples' CNN through `run_steps`: one program of
    `steps` steps (mirrored's choice for a forward convolution) vs `steps` calls of one step's
    program (forced: what every convolution got before)."""
    import importlib.util
    from pathlib import Path

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import mirrored
    from mirrored._run import loop_shape

    path = Path(__file__).resolve().parents[1] / "examples" / "cnn_digits.py"
    spec = importlib.util.spec_from_file_location("cnn_digits", path)
    assert spec is not None and spec.loader is not None
    cnn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cnn)
    x, y, _, _ = cnn.load_data()
    x, y = np.concatenate([x] * 4), np.concatenate([y] * 4)  # 7,188 images: 57 steps of 128

    def evaluate(model: Any, images: Any, labels: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model(images), labels)

    measured = loop_shape.slow_convolutions
    rows = []
    for n in sorted({1, devices}):
        times: dict[str, list[float]] = {"one_program": [], "per_step_calls": []}
        for _ in range(repeats):
            for shape in times:
                loop_shape.slow_convolutions = (  # type: ignore[assignment]
                    measured if shape == "one_program" else lambda text: ["forced"]
                )
                strategy = mirrored.MirroredStrategy(jax.devices()[:n])
                with strategy.scope():
                    model = cnn.CNN(rngs=nnx.Rngs(0))
                model.eval()
                data = strategy.experimental_distribute_dataset((x, y), batch_size=128)
                passes = []
                for _ in range(3):  # the first compiles
                    batches, last = iter(data), None
                    start = time.perf_counter()
                    while (
                        out := strategy.run_steps(evaluate, batches, steps=steps, args=(model,))
                    ) is not None:
                        last = out
                    jax.block_until_ready(last)
                    passes.append(time.perf_counter() - start)
                times[shape].append(min(passes[1:]))
        loop_shape.slow_convolutions = measured
        one, calls = (
            statistics.median(times["one_program"]),
            statistics.median(times["per_step_calls"]),
        )
        row = {
            "devices": n,
            "one_program_s": round(one, 4),
            "per_step_calls_s": round(calls, 4),
            "speedup": round(calls / one, 2),
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    main()
