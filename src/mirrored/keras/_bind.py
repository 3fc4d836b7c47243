"""`strategy.run` on a step that reaches Keras objects, TensorFlow's way: captured by closure
or passed as arguments. Their variables become the step's first argument (see `_bridge`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mirrored._core import capture as _capture
from mirrored._core import hooks
from mirrored._run.arguments import _fn_key, undecorated
from mirrored.keras import _bridge


class KerasStep:
    """`fn` with its Keras state made explicit: called as `step(holder, *args, **kwargs)`.

    One object per step function and runner, so `run`'s program cache finds it again.
    """

    def __init__(self, fn: Callable[..., Any], bridge: _bridge.Bridge, objects: list[Any]) -> None:
        self.fn = fn
        self.bridge = bridge
        self.objects = objects  # the Keras objects the step reaches
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, holder: _bridge.Holder, *args: Any, **kwargs: Any) -> Any:
        bridge = self.bridge
        return _bridge.call_stateless(
            bridge.variables, bridge.kinds, holder, lambda: self.fn(*args, **kwargs)
        )


class Explicit:
    """A step whose Keras state arrives as its first argument already (`verify` runs such
    steps on copies of that state): `run` binds nothing more."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@dataclasses.dataclass
class _Entry:
    objects: list[Any]
    step: KerasStep | None  # None: the step reaches no Keras state
    # (namespace, name, object) of the objects reached as module globals: still the same?
    bound: list[tuple[dict[str, Any], str, Any]]


def _captured_objects(
    fn: Callable[..., Any], bound: list[tuple[dict[str, Any], str, Any]] | None = None
) -> list[Any]:
    """The Keras objects `fn` reaches; those reached as module globals also go to `bound`."""
    objects: list[Any] = []
    test = lambda v: bool(_bridge.keras_objects(v))  # noqa: E731
    for _, value in _capture.find_reachable(fn, test, bound):
        objects += _bridge.keras_objects(value)
    return objects


def _argument_objects(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _bridge._KERAS_TYPES):
            found.append(value)
        elif isinstance(value, list | tuple | dict) and len(value) <= 16:
            found += _bridge.keras_objects(value, depth=0)
    return found


def _entry(
    runner: Any,
    fn: Callable[..., Any],
    objects: list[Any],
    bound: list[tuple[dict[str, Any], str, Any]],
) -> _Entry:
    if not objects:
        return _Entry(objects, None, bound)
    variables = _bridge.variables_of(objects)  # none yet: a model built by its first call
    strategy = runner.strategy
    for v in variables:
        value = v._value
        if value is not None and not runner.is_mirrored(value):
            raise ValueError(
                f"strategy.run expected the Keras variable {v.path!r} mirrored on the "
                f"strategy's {runner.n} device(s); it lives on "
                f"{', '.join(sorted(str(d) for d in value.devices()))}. It was most likely "
                "created outside strategy.scope().\n"
                "Fix: create the model, optimizer and metrics inside the scope:\n"
                "  with strategy.scope():\n"
                "      model = keras.Sequential([...])\n"
                "      optimizer = keras.optimizers.Adam()\n"
                f"(strategy: {strategy!r})"
            )
    kinds = _bridge.slot_kinds(objects, variables)
    return _Entry(objects, KerasStep(fn, _bridge.Bridge(variables, kinds), objects), bound)


def _initialize_created(runner: Any) -> None:
    """Initialize, mirrored, the variables a lazy build (first call of a model, first apply
    of an optimizer) created while the step was traced."""
    from keras.src.backend.common.variables import initialize_all_variables

    with runner.strategy.scope():
        initialize_all_variables()


def _lookup(
    runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    from_args = _argument_objects(args, kwargs)
    key = (_fn_key(undecorated(fn)), *map(id, from_args))
    cache: dict[Any, _Entry] = runner.extension_state.setdefault("keras", {})
    entry = cache.get(key)
    # A global the step reads now names another object (a notebook cell that made the model
    # again, a sweep): the step's Keras state is looked up anew, not the old model trained.
    if entry is None or any(ns.get(name) is not obj for ns, name, obj in entry.bound):
        bound: list[tuple[dict[str, Any], str, Any]] = []
        objects = _captured_objects(undecorated(fn), bound) + from_args
        entry = cache[key] = _entry(runner, fn, objects, bound)
    return key, cache, entry


def _after_lazy_builds(
    runner: Any,
    fn: Callable[..., Any],
    found: tuple[Any, dict[Any, _Entry], _Entry],
    attempt: Callable[[KerasStep], Any],
) -> Any:
    """`attempt(step)` on the step's current Keras values. When its trace created variables (a
    lazy build: a model's first call, an optimizer's first apply), initialize them mirrored,
    rebuild the step with them, and attempt again."""
    key, cache, entry = found
    for tries in range(3):
        step = entry.step
        assert step is not None
        step.bridge.pull()
        try:
            return attempt(step)
        except _bridge.VariablesCreated:
            if tries == 2:
                raise
            _initialize_created(runner)
            entry = cache[key] = _entry(runner, fn, entry.objects, entry.bound)
    raise AssertionError("unreachable")


def bind(runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Run `fn` with the Keras state it reaches, or `hooks.NOT_BOUND` when it reaches none."""
    return _bound(runner, fn, args, kwargs, lambda step, full: runner.call(step, full, kwargs))


def bind_steps(
    runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], batches: Any
) -> Any:
    """`strategy.run_steps`: K steps of `fn` over `batches` in one program, its Keras state
    carried from step to step as `run`'s is (TensorFlow's loop of `strategy.run` inside a
    `tf.function`), or `hooks.NOT_BOUND` when it reaches none."""

    def steps(step: KerasStep, full: tuple[Any, ...]) -> Any:
        return runner.call_steps(step, full, kwargs, batches)

    return _bound(runner, fn, args, kwargs, steps)


def _bound(
    runner: Any,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    call: Callable[[KerasStep, tuple[Any, ...]], Any],
) -> Any:
    """`call(step, (holder, *args))` of `fn` made explicit, its Keras state written back after."""
    if isinstance(fn, KerasStep | Explicit):
        return hooks.NOT_BOUND
    found = _lookup(runner, fn, args, kwargs)
    if found[2].step is None:
        return hooks.NOT_BOUND

    def run(step: KerasStep) -> Any:
        out = call(step, (step.bridge.holder, *args))
        step.bridge.push()
        return out

    return _after_lazy_builds(runner, fn, found, run)


def explicit(
    runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[KerasStep, list[Any]] | None:
    """`fn` as a step taking its Keras state as first argument, with that argument (a
    `Holder` of the variables' current values), or None when `fn` reaches no Keras state.

    `verify` runs the checks on copies of the holder: the Keras variables stay as they were.
    The step is traced once here, so that a lazy build creates its variables first (nothing
    runs).
    """
    found = _lookup(runner, fn, args, kwargs)
    if found[2].step is None:
        return None

    def trace(step: KerasStep) -> tuple[KerasStep, list[Any]]:
        step_args = [step.bridge.holder, *args]
        try:
            runner.lowered(step, step_args, kwargs)
        except _bridge.VariablesCreated:
            raise
        except Exception:  # the step's own error: verify traces it again and reports it
            pass
        return step, step_args

    made: tuple[KerasStep, list[Any]] = _after_lazy_builds(runner, fn, found, trace)
    return made
