"""Checkpoints of mirrored state with Orbax: atomic, and restorable on any number of replicas.

State is saved as host arrays keyed by variable path, so a checkpoint written by 8 replicas is
placed onto 2 (or 1) when restored. Each save is a new Orbax step directory that becomes
visible only when complete; older steps are deleted after it, so a crash mid-save leaves the
previous checkpoint usable. Extra values (an epoch, a position in the data) are saved in the
same step, under `extras/`, so they are complete or absent with the state they describe.
"""

from __future__ import annotations

import os
import reprlib
import shutil
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mirrored._core import context as _context
from mirrored._core import heartbeat, hooks
from mirrored._core import mesh as _mesh
from mirrored._core.leaves import is_hollow, is_key, raw_array
from mirrored._core.mesh import is_per_replica_state, is_sharded_variable


def is_chief() -> bool:
    """Whether this process writes files (process 0)."""
    return jax.process_index() == 0


def _is_keras(obj: Any) -> bool:
    if "keras" not in sys.modules:
        return False
    import keras

    return isinstance(obj, keras.layers.Layer | keras.optimizers.Optimizer)


class _KerasVariable:
    """A Keras variable behind the two calls the checkpoint code makes of an NNX one."""

    def __init__(self, variable: Any) -> None:
        self._variable = variable

    def get_value(self) -> Any:
        value = self._variable._value
        if value is None:
            raise ValueError(
                f"Expected the Keras variable {self._variable.path!r} to hold a value; found "
                "none (Keras releases them during fit). Fix: save from a callback's "
                "on_epoch_end, or after fit returns."
            )
        return value

    def set_value(self, value: Any) -> None:
        self._variable.assign(value)


def _flat_state(prefix: str, obj: Any) -> dict[str, Any]:
    if _is_keras(obj):
        if hasattr(obj, "jax_state_sync"):
            obj.jax_state_sync()  # a model mid-fit: its latest values back on its variables
        # By position, as TensorFlow's object-graph checkpoints: Keras numbers its names per
        # process (dense_4/kernel), so the same architecture built again has other paths.
        import keras

        layer = isinstance(obj, keras.layers.Layer)
        return {
            f"{prefix}/{i:04d}_{variable.name if layer else 'slot'}": _KerasVariable(variable)
            for i, variable in enumerate(obj.variables)
        }
    return {
        f"{prefix}/" + "/".join(map(str, path)): var
        for path, var in nnx.to_flat_state(nnx.state(obj))
        if not is_hollow(var.get_raw_value())  # Optax's MaskedNode: nothing to save
    }


def check_built(objects: dict[str, Any], action: str) -> None:
    """Refuse a Keras model that has not built its variables yet: it would save nothing, and a
    restore into it would restore nothing (and return as if it had)."""
    model = objects.get("model")
    if not _is_keras(model) or getattr(model, "built", True):
        return
    raise ValueError(
        f"Expected a Keras model with its variables to {action}; found {type(model).__name__} "
        f"{getattr(model, 'name', '')!r}, which has none yet (a Sequential without an input "
        "shape, or a subclassed model, creates them on its first call), so there is nothing to "
        f"{action}. Nothing was changed.\n"
        "Fix: build it first, in the strategy's scope: `model.build((None, *features))`, or "
        "call it once on a batch, `model(x[:1])`; then "
        f"{action} (and, with an optimizer, `optimizer.build(model.trainable_variables)`)."
    )


def state_arrays(objects: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every variable of the named NNX objects as a host array, keyed `name/path/to/var`."""
    flat: dict[str, Any] = {}
    for prefix, obj in objects.items():
        flat.update(
            {k: _host_if_split(_saved_form(v)) for k, v in _flat_state(prefix, obj).items()}
        )
    return {k: np.asarray(v) for k, v in jax.device_get(flat).items()}


def _host_if_split(value: Any) -> Any:
    """A leaf split over several processes' devices (a ShardedOptimizer's state), on the
    host as a whole; one leaf at a time, so the devices never hold the whole state."""
    if (
        isinstance(value, jax.Array)
        and not value.is_fully_addressable
        and not value.is_fully_replicated
    ):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return value


def _saved_form(variable: Any) -> Any:
    """What a checkpoint holds of a variable: per-replica state (a row per replica: the
    Trainer's local gradient sums) as the sum of its rows, like TensorFlow's SYNC_ON_READ SUM
    variables, so it restores onto any replica count; anything else (a ShardedOptimizer's
    split state too) whole, as it is."""
    value = raw_array(variable.get_value())
    if not _per_replica(variable, value):
        return value
    return jax.jit(
        lambda rows: rows.sum(axis=0), out_shardings=_mesh.replicated(value.sharding.mesh)
    )(value)


def _per_replica(variable: Any, value: Any) -> bool:
    return is_per_replica_state(value) and not is_sharded_variable(variable)


def _placed_rows(value: np.ndarray, current: jax.Array) -> jax.Array:
    """A saved sum of per-replica rows, back as rows: all of it in the first replica's row."""
    rows = np.zeros(current.shape, current.dtype)
    rows[0] = value
    return jax.make_array_from_callback(current.shape, current.sharding, lambda index: rows[index])


class CorruptCheckpointError(ValueError):
    """A checkpoint's files cannot be read (truncated, corrupt)."""


def load_state_arrays(objects: dict[str, Any], arrays: dict[str, np.ndarray], source: str) -> None:
    """Write `arrays` (from `state_arrays`) into the objects' variables, placed as they are.

    Each value lands with the sharding of the variable it replaces, so state saved by 8
    replicas restores onto a model mirrored on 2 (or on one device).
    """
    flat = {prefix: _flat_state(prefix, obj) for prefix, obj in objects.items()}
    # Every key and shape checked before the first write: a mismatch changes nothing.
    missing, wrong = [], []
    for variables in flat.values():
        for key, var in variables.items():
            if key not in arrays:
                missing.append(key)
                continue
            current = raw_array(var.get_value())
            expected = current.shape[1:] if _per_replica(var, current) else current.shape
            if arrays[key].shape != expected:
                wrong.append(f"{key!r}: target {expected}, checkpoint {arrays[key].shape}")
    if missing or wrong:
        raise ValueError(
            f"Expected the checkpoint at {source} to hold every variable of the target with its "
            f"shape; found {len(missing)} missing and {len(wrong)} of another shape"
            + (f"; missing: {', '.join(map(repr, missing[:3]))}" if missing else "")
            + (" ..." if len(missing) > 3 else "")
            + (f"; other shapes: {'; '.join(wrong[:3])}" if wrong else "")
            + (" ..." if len(wrong) > 3 else "")
            + ". It was saved from a different model or optimizer. Nothing was restored. Fix: "
            "restore into the architecture (and optimizer) that was saved, or restore the "
            "model alone (without the optimizer) from a checkpoint saved without one."
        )
    for prefix, obj in objects.items():
        state = None if _is_keras(obj) else nnx.state(obj)
        for key, var in flat[prefix].items():
            value, current = arrays[key], var.get_value()
            if _per_replica(var, current):
                var.set_value(_placed_rows(value.astype(current.dtype), current))
            elif is_key(current):
                data = jax.device_put(value.astype(np.uint32), current.sharding)
                var.set_value(jax.random.wrap_key_data(data, impl=jax.random.key_impl(current)))
            else:
                var.set_value(jax.device_put(value.astype(current.dtype), current.sharding))
        if state is not None:
            nnx.update(obj, state)


_EXTRAS = "extras/"
_INT64_RANGE = range(-(2**63), 2**63)  # Orbax stores Python ints as int64


def check_max_to_keep(max_to_keep: Any) -> None:
    """Refuse a `max_to_keep` that is not a positive int or None."""
    if max_to_keep is not None and (
        isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
        raise ValueError(
            f"Expected max_to_keep to be a positive int, or None to keep every checkpoint; "
            f"found {max_to_keep!r}. Fix: e.g. max_to_keep=3 keeps the newest three."
        )


def check_step(step: Any) -> None:
    """A checkpoint's step names its directory and orders it: a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(
            f"Expected step to be an int >= 0 (it names the checkpoint's directory and orders "
            f"checkpoints: the newest is the largest); found {step!r}. Fix: e.g. step=epoch; "
            "to keep a 'best' checkpoint apart, save it in its own directory."
        )


def _extra_value(name: Any, value: Any) -> Any:
    """`value` as Orbax saves it; refuses what would not come back as it was."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"Expected the names of extras to be Python identifiers, as the keyword names of "
            f"tf.train.Checkpoint(epoch=...); found {name!r}. Fix: rename it, e.g. "
            "'step_in_epoch'."
        )
    where = f"extras[{name!r}]"
    if is_key(value):
        raise TypeError(
            f"Expected {where} to hold numbers; found an array of random keys "
            f"({value.dtype}). Fix: save jax.random.key_data(key) and rebuild the key with "
            "jax.random.wrap_key_data after reading it back."
        )
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        array = np.asarray(jax.device_get(value))
        if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
            raise TypeError(
                f"Expected {where} to be an array of numbers or bools; found dtype "
                f"{array.dtype}: {reprlib.repr(value)}. Fix: save text as a Python str, "
                "e.g. str(value), and other data as a numeric array."
            )
        if array.size == 0:
            raise ValueError(
                f"Expected {where} to be a non-empty array; found shape {array.shape} "
                "(Orbax cannot save zero-size arrays). Fix: leave it out, or save its shape."
            )
        return array
    if isinstance(value, bool | float | str):
        return value
    if isinstance(value, int):
        if value not in _INT64_RANGE:
            raise ValueError(
                f"Expected {where} to fit in int64; found {value}. Fix: save it as a str, "
                "str(value), and convert back with int(...)."
            )
        return value
    raise TypeError(
        f"Expected {where} to be a Python int, float, bool or str, or a NumPy or JAX array "
        f"of numbers; found {type(value).__name__}: {reprlib.repr(value)}. Fix: convert it, "
        "e.g. int(x), float(x), str(x) or np.asarray(x); save a dict or list as several "
        "extras."
    )


def extras_arrays(extras: Mapping[str, Any] | None) -> dict[str, Any]:
    """The extras as checkpoint entries under `extras/`, checked before anything is written."""
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise TypeError(
            f"Expected extras to be a dict of names to values, e.g. extras={{'epoch': 3}}; "
            f"found {type(extras).__name__}: {reprlib.repr(extras)}. Fix: pass a dict."
        )
    return {_EXTRAS + name: _extra_value(name, value) for name, value in extras.items()}


_REPLACED = ".mirrored-replaced"


def _recover_replaced(path: str) -> None:
    """Finish or undo a re-save of an existing step that was cut short.

    Re-saving step N moves the old `N` aside to `N.mirrored-replaced`, lets Orbax write the new
    `N` (a temporary directory renamed when complete), then deletes the old copy. A process
    killed in between leaves the old copy and maybe no `N`: put it back (the step is then the
    previous save's, complete), or drop it when the new `N` is complete. Idempotent; a
    concurrent process doing the same is harmless (renames are atomic)."""
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        if not name.endswith(_REPLACED) or not name[: -len(_REPLACED)].isdigit():
            continue
        aside, step_dir = os.path.join(path, name), os.path.join(path, name[: -len(_REPLACED)])
        try:
            if os.path.isdir(step_dir):
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(aside, step_dir)
        except OSError:  # another process got there first
            continue


def _steps(path: str) -> list[int]:
    """The complete checkpoints in `path`: the step directories Orbax names by their number.

    A save in progress is `<step>.orbax-checkpoint-tmp-...`; `ckpt_0003` (a Keras-style
    layout of one directory per epoch) is a checkpoint directory of its own, not a step. A
    re-save cut short is finished or undone first (`_recover_replaced`).
    """
    if not os.path.isdir(path):
        return []
    _recover_replaced(path)
    return sorted(
        int(name)
        for name in os.listdir(path)
        if name.isdigit() and os.path.isdir(os.path.join(path, name))
    )


def _locate(directory: str | os.PathLike[str], step: int | None) -> tuple[str, int | None]:
    """The checkpoint directory and step named by `directory` (and `step`).

    `directory` is the one given to `save_checkpoint`, or one of its step directories (what
    `latest_checkpoint` returns); nothing is created.
    """
    path = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"Expected a checkpoint directory at {path}; found none. Fix: check the path, or "
            "save a checkpoint first."
        )
    parent, name = os.path.split(path)
    # A step directory holds items; one named "3" holding steps (ckpt/{epoch}) is a root
    if name.isdigit() and not _steps(path) and int(name) in _steps(parent):
        if step is not None and step != int(name):
            raise ValueError(
                f"Expected step to be None or {int(name)} with the step directory {path}; "
                f"found step={step!r}. Fix: pass the directory {parent} with step={step}, "
                "or drop step."
            )
        return parent, int(name)
    return path, step


class Checkpoints:
    """A directory of numbered checkpoints, newest kept (`max_to_keep`)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 1) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        _recover_replaced(self.directory)
        # Imported on first use: Orbax costs every `import mirrored` 0.1-0.9 s otherwise.
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=False,
                # A save cut short (a killed process) leaves a temporary directory, never a
                # step: the chief removes such leftovers when it opens the directory.
                cleanup_tmp_directories=is_chief(),
                # Host arrays, written by process 0 alone and read by each process on its own:
                # no cross-process barriers, which would wait for processes that never save.
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=jax.process_index(), active_processes={jax.process_index()}
                ),
            ),
            # The format StandardSave writes, read by the handler that also holds strings and
            # restores a subset of the keys: reading the extras does not read the model.
            item_handlers=ocp.PyTreeCheckpointHandler(),
        )

    def latest(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, arrays: Mapping[str, Any]) -> None:
        if not is_chief():
            return
        # An existing step is replaced as Keras does: moved aside, deleted once the new is done
        old = os.path.join(self.directory, str(step))
        aside = f"{old}{_REPLACED}"
        if os.path.isdir(old):
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(old, aside)
            self._manager.reload()
        self._manager.save(step, args=self._ocp.args.PyTreeSave(dict(arrays)), force=True)
        self._manager.wait_until_finished()
        shutil.rmtree(aside, ignore_errors=True)

    def _read(self, step: int | None, wanted: Callable[[str], bool]) -> dict[str, Any]:
        """The entries of checkpoint `step` (the newest if None) whose keys are `wanted`."""
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"Expected a checkpoint in {self.directory}; found none. Fix: check the path, "
                "or save one first."
            )
        steps = self._manager.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"Expected checkpoint {step} in {self.directory}; found {sorted(steps)}. Fix: "
                "pass one of those, or step=None for the newest."
            )
        on_disk = self._manager.item_metadata(step)
        item = {key: meta for key, meta in on_disk.items() if wanted(key)}
        if not item:
            return {}
        args = self._ocp.args.PyTreeRestore(item=item, partial_restore=True)
        return dict(self._manager.restore(step, args=args))

    def restore(
        self, like: dict[str, np.ndarray], step: int | None = None, *, prefix: str | None = None
    ) -> dict[str, Any]:
        # The keys asked for (a model alone: not the optimizer's), any under `prefix` too
        under = prefix or "\0"  # no key starts with it
        wanted: Callable[[str], bool] = lambda k: k in like or k.startswith(under)  # noqa: E731
        return {k: np.asarray(v) for k, v in self._read(step, wanted).items()}

    def extras(self, step: int | None = None) -> dict[str, Any]:
        restored = self._read(step, lambda key: key.startswith(_EXTRAS))
        return {key.removeprefix(_EXTRAS): value for key, value in restored.items()}

    def close(self) -> None:
        self._manager.close()


@heartbeat.marked("checkpoint")
def save_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    *,
    step: int = 0,
    max_to_keep: int | None = 1,
    extras: Mapping[str, Any] | None = None,
) -> None:
    """Save a model (and optimizer, and extra values) into `directory` as checkpoint `step`.

    Each save writes the step directory `directory/<step>` atomically: it appears complete,
    extras included, or not at all. Then only the newest `max_to_keep` steps are kept.

    Args:
        directory: the checkpoint directory (created if missing).
        model: an `nnx.Module` or a Keras 3 model, mirrored or not.
        optimizer: an `nnx.Optimizer` (or a Keras optimizer) saved with the model, or None.
        step: the checkpoint's number; the newest is the one with the largest.
        max_to_keep: how many steps `directory` keeps, newest first (default 1: each save
            replaces the previous one); None keeps every one.
        extras: named values saved in the same step, as `tf.train.Checkpoint(epoch=...)`:
            Python ints (int64), floats, bools and strs, and NumPy or JAX arrays of numbers.
            Read them back with `mirrored.checkpoint_extras`.

    Example:
        >>> mirrored.save_checkpoint(
        ...     "ckpt/", model, optimizer, step=step, max_to_keep=3,
        ...     extras={"epoch": epoch, "step_in_epoch": 0},
        ... )

    Differs from tf.distribute: `tf.train.Checkpoint.save` keeps every checkpoint (and the
    CheckpointManager needs `max_to_keep`); here the newest is kept by default.
    """
    _context.refuse_inside_a_step("save_checkpoint", "its arrays traced", "save between steps")
    objects = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    save_objects(directory, objects, step=step, max_to_keep=max_to_keep, extras=extras)


def save_objects(
    directory: str | os.PathLike[str],
    objects: dict[str, Any],
    *,
    step: int,
    max_to_keep: int | None,
    extras: Mapping[str, Any] | None = None,
) -> None:
    """`save_checkpoint` of any named objects (NNX modules and optimizers, Keras models and
    optimizers): every check first, then one atomic step directory."""
    check_max_to_keep(max_to_keep)
    check_step(step)
    entries = extras_arrays(extras)
    check_built(objects, "save")
    checkpoints = Checkpoints(directory, max_to_keep=max_to_keep)
    try:
        checkpoints.save(step, {**state_arrays(objects), **entries})
    finally:
        checkpoints.close()


@heartbeat.marked("checkpoint")
def restore_checkpoint(
    directory: str | os.PathLike[str],
    model: Any,
    optimizer: Any = None,
    *,
    step: int | None = None,
) -> int:
    """Restore the newest (or `step`) checkpoint into a model (and optimizer); returns the step.

    `directory` is the one given to `save_checkpoint`, or one of its step directories (what
    `mirrored.latest_checkpoint` returns). Values are placed where the model's variables live
    (mirrored on its strategy), whatever replica count wrote them. Read the checkpoint's
    extras with `mirrored.checkpoint_extras`.

    Example:
        >>> with strategy.scope():
        ...     model = MLP(rngs=nnx.Rngs(0))
        >>> mirrored.restore_checkpoint("ckpt/", model)
    """
    _context.refuse_inside_a_step("restore_checkpoint", "nothing restored", "restore between steps")
    objects = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    root, step = _locate(directory, step)
    return restore_objects(root, objects, step=step)[0]


def restore_objects(
    directory: str | os.PathLike[str],
    objects: dict[str, Any],
    *,
    step: int | None = None,
    with_extras: bool = False,
) -> tuple[int, dict[str, Any]]:
    """`restore_checkpoint` of any named objects from the checkpoint directory `directory`:
    the step restored, and its extras when `with_extras` (else `{}`), read in one pass."""
    check_built(objects, "restore")
    model, optimizer = objects.get("model"), objects.get("optimizer")
    if optimizer is not None and _is_keras(optimizer) and not optimizer.built:
        for extension in hooks.extensions:  # Keras creates an optimizer's slots lazily
            extension.prepare_restore(model, optimizer)
    checkpoints = Checkpoints(directory, max_to_keep=None)
    try:
        step = checkpoints.latest() if step is None else step
        try:
            arrays = checkpoints.restore(state_arrays(objects), step)
            extras = checkpoints.extras(step) if with_extras else {}
        except Exception as error:  # a truncated or corrupt file: Orbax's, JSON's, OCDBT's
            if str(error).startswith("Expected"):
                raise  # our own message, already clear
            raise CorruptCheckpointError(
                f"Expected checkpoint {step} in {checkpoints.directory} to be readable; found "
                f"it damaged ({type(error).__name__}: {str(error)[:200]}). Nothing was "
                "restored. Fix: restore an earlier step (restore_checkpoint(directory, ..., "
                "step=N)), or delete this step's directory to fall back to the previous one."
            ) from error
    finally:
        checkpoints.close()
    load_state_arrays(objects, arrays, checkpoints.directory)
    assert step is not None
    return step, extras


def checkpoint_extras(
    directory: str | os.PathLike[str], *, step: int | None = None
) -> dict[str, Any]:
    """The extras saved with the newest (or `step`) checkpoint; `{}` if it was saved without.

    Reads the extras alone, not the model. Python values come back as they were saved (an
    int stays an int, a str a str); arrays come back as NumPy arrays. `directory` is as for
    `restore_checkpoint`: pass both the same path from `latest_checkpoint`, and they read the
    same step even while another process saves.

    Example:
        >>> path = mirrored.latest_checkpoint("ckpt/")
        >>> if path is not None:
        ...     mirrored.restore_checkpoint(path, model, optimizer)
        ...     start_epoch = mirrored.checkpoint_extras(path)["epoch"]

    Differs from tf.distribute: `tf.train.Checkpoint(epoch=tf.Variable(0))` restores the
    extras into the variables given; here they are returned, as Python and NumPy values.
    """
    root, step = _locate(directory, step)
    checkpoints = Checkpoints(root, max_to_keep=None)
    try:
        return checkpoints.extras(step)
    finally:
        checkpoints.close()


def latest_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint in `directory` (its step directory), or None.

    As `tf.train.latest_checkpoint`: None when `directory` holds no checkpoint or does not
    exist (nothing is created). A save still in progress, or cut short by a crash, is Orbax's
    temporary `<step>.orbax-checkpoint-tmp...` directory and is ignored; a re-save of an
    existing step cut short leaves that step's previous copy, which is found. Pass the path to
    `restore_checkpoint` and `checkpoint_extras`.

    Example:
        >>> path = mirrored.latest_checkpoint("ckpt/")  # e.g. '/abs/ckpt/12', or None
    """
    root = os.path.abspath(os.fspath(directory))
    steps = _steps(root)
    return os.path.join(root, str(max(steps))) if steps else None
