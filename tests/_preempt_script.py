"""A training loop under mirrored.PreemptionCheckpointHandler (test_preemption.py).

    python _preempt_script.py OUT_DIR [--workers] [--steps N] [--sigterm-rank R --sigterm-at K]
        [--exit-code C] [--no-save] [--grace S] [--watch-file PATH --touch-at K] [--pause S]
    [--die-rank R --die-at K] [--raise-rank R --raise-at K]

One process (MirroredStrategy) or, with --workers, a MultiWorkerMirroredStrategy worker of
`mirrored launch`. SmallMLP, Adam, global batch i at step i (the data position is the run
count). --sigterm-rank R --sigterm-at K: process R sends itself SIGTERM during step K; --die-rank
ends process R abruptly (os._exit(3)) and --raise-rank makes it raise a ValueError. The chief
writes the final parameters, the Adam count and the steps it ran to OUT_DIR/result.npz; every
process writes its pid to OUT_DIR/pid.RANK.
"""

import argparse
import os
import signal
import sys
import time

import mirrored

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--workers", action="store_true")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--sigterm-rank", type=int, default=-1)
parser.add_argument("--sigterm-at", type=int, default=-1)
parser.add_argument("--exit-code", type=int, default=None)
parser.add_argument("--no-save", action="store_true")
parser.add_argument("--watch-file", default="")
parser.add_argument("--pause", type=float, default=0.0)
parser.add_argument("--die-rank", type=int, default=-1)  # os._exit(3) at --die-at: a dead peer
parser.add_argument("--die-at", type=int, default=-1)  # seconds of host work per step
parser.add_argument("--touch-at", type=int, default=-1)
parser.add_argument("--grace", type=float, default=None)  # TerminationConfig(grace_period=)
parser.add_argument("--raise-rank", type=int, default=-1)  # raises ValueError at --raise-at
parser.add_argument("--raise-at", type=int, default=-1)
args = parser.parse_args()

if args.workers:
    strategy = mirrored.MultiWorkerMirroredStrategy()
else:
    mirrored.simulate_cpu_devices(args.devices)
    strategy = mirrored.MirroredStrategy()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP, global_batches, train_step  # noqa: E402

rank = jax.process_index()
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))

with strategy.scope():
    model = SmallMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

options = {}
if args.exit_code is not None:
    options["exit_fn"] = lambda: sys.exit(args.exit_code)
if args.no_save:
    options["save_fn"] = lambda: None
if args.grace is not None:
    options["grace_period"] = args.grace
if args.watch_file:
    options["termination_watcher_fn"] = lambda: os.path.exists(args.watch_file)
handler = mirrored.PreemptionCheckpointHandler(
    None,
    {"model": model, "optimizer": optimizer},
    os.path.join(args.out, "preemption"),
    mirrored.TerminationConfig(**options),
)
start = handler.total_run_calls
restart = os.environ.get("MIRRORED_RESTART_COUNT", "-")
print(f"process {rank} starts at step {start} (restart {restart})", flush=True)
batches = global_batches(args.steps, 32)


def distributed_step(step, x, y):
    if step == args.sigterm_at and rank == args.sigterm_rank:
        print(f"sigterm at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    if step == args.touch_at and rank == 0:
        open(args.watch_file, "w").close()
    if step == args.die_at and rank == args.die_rank:
        os._exit(3)
    if step == args.raise_at and rank == args.raise_rank:
        print(f"raising at {time.time():.3f}", flush=True)
        raise ValueError(f"boom in process {rank} at step {step}")
    time.sleep(args.pause)  # the notice takes a moment to reach every process
    loss = strategy.run(train_step, args=(model, optimizer, x, y))
    return strategy.reduce("SUM", loss, axis=None)


for step in range(start, args.steps):
    ((x, y),) = strategy.experimental_distribute_dataset([batches[step]])
    loss = handler.run(distributed_step, step, x, y)
    if args.die_rank >= 0 or args.raise_rank >= 0:
        print(f"process {rank} step {step} loss {float(loss):.6f}", flush=True)  # float() fails

if rank == 0:
    flat = {
        "/".join(map(str, path)): np.asarray(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state((model, optimizer)))
        if np.asarray(var.get_value()).dtype.kind in "fiu"
    }
    np.savez(os.path.join(args.out, "result.npz"), ran=np.asarray([start, args.steps]), **flat)
print(f"process {rank} done", flush=True)
