"""A training loop in which one process stalls (test_hang.py).

    python _hang_script.py OUT [--workers] [--steps N] [--stall-rank R] [--stall-at K]
        [--how input|step|skip|slow] [--hang-timeout T] [--slow S] [--stall-once]

One process of 2 simulated devices (MirroredStrategy) or, with --workers, a
MultiWorkerMirroredStrategy worker of `mirrored launch`. SmallMLP, SGD, global batch i at
step i, read through a distributed dataset. At step K process R: `input` sleeps forever in
its input iterator; `step` sleeps forever in a host callback inside the step; `skip` skips
the step (a Python branch); `slow` sleeps S seconds before every step instead (it progresses:
never a hang); --stall-once: only before a restart. Every process writes its pid to
OUT/pid.RANK and prints the time it stalls.
"""

import argparse
import os
import time

import mirrored

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--workers", action="store_true")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--stall-rank", type=int, default=-1)
parser.add_argument("--stall-at", type=int, default=3)
parser.add_argument("--how", default="input", choices=["input", "step", "skip", "slow"])
parser.add_argument("--hang-timeout", type=float, default=None)
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--stall-once", action="store_true")  # not after a restart
args = parser.parse_args()

if args.workers:
    strategy = mirrored.MultiWorkerMirroredStrategy(hang_timeout=args.hang_timeout)
else:
    mirrored.simulate_cpu_devices(2)
    strategy = mirrored.MirroredStrategy(hang_timeout=args.hang_timeout)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP, global_batches, train_step  # noqa: E402

rank = jax.process_index()
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"pid.{rank}"), "w") as f:
    f.write(str(os.getpid()))
stalls = rank == args.stall_rank
if args.stall_once and os.environ.get("MIRRORED_RESTART_COUNT", "0") != "0":
    stalls = False

with strategy.scope():
    model = SmallMLP(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def stall(where):
    print(f"process {rank} stalls in {where} at {time.time():.3f}", flush=True)
    while True:
        time.sleep(1)


def source():
    for step, batch in enumerate(global_batches(args.steps, 16)):
        if stalls and step == args.stall_at and args.how == "input":
            stall("input")
        yield batch


def blocking(step):
    if stalls and int(step) == args.stall_at:
        stall("a host callback")


def step_with_callback(model, optimizer, x, y, step):
    jax.debug.callback(blocking, step)
    return train_step(model, optimizer, x, y)


for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(source())):
    if stalls and args.how == "slow":
        time.sleep(args.slow)
    if stalls and step == args.stall_at and args.how == "skip":
        print(f"process {rank} skips step {step} at {time.time():.3f}", flush=True)
        continue
    if args.how == "step":
        loss = strategy.run(step_with_callback, args=(model, optimizer, x, y, np.int32(step)))
    else:
        loss = strategy.run(train_step, args=(model, optimizer, x, y))
    total = float(strategy.reduce("SUM", loss, axis=None))
print(f"process {rank} done, loss {total:.4f}", flush=True)
