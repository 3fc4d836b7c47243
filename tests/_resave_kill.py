"""Re-save checkpoint 1 of DIRECTORY with VALUE (python _resave_kill.py DIRECTORY VALUE HOOK
[new]), killing this process with SIGKILL at HOOK (test_checkpoint_kills.py):

    aside          the old step 1 moved aside, before the new save starts
    half           the new save's temporary directory holding part of the new state
    before_rename  the new save written, before Orbax renames it into step 1
    renamed        the new step 1 complete, before the old copy is deleted

With `new`, save step 2 instead, keeping one (max_to_keep=1, as a preemption checkpoint and
BackupAndRestore do): `renamed` is then step 2 complete, before Orbax deletes step 1.
"""

import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
from flax import nnx

import mirrored

DIRECTORY, VALUE, HOOK = sys.argv[1], float(sys.argv[2]), sys.argv[3]
NEW = sys.argv[4:] == ["new"]
SIZE = 2300  # a 2300 x 2300 float32 kernel: 21 MB


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def model(value: float) -> nnx.Linear:
    layer = nnx.Linear(SIZE, SIZE, rngs=nnx.Rngs(0))
    layer.kernel[...] = np.full((SIZE, SIZE), value, np.float32)
    layer.bias[...] = np.full((SIZE,), value, np.float32)
    return layer


def temporary_bytes() -> int:
    total = 0
    for name in os.listdir(DIRECTORY):
        if ".orbax-checkpoint-tmp" in name:
            for root, _, files in os.walk(os.path.join(DIRECTORY, name)):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def kill_when_half_written() -> None:
    while True:
        try:
            if 0 < temporary_bytes() < SIZE * SIZE * 4:
                die()
        except OSError:
            pass
        time.sleep(0.0002)


if HOOK == "aside":
    replace = os.replace

    def replace_then_die(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        if str(dst).endswith(".mirrored-replaced"):
            die()

    os.replace = replace_then_die
elif HOOK == "renamed" and NEW:
    from orbax.checkpoint._src.path import deleter

    def die_before_deleting_the_old_step(self, *args, **kwargs):
        die()

    deleter.StandardCheckpointDeleter.delete = die_before_deleting_the_old_step
    deleter.StandardCheckpointDeleter.delete_steps = die_before_deleting_the_old_step
elif HOOK == "renamed":
    rmtree = shutil.rmtree

    def die_before_deleting_the_old_copy(path, *args, **kwargs):
        if str(path).endswith(".mirrored-replaced") and os.path.isdir(path):
            die()
        rmtree(path, *args, **kwargs)

    shutil.rmtree = die_before_deleting_the_old_copy
elif HOOK == "before_rename":
    from orbax.checkpoint._src.path import atomicity

    async def die_before_the_rename(self, *args, **kwargs):
        die()

    atomicity.AtomicRenameTemporaryPath.finalize = die_before_the_rename
elif HOOK == "half":
    threading.Thread(target=kill_when_half_written, daemon=True).start()
else:
    raise SystemExit(f"unknown hook {HOOK!r}")

mirrored.save_checkpoint(DIRECTORY, model(VALUE), step=2 if NEW else 1, extras={"value": VALUE})
print("saved without being killed")  # the test fails on this
