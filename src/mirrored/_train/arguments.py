"""What `fit`, `evaluate` and `predict` accept, checked before anything runs or changes: each
error names the argument, what was expected, what was found, and the fix."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mirrored._train.batches import _is_arrays
from mirrored._train.callbacks.base import Callback

VERBOSE = (0, 1, 2, "auto")


def check_count(name: str, value: Any, *, minimum: int, none: bool = False, fix: str) -> None:
    """`value` is an int >= `minimum` (or None where `none`)."""
    if value is None and none:
        return
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    expected = f"{kind}{' or None' if none else ''}"
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(
            f"Expected {name} to be {expected}; found {value!r} ({type(value).__name__}). "
            f"Fix: {fix}."
        )
    if value < minimum:
        raise ValueError(f"Expected {name} to be {expected}; found {value}. Fix: {fix}.")


def as_callbacks(callbacks: Any) -> list[Callback]:
    """Keras' `callbacks=`: a list (or tuple) of callbacks, one callback alone, or None."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]  # Keras 3 flattens what it is given
    if not isinstance(callbacks, Sequence) or isinstance(callbacks, str):
        raise TypeError(
            f"Expected callbacks to be a list of mirrored.callbacks.Callback; found "
            f"{type(callbacks).__name__}. Fix: callbacks=[mirrored.callbacks.CSVLogger(...)]."
        )
    found = list(callbacks)
    for callback in found:
        if not isinstance(callback, Callback):
            raise TypeError(
                f"Expected callbacks to be mirrored.callbacks.Callback instances; found "
                f"{type(callback).__module__}.{type(callback).__name__}. Fix: use "
                "mirrored.callbacks.<Name> (Keras' names), subclass "
                "mirrored.callbacks.Callback, or wrap functions in LambdaCallback."
            )
    return found


def check_verbose(verbose: Any) -> int:
    """Keras' verbose values; "auto" is 1, as in Keras."""
    if isinstance(verbose, bool) or verbose not in VERBOSE:
        raise ValueError(
            f"Expected verbose to be one of {list(VERBOSE)} (Keras' values: 0 quiet, 1 a "
            f"progress bar, 2 one line per epoch); found {verbose!r}. Fix: verbose=1."
        )
    return 1 if verbose == "auto" else int(verbose)


def check_labels_given(x: Any, y: Any, call: str) -> None:
    """In-memory x needs its labels: a loss of (y, None) fails deep inside the step."""
    if y is None and _is_arrays(x):
        raise ValueError(
            f"Expected labels y with in-memory x in {call}(x, y, ...); found y=None. Fix: "
            f"{call}(x, y, ...), or pass a dataset of (x, y) batches as x."
        )


def _rows(tree: Any) -> int | None:
    leaves = jax.tree.leaves(tree)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else None


def as_validation_data(validation_data: Any) -> Any:
    """Keras' forms of held-out arrays as one: a list `[x_val, y_val]` as a tuple, and
    `(x_val, y_val, None)` as `(x_val, y_val)`; anything else as it is."""
    if (
        isinstance(validation_data, tuple | list)
        and len(validation_data) in (2, 3)
        and _is_arrays(validation_data[0])
    ):
        validation_data = tuple(validation_data)
        if len(validation_data) == 3 and validation_data[2] is None:
            return validation_data[:2]
    return validation_data


def validation_epochs(validation_freq: Any) -> Callable[[int], bool]:
    """Keras' `validation_freq`: an int n validates after every n-th epoch, a list (or other
    container) after the epochs it lists (1-based)."""
    if isinstance(validation_freq, int | np.integer) and not isinstance(validation_freq, bool):
        if validation_freq >= 1:
            return lambda epoch: epoch % int(validation_freq) == 0
    elif isinstance(validation_freq, list | tuple | set | range):
        listed = {int(e) for e in validation_freq}
        return listed.__contains__
    raise ValueError(
        f"Expected validation_freq to be a positive int or a list of epochs (1-based), as in "
        f"Keras; found {validation_freq!r}. Fix: e.g. validation_freq=2, or [1, 5, 10]."
    )


def check_validation_data(validation_data: Any) -> None:
    """Keras' `(x_val, y_val)` or `(x_val, y_val, val_sample_weight)` of one length each, or a
    dataset: checked before the first epoch, not after it."""
    if not isinstance(validation_data, tuple | list) or not validation_data:
        return  # a dataset: read at validation time, as Keras does
    if not _is_arrays(validation_data[0]):
        return  # a list of batches
    if len(validation_data) not in (2, 3):
        raise ValueError(
            "Expected validation_data to be (x_val, y_val) or (x_val, y_val, "
            f"val_sample_weight); found a {type(validation_data).__name__} of "
            f"{len(validation_data)}. Fix: validation_data=(x_val, y_val)."
        )
    names = ("x_val", "y_val", "val_sample_weight")
    sizes = {name: _rows(part) for name, part in zip(names, validation_data, strict=False)}
    if len({size for size in sizes.values()}) > 1:
        found = ", ".join(f"{name} {size}" for name, size in sizes.items())
        raise ValueError(
            f"Expected validation_data's arrays to have one length; found {found} rows. Fix: "
            "give each the same examples (one label and weight per row of x_val)."
        )


def check_fit(
    *,
    x: Any,
    y: Any,
    epochs: Any,
    initial_epoch: Any,
    steps_per_epoch: Any,
    shuffle: Any,
    validation_data: Any,
    validation_steps: Any = None,
    validation_freq: Any = 1,
) -> Callable[[int], bool]:
    """Every `fit` argument that is not checked where it is used, before anything changes;
    returns whether to validate after an epoch (1-based), Keras' `validation_freq`."""
    check_count("epochs", epochs, minimum=0, fix="e.g. epochs=10")
    check_count("initial_epoch", initial_epoch, minimum=0, fix="e.g. initial_epoch=0")
    check_count(
        "steps_per_epoch",
        steps_per_epoch,
        minimum=1,
        none=True,
        fix="e.g. steps_per_epoch=100, or leave it unset for one pass over the data",
    )
    if not isinstance(shuffle, bool | np.bool_):
        raise TypeError(
            f"Expected shuffle to be True or False; found {shuffle!r} "
            f"({type(shuffle).__name__}). Fix: shuffle=True (the default) or False."
        )
    check_labels_given(x, y, "fit")
    check_validation_data(validation_data)
    check_count("validation_steps", validation_steps, minimum=1, none=True, fix="e.g. 10")
    return validation_epochs(validation_freq)


def class_sample_weights(y: Any, class_weight: Any, sample_weight: Any) -> np.ndarray:
    """Keras' `class_weight`: each example weighs its class' weight (1.0 for a class not in
    the dict); labels are class indices, (n, 1) columns, or one-hot rows (their argmax)."""
    if sample_weight is not None:
        raise ValueError(
            "Expected class_weight or sample_weight, not both (Keras refuses them together); "
            "found both. Fix: fold the class weights into sample_weight: "
            "sample_weight * np.vectorize(class_weight.get)(y)."
        )
    if not isinstance(class_weight, Mapping) or not all(
        isinstance(k, int | np.integer) and not isinstance(k, bool) for k in class_weight
    ):
        raise TypeError(
            "Expected class_weight to be a dict from class index (int) to weight, e.g. "
            f"{{0: 1.0, 1: 5.0}}; found {class_weight!r}. Fix: pass such a dict."
        )
    if not isinstance(y, np.ndarray | jax.Array):
        raise ValueError(
            "Expected in-memory labels y (one array) with class_weight; found "
            f"{type(y).__name__}. Fix: pass x and y as arrays, or give a dataset's batches "
            "their weights as (x, y, sample_weight)."
        )
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels[..., 0] if labels.shape[-1] == 1 else np.argmax(labels, axis=-1)
    labels = np.round(labels).astype(np.int32).reshape(len(labels), -1)[:, 0]
    weights = np.ones(len(labels), np.float32)
    for index, weight in class_weight.items():
        weights[labels == int(index)] = float(weight)
    return weights


def _describe(tree: Any) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    parts = [
        f"{jax.tree_util.keystr(path) or 'x'}: {tuple(leaf.shape[1:])} {leaf.dtype}"
        for path, leaf in leaves
    ]
    return ", ".join(parts[:4]) + (f" (+{len(parts) - 4} more)" if len(parts) > 4 else "")


def check_fit_inputs(
    model: Any, x: Any, rngs: Any, validation_data: Any, passed: set[Any] | None
) -> None:
    """`fit`'s in-memory `x` and `validation_data`'s x against the model (`check_model_input`),
    before the first epoch (a wrong validation x used to fail after a whole epoch)."""
    if _is_arrays(x):
        check_model_input(model, x, rngs, "fit", passed)
    if isinstance(validation_data, tuple) and _is_arrays(validation_data[0]):
        check_model_input(model, validation_data[0], None, "validation_data", passed)


def check_model_input(
    model: Any, x: Any, rngs: Any, call: str, passed: set[Any] | None = None
) -> None:
    """The model applied to one example of `x` (shapes only, `jax.eval_shape`: no compile, no
    state touched), so that a wrong feature count is an error naming `x` and the model, not
    a `dot_general` deep in the first step. `x` is a batch's inputs (PerReplica leaves).

    `passed`: the (call, structure, shapes and dtypes) already checked for this model (a
    trainer's), each checked once, not at every call (a trace: ~5 ms of each `fit`)."""
    from flax import nnx

    from mirrored._core.values import is_per_replica

    if not isinstance(model, nnx.Module):
        return
    example = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(
            (1, *tuple(v.shape)[1:]), jax.dtypes.canonicalize_dtype(v.dtype)
        ),
        x,
        is_leaf=is_per_replica,
    )
    flat, structure = jax.tree.flatten(example)
    key = (call, structure, tuple((e.shape, e.dtype) for e in flat))
    if passed is not None and key in passed:
        return
    with_rngs = rngs is not None and call == "fit"
    graphdef, state = nnx.split((model, rngs) if with_rngs else model)

    def apply(state: Any, x: Any) -> Any:
        merged: Any = nnx.merge(graphdef, state)  # a copy: modes set here stay here
        if with_rngs:
            module, module_rngs = merged
            return module(x, rngs=module_rngs)
        if call != "fit":
            merged.eval()  # evaluate and predict call the model in eval mode
        return merged(x)

    try:
        jax.eval_shape(apply, state, example)
    except (TypeError, ValueError, IndexError) as error:  # shapes and dtypes that do not fit
        raise ValueError(
            f"Expected {call}'s x to fit the model {type(model).__name__}; found examples of "
            f"{_describe(example)}, on which the model fails: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}\n"
            "Fix: give x the per-example shape the model was built for (e.g. nnx.Linear's "
            "in_features), or build the model for x's shape. Nothing was trained or changed."
        ) from error
    except Exception:  # anything else (a model that cannot be traced this way): the step says
        return
    if passed is not None:
        passed.add(key)


def check_steps_per_execution(value: Any) -> bool:
    """Whether `value` is "auto"; else it must be a positive int (raises otherwise)."""
    if isinstance(value, str) and value == "auto":
        return True
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"Expected steps_per_execution to be a positive int (steps compiled into one "
            f"program) or 'auto'; found {value!r}. Fix: e.g. steps_per_execution=32, or "
            "leave it unset ('auto')."
        )
    return False
