"""Every test runs on 8 simulated CPU devices (set before JAX starts its backend).

The suite compiles the same small programs many times (each test builds its own models and
strategies; the demo, examples and docs run as subprocesses): one persistent XLA compilation
cache for the session (mirrored.config's), inherited by the subprocesses and shared by
pytest-xdist's workers, compiles each program once.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras tests (mirrored.keras): before any import
# XLA:CPU without LLVM's optimisation passes: the suite's programs are small and run a few
# steps, so compiling is most of their time (measured: compile-heavy files 19-34% faster).
# Before the backend starts; the subprocesses get the same flag (`_helpers.subprocess_env`),
# so references computed there are compiled alike.
from _helpers import TEST_XLA_FLAGS

if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax

import mirrored

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("MIRRORED_COMPILATION_CACHE"):
    # A pytest-xdist worker (`make test` runs two): the controller's cache, shared by all.
    _CACHE = os.environ["MIRRORED_COMPILATION_CACHE"]
else:
    _CACHE = tempfile.mkdtemp(prefix="mirrored-tests-xla-cache-")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# mirrored's own cache settings (every program, locked writes: the multi-process tests write
# it at once), here and in the subprocesses, which never touch the user's ~/.cache.
os.environ["MIRRORED_COMPILATION_CACHE"] = _CACHE
mirrored.config.set_compilation_cache(_CACHE)

jax.config.update("jax_platforms", "cpu")
mirrored.simulate_cpu_devices(8)

import pytest  # noqa: E402


@pytest.fixture
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, "conftest must simulate 8 CPU devices before JAX starts"
    return found
