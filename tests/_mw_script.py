"""A worker of a multi-worker job, started by test_multiworker through `mirrored launch`.

    python _mw_script.py OUT_DIR [--kill-rank R --kill-at STEP] [--backup DIR]

Trains the same model twice — a strategy.run loop, then Trainer.fit — and the chief writes the
parameters (and a checkpoint) to OUT_DIR. Every worker writes its pid to OUT_DIR/pid.RANK.
"""

import argparse
import os
import signal

import mirrored

strategy = mirrored.MultiWorkerMirroredStrategy()  # first: starts jax.distributed

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP, global_batches, train_step  # noqa: E402


class KillAt(mirrored.callbacks.Callback):
    """SIGKILL this process after its `step`-th batch (on the first attempt only: a restart by
    `mirrored launch --max-restarts` runs to the end); counts the batches it ran."""

    def __init__(self, step):
        self.step, self.done = step, 0
        self.first = os.environ.get("MIRRORED_RESTART_COUNT", "0") == "0"

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step and self.first:
            print(f"killed after batch {self.done}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, logs=None):
        print(f"batches run {self.done}", flush=True)


class Reads(mirrored.callbacks.Callback):
    """Reads every batch's loss (an all-reduce), given to one process only."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])

    on_test_batch_end = on_train_batch_end

    def on_predict_batch_end(self, batch, logs=None):
        self.losses.append(len(logs["outputs"]))


class ChiefReads(mirrored.callbacks.Callback):
    """A batch's logs read on the chief alone, as a user's print would be (the read is an
    all-reduce: before, the chief ran it alone and the job hung)."""

    def on_train_batch_end(self, batch, logs=None):
        if jax.process_index() == 0 and batch == 1:
            print(f"chief read loss {logs['loss']:.4f}", flush=True)


def small_trainer(strategy, steps_per_execution="auto", seed=0, tx=None):
    """The SmallMLP Trainer (Adam 0.01 unless `tx`, sparse cross-entropy of logits)."""
    with strategy.scope():
        return mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(seed)),
            tx or optax.adam(0.01),
            "sparse_categorical_crossentropy",
            from_logits=True,
            steps_per_execution=steps_per_execution,
        )


def flat(model):
    return {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model))
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--backup", default="")
    parser.add_argument("--die-rank", type=int, default=-1)
    args = parser.parse_args()
    rank = jax.process_index()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    print(
        f"replicas {strategy.num_replicas_in_sync} processes {jax.process_count()} "
        f"chief {strategy.is_chief}",
        flush=True,
    )

    # 1. A strategy.run loop, SGD, five global batches.
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(global_batches(5, 64))):
        if step == 2 and rank == args.die_rank:
            os._exit(3)  # a dead peer: the survivors must raise, not hang
        try:
            loss = strategy.run(train_step, args=(model, optimizer, x, y))
        except mirrored.PeerFailureError as error:
            print(f"PeerFailureError: {error}", flush=True)
            os._exit(4)
    try:
        total = float(strategy.reduce("SUM", loss))
    except mirrored.PeerFailureError as error:
        print(f"PeerFailureError: {error}", flush=True)
        os._exit(4)
    loop = flat(model)

    # 2. Trainer.fit with a ragged last batch, a checkpoint, optionally a backup and a crash.
    x = np.concatenate([b[0] for b in global_batches(4, 50, seed=1)])
    y = np.concatenate([b[1] for b in global_batches(4, 50, seed=1)])
    with strategy.scope():
        fitted = SmallMLP(rngs=nnx.Rngs(0))
        trainer = mirrored.Trainer(
            fitted,
            optax.sgd(0.5),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
        )
    callbacks = [mirrored.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt"), monitor="loss")]
    # Logs read on the chief alone (a user's callback; TensorBoard's batch scalars and its
    # histograms, which the chief writes): every process must join the reads' collectives.
    callbacks.append(ChiefReads())
    tensorboard = os.path.join(args.out, "tb")
    callbacks.append(mirrored.callbacks.TensorBoard(tensorboard, histogram_freq=1, update_freq=2))
    if args.backup:
        callbacks.append(mirrored.callbacks.BackupAndRestore(args.backup, save_freq=3))
    if args.kill_rank >= 0:
        callbacks.append(KillAt(args.kill_at if rank == args.kill_rank else -1))
    history = trainer.fit(x, y, batch_size=32, epochs=3, callbacks=callbacks, verbose=1)
    predictions = trainer.predict(x[:37], batch_size=16)  # every process: it runs steps
    # 3. distribute_datasets_from_function, ragged differently on each process at the end:
    # replica r of step s takes per-replica batch 4s + r of one fixed list, in any layout.
    values = np.arange(1, 20, dtype=np.float32)
    sizes = [3, 3, 3, 3, 3, 1, 2, 1]  # per-replica batches of 3; then 3, 1, 2, 1 real rows
    parts = np.split(values, np.cumsum(sizes)[:-1])

    def dataset_fn(ctx):
        local = strategy.num_replicas_in_sync // ctx.num_input_pipelines
        return [
            part
            for j, part in enumerate(parts)
            if (j // local) % ctx.num_input_pipelines == ctx.input_pipeline_id
        ]

    def count_step(x):
        ctx = mirrored.get_replica_context()
        return ctx.example_count, mirrored.compute_average_loss(x)

    counts, means = [], []
    for x in strategy.distribute_datasets_from_function(dataset_fn):
        count, mean = strategy.run(count_step, args=(x,))
        counts.append(int(count))
        means.append(float(strategy.reduce("SUM", mean)))

    # 3b. The same with pipelines of different lengths and first batches: process 0 has
    # three steps of data, process 1 two (TensorFlow all-reduces "has data" every step).
    uneven = np.split(np.arange(1, 24, dtype=np.float32), np.cumsum([2, 1, 3, 3, 3, 3, 3, 2, 1]))

    def uneven_fn(ctx):
        local = strategy.num_replicas_in_sync // ctx.num_input_pipelines
        pipeline = ctx.input_pipeline_id
        return [
            p for j, p in enumerate(uneven) if (j // local) % ctx.num_input_pipelines == pipeline
        ]

    uneven_data = strategy.distribute_datasets_from_function(uneven_fn)
    uneven_counts, uneven_means = [len(uneven_data)], []
    for x in uneven_data:
        count, mean = strategy.run(count_step, args=(x,))
        uneven_counts.append(int(count))
        uneven_means.append(float(strategy.reduce("SUM", mean)))

    # 4. Unseeded initialisation (each process its own values, as a tutorial as written): the
    # first step broadcasts the chief's, so every process trains the same model.
    with strategy.scope():
        unseeded = SmallMLP(rngs=nnx.Rngs(100 + rank))
        unseeded_optimizer = nnx.Optimizer(unseeded, optax.adam(0.01), wrt=nnx.Param)
    for x, y in strategy.experimental_distribute_dataset(global_batches(2, 64, seed=2)):
        strategy.run(train_step, args=(unseeded, unseeded_optimizer, x, y))
    np.savez(os.path.join(args.out, f"unseeded.{rank}.npz"), **flat(unseeded))

    # 5. K steps per execution from in-memory arrays (read from the host on several
    # processes: K batches gathered at once, each process its rows), sample weights, ragged.
    def k3_trainer():
        return small_trainer(strategy, steps_per_execution=3)

    per_k = k3_trainer()
    chunked = per_k.model
    weights = np.linspace(0.5, 1.5, 190).astype(np.float32)
    x = np.concatenate([b[0] for b in global_batches(4, 50, seed=1)])[:190]
    y = np.concatenate([b[1] for b in global_batches(4, 50, seed=1)])[:190]
    k_history = per_k.fit(x, y, batch_size=32, sample_weight=weights, verbose=0)

    # 5b. The same arrays kept on the devices: the second fit places them, the second
    # evaluate too; each process its own copy. The chief's choice holds on every process
    # (here the others' own limit says "from the host"). The numbers are the host path's.
    head = x[:37]  # one array: a new slice at each call would be new arrays each time

    def fits_and_evaluates(budget):
        os.environ["MIRRORED_DEVICE_DATA_BYTES"] = budget
        trainer = k3_trainer()
        fits = [
            trainer.fit(x, y, batch_size=32, sample_weight=weights, verbose=0).history
            for _ in range(2)
        ]
        evaluations = [trainer.evaluate(x, y, batch_size=32) for _ in range(2)]
        predicted = [trainer.predict(head, batch_size=16) for _ in range(2)]
        return len(trainer._device_data.placed()), fits, evaluations, predicted, flat(trainer.model)

    kept = fits_and_evaluates(str(2**30) if strategy.is_chief else "0")
    host = fits_and_evaluates("0")
    del os.environ["MIRRORED_DEVICE_DATA_BYTES"]
    same = kept[1:3] == host[1:3] and np.array_equal(kept[3], host[3])  # both predicts
    same = same and all(np.array_equal(kept[4][k], host[4][k]) for k in host[4])
    print(f"device data placed {kept[0]} / {host[0]} equal {same}", flush=True)

    # 5c. run_steps over iter(dataset) of in-memory arrays: K batches gathered at once, each
    # process its rows; the numbers of the same epoch read one batch at a time.
    def run_steps_over(iterator):
        with strategy.scope():
            model = SmallMLP(rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        losses = []
        while (
            out := strategy.run_steps(train_step, iterator, steps=3, args=(model, optimizer))
        ) is not None:
            losses.extend(np.asarray(strategy.reduce("SUM", out, None)).tolist())
        return losses, flat(model)

    shuffled = strategy.experimental_distribute_dataset((x, y), batch_size=32, shuffle=True)
    at_once = iter(shuffled)  # epoch 1
    stacked_losses, stacked_model = run_steps_over(at_once)
    single_losses, single_model = run_steps_over(shuffled.epoch_iterator(1))
    same = stacked_losses == single_losses and len(single_losses) == 6
    same = same and all(np.array_equal(stacked_model[k], single_model[k]) for k in single_model)
    print(f"run_steps at once {at_once._steps} equal {same}", flush=True)
    if jax.process_count() > 1:  # TensorFlow's testReduceHostTensor: each worker's value once
        host_sum = strategy.reduce("SUM", 1.0 + jax.process_index(), axis=None)
        host_mean = strategy.reduce("MEAN", np.float32(1.0 + jax.process_index()), axis=None)
        print(f"host values summed {float(host_sum)} mean {float(host_mean)}", flush=True)

    # 5d. steps_per_execution="auto" on several processes: every process runs the K the
    # chief's times chose, on the same steps; the numbers of one step per program. Then a
    # K-step execution the chief finds slower (here its margin is 0, the other's 1e9): every
    # process goes back together. A callback reading every batch's logs on one process only
    # (before: that process ran the read's all-reduce alone, and gloo aborted the job): every
    # process runs one step per program and reads each batch's logs.
    from mirrored._train import auto_steps

    auto_steps.PAYBACK = 0  # any fit long enough to measure pays for its K-step program
    auto_steps.SLOWER = 1e9  # and its K-step execution is never timed slower (a loaded host)
    ax = np.random.default_rng(4).normal(size=(300, 12)).astype(np.float32)  # 38 steps of 8
    ay = np.random.default_rng(5).integers(0, 5, 300).astype(np.int32)
    aw = np.linspace(0.5, 1.5, 300).astype(np.float32)

    def auto_fit(spe="auto", callbacks=()):
        trainer = small_trainer(strategy, steps_per_execution=spe)
        history = trainer.fit(
            ax, ay, batch_size=8, sample_weight=aw, epochs=2, verbose=0, callbacks=callbacks
        )
        return trainer, history.history

    auto, auto_history = auto_fit()
    one, one_history = auto_fit(1)
    (measured,) = auto._auto_measured.values()
    same = flat(auto.model).keys() == flat(one.model).keys()
    same = same and all(np.array_equal(v, flat(one.model)[k]) for k, v in flat(auto.model).items())
    same = same and np.allclose(auto_history["loss"], one_history["loss"], rtol=1e-6)
    print(f"auto chose {measured.built} step {measured.step_s!r} equal {same}", flush=True)
    # evaluate under "auto" (75 steps of 4): its own measured step, the chief's, on both.
    evaluated = [auto.evaluate(ax, ay, sample_weight=aw, batch_size=4) for _ in range(2)]
    expected = one.evaluate(ax, ay, sample_weight=aw, batch_size=4)
    same = all(
        np.allclose([logs[k] for k in expected], list(expected.values()), rtol=1e-6)
        for logs in evaluated
    )
    (evaluation,) = [m for key, m in auto._auto_measured.items() if not key[0]]  # not fit's
    print(
        f"auto evaluated with K {evaluation.built} {evaluation.step_s!r} equal {same}", flush=True
    )
    auto_steps.SLOWER = 0.0 if strategy.is_chief else 1e9
    reverted, _ = auto_fit()
    (measured,) = reverted._auto_measured.values()
    print(f"auto reverted {measured.slower} after {measured.built}", flush=True)
    reads = Reads()
    one_sided, _ = auto_fit(callbacks=[] if strategy.is_chief else [reads])
    print(
        f"auto beside a per-batch callback {dict(one_sided._auto_measured)} "
        f"read {len(reads.losses)}",
        flush=True,
    )
    one_sided.evaluate(ax, ay, batch_size=32, callbacks=[] if strategy.is_chief else [reads])
    one_sided.predict(ax[:40], batch_size=16, callbacks=[] if strategy.is_chief else [reads])
    print(f"evaluate and predict beside it read {reads.losses[76:]}", flush=True)

    if strategy.is_chief:
        # A strategy over the chief's own devices (its evaluation, say): its first step has
        # no other process to agree with (before: a broadcast over every process, run by the
        # chief alone, and the job hung).
        own = mirrored.MirroredStrategy(jax.local_devices())
        with own.scope():
            alone = SmallMLP(rngs=nnx.Rngs(5))
            alone_opt = nnx.Optimizer(alone, optax.sgd(0.1), wrt=nnx.Param)
        ((ox, oy),) = list(own.experimental_distribute_dataset(global_batches(1, 8)))
        own.run(train_step, args=(alone, alone_opt, ox, oy))
        print(f"chief alone trained on {own.num_replicas_in_sync} replicas", flush=True)
        # ... and a Trainer on it: fit with a batch hook, fit under "auto", evaluate, predict
        # agree with no other process (before: they waited for the others' answers forever).
        own_trainer = small_trainer(own, seed=5, tx=optax.sgd(0.1))
        own_trainer.fit(ax, ay, batch_size=8, epochs=2, verbose=0, callbacks=[Reads()])
        own_trainer.fit(ax, ay, batch_size=8, epochs=2, verbose=0)
        own_trainer.evaluate(ax, ay, batch_size=32, callbacks=[Reads()])
        own_trainer.predict(ax[:40], batch_size=16, callbacks=[Reads()])
        (own_measured,) = own_trainer._auto_measured.values()
        print(f"chief alone fitted, K {own_measured.built}", flush=True)
        arrays = {f"loop/{k}": v for k, v in loop.items()}
        arrays.update({f"fit_k3/{k}": v for k, v in flat(chunked).items()})
        arrays.update({f"fit_auto/{k}": v for k, v in flat(auto.model).items()})
        arrays["fit_k3_loss"] = np.asarray(k_history.history["loss"])
        arrays.update({f"unseeded/{k}": v for k, v in flat(unseeded).items()})
        arrays["dff_counts"] = np.asarray(counts)
        arrays["dff_means"] = np.asarray(means)
        arrays["uneven_counts"] = np.asarray(uneven_counts)
        arrays["uneven_means"] = np.asarray(uneven_means)
        arrays.update({f"fit/{k}": v for k, v in flat(fitted).items()})
        arrays["loop_loss"] = np.asarray(total)
        arrays["fit_loss"] = np.asarray(history.history["loss"][-1])
        arrays["predict"] = predictions
        np.savez(os.path.join(args.out, "result.npz"), **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    main()
