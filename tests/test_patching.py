"""The one list of patches: every target of Keras, Flax and JAX that mirrored replaces still
exists in the pinned versions and is the framework's own before mirrored patches it."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import subprocess_env

SRC = Path(__file__).resolve().parents[1] / "src" / "mirrored"

# Runs where nothing has imported mirrored yet: what each target is before any patch.
PROBE = r"""
import json, os
os.environ["KERAS_BACKEND"] = "jax"
import mirrored  # Keras not imported yet: nothing of Keras is patched
from mirrored._core import patching

def origin(value):
    value = getattr(value, "fget", value)  # a property: its getter
    return getattr(value, "__module__", None) or type(value).__module__

def temporary(targets):
    # Targets applied only while a step is traced: what each is now.
    found = {}
    for t in targets:
        owner = patching.resolve(t.owner)
        value = vars(owner).get(t.name)
        # Data (a table of rules) has no module of its own: the module that holds it.
        inner = getattr(value, "fget", value)
        found[str(t)] = None if value is None else origin(value) if callable(inner) else t.owner
    return found

before = temporary(patching.TARGETS)
import keras  # mirrored.keras installs itself: declares and applies Keras' patches
applied = {id(t) for t, _, _ in patching.applied()}
later = temporary(t for t in patching.TARGETS if str(t) not in before and id(t) not in applied)
permanent = {}
for t, cls, original in patching.applied():
    current = getattr(cls, t.name)
    where = getattr(cls, "__qualname__", None) or cls.__name__
    permanent[f"{getattr(cls, '__module__', None) or cls.__name__}.{where}.{t.name}"] = {
        "framework": t.framework,
        "original": None if original is None else origin(original),
        "replaced": current is not original,
        "adds": t.adds,
    }
print(json.dumps({
    "temporary": {**before, **later},
    "permanent": permanent,
    "declared": sorted(str(t) for t in patching.TARGETS),
    "reasons": all(t.reason and t.checked for t in patching.TARGETS),
}))
"""


@pytest.fixture(scope="module")
def probe():
    result = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_temporary_target_exists_and_is_the_frameworks_own(probe):
    assert probe["temporary"], "no Flax or JAX target declared"
    for target, origin in probe["temporary"].items():
        framework = target.split(".")[0]
        assert origin is not None, f"{target} does not exist in the installed {framework}"
        assert origin.startswith(framework), (target, origin)


def test_every_permanent_patch_replaced_the_frameworks_own(probe):
    permanent = probe["permanent"]
    assert len(permanent) >= 20, sorted(permanent)  # Keras' loops, layers, losses, optimizers
    for where, patch in permanent.items():
        assert patch["replaced"], where
        if patch["adds"]:
            assert patch["original"] is None, where  # Keras defines no such attribute
        else:
            assert patch["original"].startswith(patch["framework"]), (where, patch)


def test_every_target_says_why_and_against_which_versions(probe):
    assert probe["reasons"]
    declared = set(probe["declared"])
    for expected in (
        "keras.metrics.Metric.update_state",
        "flax.nnx.BatchNorm.__call__",
        "flax.nnx.RNN.__call__",
        "flax.nnx.Optimizer.update",
        "jax._src.shard_map.api",
        "keras.src.losses.loss.Loss.__call__",
        "keras.layers.BatchNormalization._moments",
        "keras.src.backend.jax.trainer.JAXTrainer.fit",
    ):
        assert expected in declared


def test_patches_go_through_the_helper():
    """`patched_attribute` (the lock-protected temporary patch) is used by the helper only."""
    users = [
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if "patched_attribute(" in p.read_text()
    ]
    assert sorted(users) == ["_core/context.py", "_core/patching.py"]


def test_an_untested_keras_major_version_warns_once_naming_the_range(caplog):
    import mirrored.keras  # noqa: F401
    from mirrored.keras import _install

    with caplog.at_level(logging.WARNING, logger="mirrored"):
        assert _install.check_version("3.15.1")
        assert not caplog.records
        assert not _install.check_version("4.0.0")
        assert not _install.check_version("4.0.0")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert ">=3.15,<4" in messages[0] and "4.0.0" in messages[0] and "Fix:" in messages[0]
