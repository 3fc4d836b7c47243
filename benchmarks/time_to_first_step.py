"""Time to first step of a whole script: plain JAX vs mirrored's `run` loop and `fit`.

Each row is a fresh Python process, timed from its start to the moment its first training
step has finished (the script prints a marker after `block_until_ready`): imports, model
creation, compilation and one step, as a user waits for them. One device (N = 1), Adam.
- `plain_jax`: the model with a `@nnx.jit` step, no mirrored (JAX's compilation cache off,
  its default);
- `run` / `fit`: the same model under `MirroredStrategy`, a `strategy.run` step / `Trainer.fit`,
  with mirrored's persistent compilation cache: `cold` in an empty cache directory, `warm` the
  same script again.
Models: the seed MLP (784-128-10, batch 256) and the CNN of `examples/cnn_digits.py` (batch
128), their classes read from the sources so every script trains the same model. Prints JSON;
the median of `--repeats` processes per row.

    python benchmarks/time_to_first_step.py [--models seed_mlp,cnn] [--repeats 3]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _class_source(path: Path, name: str) -> str:
    source = path.read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            segment = ast.get_source_segment(source, node)
            assert segment is not None
            return segment
    raise LookupError(f"no class {name} in {path}")


MODELS = {
    # name: (file, class, constructor, input shape, batch)
    "seed_mlp": (
        ROOT / "src/mirrored/_cli/bench.py",
        "MLP",
        "MLP((128,), rngs=nnx.Rngs(0))",
        (784,),
        256,
    ),
    "cnn": (ROOT / "examples/cnn_digits.py", "CNN", "CNN(rngs=nnx.Rngs(0))", (8, 8, 1), 128),
}

PRELUDE = """\
import itertools
import jax, numpy as np, optax
from flax import nnx

{model_source}

rng = np.random.default_rng(0)
x = rng.normal(size=({rows}, *{shape})).astype(np.float32)
y = rng.integers(0, 10, {rows}).astype(np.int32)
"""

SCRIPTS = {
    "plain_jax": """
model = {make}
optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

@nnx.jit
def step(model, optimizer, x, y):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

jax.block_until_ready(step(model, optimizer, x[:{batch}], y[:{batch}]))
print("FIRST_STEP", flush=True)
""",
    "run": """
import mirrored

strategy = mirrored.MirroredStrategy()
with strategy.scope():
    model = {make}
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

def step(model, optimizer, x, y):
    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
        return mirrored.compute_average_loss(per_example)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

for batch in strategy.experimental_distribute_dataset((x, y), batch_size={batch}):
    loss = strategy.run(step, args=(model, optimizer, *batch))
    jax.block_until_ready(strategy.reduce("SUM", loss, axis=None))
    print("FIRST_STEP", flush=True)
    break
""",
    "fit": """
import mirrored

strategy = mirrored.MirroredStrategy()
with strategy.scope():
    trainer = mirrored.Trainer(
        {make}, optax.adam(1e-3), "sparse_categorical_crossentropy", from_logits=True
    )

class FirstStep(mirrored.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        jax.block_until_ready(jax.tree.leaves(nnx.state(self.trainer.model)))
        print("FIRST_STEP", flush=True)
        self.trainer.stop_training = True

trainer.fit(x, y, batch_size={batch}, epochs=1, verbose=0, callbacks=[FirstStep()])
""",
}


def _seconds(script: Path, env: dict[str, str]) -> float:
    """From the process's start to its marker line."""
    start = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    ) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip() == "FIRST_STEP":
                seconds = time.perf_counter() - start
                break
        else:
            raise RuntimeError(f"{script.name} ended without finishing a step")
        process.communicate(timeout=120)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="seed_mlp,cnn")
    parser.add_argument("--scripts", default="plain_jax,run,fit")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "XLA_FLAGS"))
        and k not in ("NPROC", "MIRRORED_COMPILATION_CACHE")
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="mirrored-ttfs-") as tmp:
        for model in args.models.split(","):
            path, name, make, shape, batch = MODELS[model]
            prelude = PRELUDE.format(
                model_source=_class_source(path, name), rows=2 * batch, shape=shape
            )
            for kind in args.scripts.split(","):
                script = Path(tmp) / f"{model}_{kind}.py"
                script.write_text(prelude + SCRIPTS[kind].format(make=make, batch=batch))
                times: dict[str, list[float]] = {"cold": [], "warm": []}
                for repeat in range(args.repeats):
                    cache = Path(tmp) / f"cache-{model}-{kind}-{repeat}"
                    env = {**base_env, "MIRRORED_COMPILATION_CACHE": str(cache)}
                    times["cold"].append(_seconds(script, env))
                    if kind != "plain_jax":  # no mirrored, no cache: one number
                        times["warm"].append(_seconds(script, env))
                for cache_state, values in times.items():
                    if values:
                        rows.append(
                            {
                                "model": model,
                                "script": kind,
                                "cache": cache_state,
                                "seconds": round(statistics.median(values), 3),
                            }
                        )
                        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "time_to_first_step", "results": rows}, indent=2))


if __name__ == "__main__":
    main()
