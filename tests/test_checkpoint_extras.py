"""Checkpoints of any state: extras saved with the model, latest_checkpoint, how many are kept."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored


class Tiny(nnx.Module):
    def __init__(self, seed=0):
        self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(seed))

    def __call__(self, x):
        return self.linear(x)


def make(devices, seed=0):
    with mirrored.MirroredStrategy(devices).scope():
        model = Tiny(seed)
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, optimizer


def steps_on_disk(directory):
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def interrupted_save(directory, step):
    """What an interrupted save leaves, as this Orbax writes it: a renamed-never temporary
    step directory with its metadata and a temporary item directory."""
    tmp = directory / f"{step}.orbax-checkpoint-tmp"
    (tmp / "default.orbax-checkpoint-tmp").mkdir(parents=True)
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")


@pytest.fixture(scope="module")
def model(devices_module):
    return make(devices_module)[0]


@pytest.fixture(scope="module")
def devices_module():
    return jax.devices()


# -- extras --------------------------------------------------------------------------------


def test_extras_come_back_with_their_types(model, tmp_path):
    extras = {
        "epoch": 3,
        "negative": -(2**63),
        "learning_rate": 0.1,
        "whole_float": 2.0,
        "finished": False,
        "run_name": "héllo wörld",
        "empty": "",
        "numpy_vector": np.arange(6, dtype=np.float32).reshape(2, 3),
        "numpy_scalar": np.int32(7),
        "jax_vector": jnp.array([1.5, 2.5], jnp.bfloat16),
        "jax_scalar": jnp.asarray(True),
    }
    mirrored.save_checkpoint(tmp_path, model, step=10, extras=extras)
    got = mirrored.checkpoint_extras(tmp_path)
    assert got.keys() == extras.keys()
    for name in ("epoch", "negative", "learning_rate", "whole_float", "finished", "run_name"):
        assert type(got[name]) is type(extras[name]) and got[name] == extras[name], name
    assert got["empty"] == ""
    for name in ("numpy_vector", "numpy_scalar", "jax_vector", "jax_scalar"):
        expected = np.asarray(extras[name])
        assert type(got[name]) is np.ndarray, name
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        np.testing.assert_array_equal(got[name], expected)


def test_a_checkpoint_without_extras_has_none(model, tmp_path):
    mirrored.save_checkpoint(tmp_path, model, step=1)
    assert mirrored.checkpoint_extras(tmp_path) == {}
    assert mirrored.restore_checkpoint(tmp_path, model) == 1


def test_saved_on_8_replicas_restores_on_2_with_its_extras(devices_module, tmp_path):
    model, optimizer = make(devices_module, seed=1)
    # Give Adam's moments values that differ from a fresh optimizer's.
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    mirrored.save_checkpoint(
        tmp_path, model, optimizer, step=10, extras={"epoch": 3, "step_in_epoch": 5}
    )
    two = devices_module[:2]
    restored, restored_optimizer = make(two, seed=2)
    path = mirrored.latest_checkpoint(tmp_path)
    assert mirrored.restore_checkpoint(path, restored, restored_optimizer) == 10
    assert mirrored.checkpoint_extras(path) == {"epoch": 3, "step_in_epoch": 5}
    np.testing.assert_array_equal(restored.linear.kernel[...], model.linear.kernel[...])
    np.testing.assert_array_equal(
        restored_optimizer.opt_state[0].mu["linear"]["kernel"][...],
        optimizer.opt_state[0].mu["linear"]["kernel"][...],
    )
    kernel = restored.linear.kernel.get_value()
    assert kernel.sharding.device_set == set(two) and kernel.sharding.is_fully_replicated


def test_extras_and_state_of_an_older_step(model, tmp_path):
    for step in (1, 2, 3):
        mirrored.save_checkpoint(tmp_path, model, step=step, max_to_keep=3, extras={"at": step})
    assert mirrored.checkpoint_extras(tmp_path) == {"at": 3}
    assert mirrored.checkpoint_extras(tmp_path, step=2) == {"at": 2}
    assert mirrored.checkpoint_extras(tmp_path / "1") == {"at": 1}
    assert mirrored.restore_checkpoint(tmp_path / "1", model) == 1
    assert mirrored.restore_checkpoint(tmp_path / "2", model, step=2) == 2
    with pytest.raises(ValueError, match=r"step directory .*Fix"):
        mirrored.restore_checkpoint(tmp_path / "1", model, step=3)
    with pytest.raises(FileNotFoundError, match=r"Expected checkpoint 7 .*found \[1, 2, 3\]"):
        mirrored.checkpoint_extras(tmp_path, step=7)


@pytest.mark.parametrize(
    ("extras", "error", "match"),
    [
        ({"epoch": object()}, TypeError, r"extras\['epoch'\].*found object"),
        ({"epoch": None}, TypeError, r"found NoneType"),
        ({"history": [1, 2]}, TypeError, r"found list.*several extras"),
        ({"config": {"a": 1}}, TypeError, r"found dict"),
        ({"names": np.array(["a", "b"])}, TypeError, r"found dtype <U1.*Python str"),
        ({"nothing": np.zeros((0, 3))}, ValueError, r"non-empty.*\(0, 3\)"),
        ({"huge": 2**63}, ValueError, r"int64.*str\(value\)"),
        ({"key": jax.random.key(0)}, TypeError, r"random keys.*key_data"),
        ({"my-epoch": 1}, ValueError, r"identifiers.*'my-epoch'"),
        ([("epoch", 1)], TypeError, r"dict of names.*found list"),
    ],
)
def test_bad_extras_are_refused_before_anything_is_written(model, tmp_path, extras, error, match):
    with pytest.raises(error, match=match) as raised:
        mirrored.save_checkpoint(tmp_path, model, extras=extras)
    message = str(raised.value)
    assert message.startswith("Expected ") and "found" in message and "Fix:" in message
    assert mirrored.latest_checkpoint(tmp_path) is None
    assert not tmp_path.exists() or os.listdir(tmp_path) == []


# -- latest_checkpoint ---------------------------------------------------------------------


def test_latest_checkpoint_of_a_missing_or_empty_directory_is_none(tmp_path):
    missing = tmp_path / "missing"
    assert mirrored.latest_checkpoint(missing) is None
    assert not missing.exists()  # looking created nothing
    assert mirrored.latest_checkpoint(tmp_path) is None
    with pytest.raises(FileNotFoundError, match="Expected a checkpoint directory.*Fix"):
        mirrored.checkpoint_extras(missing)
    assert not missing.exists()


def test_latest_checkpoint_is_the_newest_complete_step(model, tmp_path):
    for step in (2, 4, 6, 8):
        mirrored.save_checkpoint(tmp_path, model, step=step, max_to_keep=3)
    assert mirrored.latest_checkpoint(tmp_path) == str(tmp_path / "8")
    interrupted_save(tmp_path, 9)
    assert mirrored.latest_checkpoint(tmp_path) == str(tmp_path / "8")
    assert mirrored.restore_checkpoint(tmp_path, model) == 8
    assert mirrored.latest_checkpoint(str(tmp_path) + "/") == str(tmp_path / "8")


def test_a_directory_named_like_a_step_that_holds_steps_is_a_checkpoint_directory(model, tmp_path):
    # What ModelCheckpoint("ckpt/{epoch}") writes: ckpt/1/1, ckpt/2/2.
    for epoch in (1, 2):
        mirrored.save_checkpoint(tmp_path / str(epoch), model, step=epoch, extras={"e": epoch})
    assert mirrored.latest_checkpoint(tmp_path / "1") == str(tmp_path / "1" / "1")
    assert mirrored.checkpoint_extras(tmp_path / "1") == {"e": 1}
    assert mirrored.restore_checkpoint(tmp_path / "2", model) == 2


# -- how many are kept ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_to_keep", "kept"), [(1, [5]), (3, [3, 4, 5]), (None, [1, 2, 3, 4, 5])]
)
def test_max_to_keep_is_honoured(model, tmp_path, max_to_keep, kept):
    for step in range(1, 6):
        mirrored.save_checkpoint(tmp_path, model, step=step, max_to_keep=max_to_keep)
    assert steps_on_disk(tmp_path) == kept


@pytest.mark.parametrize("max_to_keep", [0, -1, 2.0, True, "3"])
def test_a_bad_max_to_keep_is_refused(model, tmp_path, max_to_keep):
    with pytest.raises(ValueError, match=r"Expected max_to_keep.*found.*Fix"):
        mirrored.save_checkpoint(tmp_path, model, max_to_keep=max_to_keep)
    with pytest.raises(ValueError, match=r"Expected max_to_keep"):
        mirrored.callbacks.ModelCheckpoint(tmp_path, max_to_keep=max_to_keep)


@pytest.mark.parametrize(("options", "kept"), [({}, [3]), ({"max_to_keep": 2}, [2, 3])])
def test_model_checkpoint_keeps_max_to_keep_epochs(devices_module, tmp_path, options, kept):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    with mirrored.MirroredStrategy(devices_module).scope():
        trainer = mirrored.Trainer(Tiny(), optax.sgd(0.1), "mse")
    callback = mirrored.callbacks.ModelCheckpoint(tmp_path, monitor="loss", **options)
    trainer.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[callback])
    assert steps_on_disk(tmp_path) == kept


def test_saving_an_existing_step_replaces_it_as_keras_overwrites(tmp_path):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    mirrored.save_checkpoint(tmp_path, model, step=1, extras={"run": 1})
    model.bias[...] = model.bias[...] + 1.0
    mirrored.save_checkpoint(tmp_path, model, step=1, extras={"run": 2})  # was an Orbax error
    assert mirrored.checkpoint_extras(tmp_path) == {"run": 2}
    restored = nnx.Linear(2, 2, rngs=nnx.Rngs(5))
    mirrored.restore_checkpoint(tmp_path, restored)
    np.testing.assert_array_equal(np.asarray(restored.bias[...]), np.asarray(model.bias[...]))
    assert sorted(os.listdir(tmp_path)) == ["1"]


def test_latest_checkpoint_ignores_keras_style_per_epoch_directories(tmp_path):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    mirrored.save_checkpoint(tmp_path / "ckpt_0003", model, step=3)
    assert mirrored.latest_checkpoint(tmp_path) is None  # ckpt_0003 is a directory, not a step
    assert mirrored.latest_checkpoint(tmp_path / "ckpt_0003") == str(tmp_path / "ckpt_0003" / "3")


# -- restores are all or nothing (issue 33, item 5) ---------------------------------------------


class _TwoLayers(nnx.Module):
    def __init__(self, classes, rngs):
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, classes, rngs=rngs)


def test_a_restore_into_another_architecture_changes_nothing(devices, tmp_path):
    """A 7-class checkpoint into a 5-class model: the clear error came after `l1` was already
    overwritten (a half-restored model)."""
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        saved, target = _TwoLayers(7, nnx.Rngs(0)), _TwoLayers(5, nnx.Rngs(1))
    mirrored.save_checkpoint(tmp_path, saved)
    before = jax.tree.map(np.asarray, nnx.state(target))
    with pytest.raises(
        ValueError, match=r"of another shape; other shapes: 'model/l2.*Nothing was restored"
    ):
        mirrored.restore_checkpoint(tmp_path, target)
    after = jax.tree.map(np.asarray, nnx.state(target))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))


def test_keras_models_without_variables_are_refused_with_the_fix(devices, tmp_path):
    """A Sequential without an input shape (examples/keras_custom_loop.py's model) has no
    variables until its first call: restoring into it returned the step and restored nothing
    (outputs 3.2 off the saved model); saving it failed in Orbax ("Found empty item")."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    import mirrored.keras

    strategy = mirrored.MirroredStrategy(devices)
    x = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)

    def model():
        return keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])

    with strategy.scope():
        built, lazy = model(), model()
        built(x[:1])
    mirrored.save_checkpoint(tmp_path / "built", built)
    with pytest.raises(ValueError, match=r"(?s)has none yet.*Fix: build it first"):
        mirrored.restore_checkpoint(tmp_path / "built", lazy)
    with pytest.raises(ValueError, match=r"(?s)nothing to save.*model\(x\[:1\]\)"):
        mirrored.save_checkpoint(tmp_path / "lazy", lazy)
    assert not (tmp_path / "lazy").exists() or not any((tmp_path / "lazy").iterdir())
    with strategy.scope():
        lazy(x[:1])  # the fix the message names
    mirrored.restore_checkpoint(tmp_path / "built", lazy)
    np.testing.assert_allclose(np.asarray(lazy(x)), np.asarray(built(x)), rtol=1e-6)
