"""A checkpoint is complete or absent, also when the process is killed (issue 35, item 7):
re-saving an existing step (a rerun's ModelCheckpoint) killed at each moment of the swap finds
the previous or the new copy, never nothing; leftovers are cleaned by the next save."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import mirrored
from _helpers import subprocess_env

SCRIPT = Path(__file__).with_name("_resave_kill.py")
SIZE = 2300  # as _resave_kill.py: 21 MB of state


def _model(value):
    layer = nnx.Linear(SIZE, SIZE, rngs=nnx.Rngs(0))
    layer.kernel[...] = np.full((SIZE, SIZE), value, np.float32)
    layer.bias[...] = np.full((SIZE,), value, np.float32)
    return layer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoint 1 holding 1.0 everywhere."""
    directory = tmp_path_factory.mktemp("saved")
    mirrored.save_checkpoint(directory, _model(1.0), step=1, extras={"value": 1.0})
    return directory


def _killed_save(saved, tmp_path, hook, *mode):
    """A copy of `saved`, then _resave_kill.py's save of 2.0 into it, SIGKILLed at `hook`."""
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(directory), "2.0", hook, *mode],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == -signal.SIGKILL, (run.returncode, run.stdout, run.stderr[-2000:])
    return directory


# Where the kill lands, and which copy of step 1 must be found after it.
HOOKS = {"aside": 1.0, "half": 1.0, "before_rename": 1.0, "renamed": 2.0}


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_a_resave_killed_midway_finds_a_complete_copy_and_cleans_up(saved, tmp_path, hook):
    """Before: a kill after the old copy was moved aside left only `1.mirrored-replaced` (and
    Orbax's temporary directory): latest_checkpoint None, restore 'found none'."""
    directory = _killed_save(saved, tmp_path, hook)
    expected = HOOKS[hook]

    assert mirrored.latest_checkpoint(directory) == str(directory / "1")
    restored = _model(0.0)
    assert mirrored.restore_checkpoint(directory, restored) == 1
    np.testing.assert_array_equal(restored.kernel[...], np.full((SIZE, SIZE), expected))
    np.testing.assert_array_equal(restored.bias[...], np.full((SIZE,), expected))
    assert mirrored.checkpoint_extras(directory) == {"value": expected}  # a consistent step

    mirrored.save_checkpoint(directory, _model(3.0), step=2)  # the next save cleans up
    assert sorted(os.listdir(directory)) == ["2"]


# A save of a new step, keeping one (a preemption checkpoint, BackupAndRestore): the step found.
NEW_STEP_HOOKS = {"half": 1, "before_rename": 1, "renamed": 2}


@pytest.mark.parametrize("hook", sorted(NEW_STEP_HOOKS))
def test_a_new_save_killed_midway_restores_the_previous_or_the_new_step(saved, tmp_path, hook):
    """Step 1 (1.0) on disk, step 2 (2.0) saved with max_to_keep=1 and killed at `hook`: the
    restore finds step 1 or step 2 whole, with its own extras, never a mix; the next save
    removes the leftovers."""
    directory = _killed_save(saved, tmp_path, hook, "new")
    step = NEW_STEP_HOOKS[hook]

    assert mirrored.latest_checkpoint(directory) == str(directory / str(step))
    restored = _model(0.0)
    assert mirrored.restore_checkpoint(directory, restored) == step
    np.testing.assert_array_equal(restored.kernel[...], np.full((SIZE, SIZE), float(step)))
    np.testing.assert_array_equal(restored.bias[...], np.full((SIZE,), float(step)))
    assert mirrored.checkpoint_extras(directory) == {"value": float(step)}

    mirrored.save_checkpoint(directory, _model(3.0), step=3)  # the next save cleans up
    assert sorted(os.listdir(directory)) == ["3"]
