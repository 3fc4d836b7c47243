"""`import mirrored` before `import keras` with KERAS_BACKEND unset selects the JAX backend
(Keras would try TensorFlow first and fail without it); a backend the user chose is left alone
(issue 33, item 10)."""

import subprocess
import sys

import pytest

from _helpers import subprocess_env

SCRIPT = """
import logging, os
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import mirrored
import keras
print("BACKEND", keras.backend.backend(), os.environ.get("KERAS_BACKEND"))
"""


def _run(backend, script=SCRIPT):
    env = {k: v for k, v in subprocess_env().items() if k != "KERAS_BACKEND"}
    if backend is not None:
        env["KERAS_BACKEND"] = backend
    done = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return done


def test_an_unset_backend_becomes_jax_with_one_info_line():
    done = _run(None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BACKEND jax jax" in done.stdout
    notes = [line for line in done.stderr.splitlines() if "KERAS_BACKEND was not set" in line]
    assert len(notes) == 1 and notes[0].startswith("mirrored:")


@pytest.mark.parametrize("backend", ["numpy"])
def test_a_backend_the_user_chose_is_left_alone(backend):
    done = _run(backend)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"BACKEND {backend} {backend}" in done.stdout
    assert "KERAS_BACKEND was not set" not in done.stderr
    # mirrored says it distributes Keras models on JAX only (once Keras is imported).
    assert "the JAX backend only" in done.stderr


def test_mirrored_keras_under_another_backend_is_a_clear_error():
    """Keras imported with another backend: `mirrored.keras` refuses with the fix."""
    done = _run("numpy", "import keras, mirrored\nimport mirrored.keras\n")
    assert done.returncode == 1
    assert "ImportError: mirrored distributes Keras 3 models on the JAX backend" in done.stderr
    assert "'numpy' backend" in done.stderr and "KERAS_BACKEND=jax" in done.stderr
