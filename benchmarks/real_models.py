"""Examples/second of the examples' real models: a `strategy.run` loop vs a plain-JAX step.

Each model, its optimizer and its training step come from its script in examples/, unchanged.
Both loops train it on the same pre-staged device batches, in the same process, with the same
in-flight bound (mirrored's default), dropout on. Prints JSON; ratio = mirrored / plain JAX; and
`run_steps` (K steps per program, `--steps-per-execution`) against the same plain-JAX loop; and
`Trainer.fit(steps_per_execution=K)` on the same batches as NumPy arrays (one shuffled epoch
per call, input pipeline and per-call work included; the loss Keras' sparse categorical
cross-entropy from logits, per token for the language model), and the same with the default
`steps_per_execution="auto"` after a warm-up `fit` of `--auto-warmup-epochs` epochs (a training
run: "auto" builds its K-step program only when the steps left pay for its compile, and the
later one-epoch fits reuse it; `auto_chose` is the K it built, 0 for one step per program).

    python benchmarks/real_models.py [--devices 8] [--steps 32] [--repeats 3]
                                     [--steps-per-execution 32] [--auto-warmup-epochs 12]

To add a model: a function that builds its `Workload` from its example module, and a line in
`MODELS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import mirrored

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What both loops need: a fresh model, its optimizer, its step, and global batches."""

    make_model: Callable[[], Any]
    make_tx: Callable[[], Any]
    train_step: Callable[..., Any]  # the example's step, run by strategy.run
    per_example_loss: Callable[[Any, Any, Any], Any]  # (model, x, y) -> (batch,), for plain JAX
    batches: list[tuple[Any, ...]]  # host (NumPy) global batches, cycled

    @property
    def global_batch(self) -> int:
        return len(self.batches[0][0])


def _transformer_lm(lm: ModuleType) -> Workload:
    from flax import nnx

    train, _, vocab = lm.char_dataset(lm.load_text())
    return Workload(
        make_model=lambda: lm.TransformerLM(len(vocab), rngs=nnx.Rngs(0)),
        make_tx=lambda: lm.make_optimizer(1000),
        train_step=lm.train_step,
        per_example_loss=lm.per_sequence_loss,
        batches=list(lm.random_windows(train, steps=4, batch_size=lm.GLOBAL_BATCH_SIZE)),
    )


def _cnn_digits(cnn: ModuleType) -> Workload:
    import optax
    from flax import nnx

    x, y, _, _ = cnn.load_data()
    batch = cnn.GLOBAL_BATCH_SIZE * 2  # 16 per replica on 8 devices

    def per_example_loss(model: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y)

    return Workload(
        make_model=lambda: cnn.CNN(rngs=nnx.Rngs(0)),
        make_tx=lambda: optax.adam(3e-3),
        train_step=cnn.train_step,
        per_example_loss=per_example_loss,
        batches=[(x[i : i + batch], y[i : i + batch]) for i in range(0, 4 * batch, batch)],
    )


# name -> (script in examples/, its Workload)
MODELS: dict[str, tuple[str, Callable[[ModuleType], Workload]]] = {
    "cnn_digits": ("cnn_digits.py", _cnn_digits),
    "transformer_lm": ("transformer_lm.py", _transformer_lm),
}


def load_example(script: str) -> ModuleType:
    """examples/ is not a package: load a script as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLES / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_jax_step(devices: list[Any], workload: Workload) -> tuple[Callable, dict, Any]:
    """A hand-written data-parallel step: shard_map, local mean-loss grads, explicit pmean.

    Parameters and other state are plain dicts of arrays (not nnx.State), so the baseline's
    per-step dispatch is as cheap as JAX allows. As under mirrored, each replica folds the
    random keys with its index (its own dropout masks), the streams' counters advance, and
    other float state (BatchNorm statistics) is averaged over replicas.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("batch",))
    graphdef, params_state, *others = nnx.split(workload.make_model(), nnx.Param, ...)
    (rest_state,) = others
    tx = workload.make_tx()
    replicated = NamedSharding(mesh, P())
    params = params_state.to_pure_dict()
    state = {
        "params": jax.device_put(params, replicated),
        "rest": jax.device_put(rest_state.to_pure_dict(), replicated),
        "opt": jax.device_put(tx.init(params), replicated),
    }

    def is_key(a: jax.Array) -> bool:
        return jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)

    def combine(old: jax.Array, new: jax.Array) -> jax.Array:
        if is_key(old):
            return old  # the mirrored key; only the counter moved on
        if jnp.issubdtype(new.dtype, jnp.floating):
            return jax.lax.pmean(new, "batch")
        return new

    def local(params, rest, opt_state, x, y):
        index = jax.lax.axis_index("batch")
        folded = jax.tree.map(lambda a: jax.random.fold_in(a, index) if is_key(a) else a, rest)

        def loss_fn(p):
            nnx.replace_by_pure_dict(params_state, p)
            nnx.replace_by_pure_dict(rest_state, folded)
            model = nnx.merge(graphdef, params_state, rest_state)
            loss = workload.per_example_loss(model, x, y).mean()
            return loss, nnx.split(model, nnx.Param, ...)[2].to_pure_dict()

        (loss, new_rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        rest = jax.tree.map(combine, rest, new_rest)
        return optax.apply_updates(params, updates), rest, opt_state, jax.lax.pmean(loss, "batch")

    step = jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P(), P("batch"), P("batch")),
            out_specs=(P(), P(), P(), P()),
            check_vma=False,
        ),
        donate_argnums=(0, 1, 2),
    )
    return step, state, NamedSharding(mesh, P("batch"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps-per-execution", type=int, default=32)
    parser.add_argument("--auto-warmup-epochs", type=int, default=12)
    args = parser.parse_args()
    mirrored.simulate_cpu_devices(args.devices)

    import itertools

    import jax
    import numpy as np
    from _models import run_bounded, timed
    from flax import nnx

    results = []
    for name in args.models.split(","):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
        script, build = MODELS[name]
        workload = build(load_example(script))
        batch = workload.global_batch
        for n in sorted({1, args.devices}):
            devices = jax.devices()[:n]

            # plain JAX
            step, plain, data_sharding = plain_jax_step(devices, workload)
            staged = [tuple(jax.device_put(a, data_sharding) for a in b) for b in workload.batches]

            def run_plain(k: int, plain=plain, staged=staged, step=step, n=n) -> object:
                def once(i: int) -> object:
                    x, y = staged[i % len(staged)]
                    plain["params"], plain["rest"], plain["opt"], loss = step(
                        plain["params"], plain["rest"], plain["opt"], x, y
                    )
                    return loss

                return run_bounded(k, once, n)

            # mirrored
            strategy = mirrored.MirroredStrategy(devices)
            with strategy.scope():
                model = workload.make_model()
                optimizer = nnx.Optimizer(model, workload.make_tx(), wrt=nnx.Param)
            dist = list(strategy.experimental_distribute_dataset(workload.batches))

            def run_mirrored(
                k: int,
                model=model,
                optimizer=optimizer,
                dist=dist,
                strategy=strategy,
                train_step=workload.train_step,
            ) -> object:
                loss: Any = None
                for i in range(k):
                    x, y = dist[i % len(dist)]
                    loss = strategy.run(train_step, args=(model, optimizer, x, y))
                return loss.global_value

            cycled = itertools.cycle(dist)  # the same placed batches, K per program

            def run_scanned(
                k: int,
                model=model,
                optimizer=optimizer,
                cycled=cycled,
                strategy=strategy,
                train_step=workload.train_step,
                every=args.steps_per_execution,
            ) -> object:
                losses: Any = None
                for start in range(0, k, every):
                    losses = strategy.run_steps(
                        train_step, cycled, steps=min(every, k - start), args=(model, optimizer)
                    )
                return losses.global_value

            # Trainer.fit on the same model from in-memory arrays (`args.steps` batches a
            # call: one epoch, shuffled, the input pipeline included), K steps per program.
            with strategy.scope():
                trainer = mirrored.Trainer(
                    workload.make_model(),
                    workload.make_tx(),
                    "sparse_categorical_crossentropy",
                    from_logits=True,
                    steps_per_execution=args.steps_per_execution,
                )
            epoch = [workload.batches[j % len(workload.batches)] for j in range(args.steps)]
            x_all, y_all = (np.concatenate(column) for column in zip(*epoch, strict=True))

            def run_fit(k: int, trainer=trainer, x=x_all, y=y_all, batch=batch) -> object:
                del k  # one epoch of `args.steps` batches each call (the first compiles)
                trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0)
                return trainer.model

            with strategy.scope():
                auto = mirrored.Trainer(  # steps_per_execution="auto", the default
                    workload.make_model(),
                    workload.make_tx(),
                    "sparse_categorical_crossentropy",
                    from_logits=True,
                )
            auto.fit(x_all, y_all, batch_size=batch, epochs=args.auto_warmup_epochs, verbose=0)
            chosen = max([m.built for m in auto._auto_measured.values()], default=0)

            def run_auto(k: int, auto=auto, x=x_all, y=y_all, batch=batch) -> object:
                return run_fit(k, auto, x, y, batch)

            plain_t, ours_t, scanned_t, fit_t, auto_t = [], [], [], [], []
            for _ in range(args.repeats):  # interleaved, so drift hits both alike
                plain_t.append(timed(run_plain, args.steps, warmup=3))
                ours_t.append(timed(run_mirrored, args.steps, warmup=3))
                warmup = min(args.steps_per_execution, args.steps)  # compiles the K-step program
                scanned_t.append(timed(run_scanned, args.steps, warmup=warmup))
                fit_t.append(timed(run_fit, args.steps, warmup=args.steps))
                auto_t.append(timed(run_auto, args.steps, warmup=args.steps))
            plain_eps = args.steps * batch / statistics.median(plain_t)
            ours_eps = args.steps * batch / statistics.median(ours_t)
            scanned_eps = args.steps * batch / statistics.median(scanned_t)
            fit_eps = args.steps * batch / statistics.median(fit_t)
            auto_eps = args.steps * batch / statistics.median(auto_t)
            row = {
                "model": name,
                "parameters": sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param))),
                "devices": n,
                "global_batch": batch,
                "plain_jax_examples_per_s": round(plain_eps, 1),
                "mirrored_run_examples_per_s": round(ours_eps, 1),
                "ratio": round(ours_eps / plain_eps, 3),
                "steps_per_execution": args.steps_per_execution,
                "mirrored_run_steps_examples_per_s": round(scanned_eps, 1),
                "run_steps_ratio": round(scanned_eps / plain_eps, 3),
                "fit_examples_per_s": round(fit_eps, 1),
                "fit_ratio": round(fit_eps / plain_eps, 3),
                "fit_auto_examples_per_s": round(auto_eps, 1),
                "fit_auto_ratio": round(auto_eps / plain_eps, 3),
                "auto_chose": chosen,
            }
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {"benchmark": "real_models", "backend": jax.default_backend(), "results": results},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
