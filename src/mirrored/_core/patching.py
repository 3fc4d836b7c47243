"""Every monkeypatch of Keras, Flax or JAX goes through here, declared with its reason.

A module that patches a framework declares each target once, at import (`target(...)`): where
it lives, why mirrored replaces it, and the versions it was checked against. `TARGETS` is then
the one list of what mirrored patches (docs/architecture.md prints it), and a test proves that
each target still exists in the installed versions and is the framework's own before mirrored
patches it. A permanent patch (`replace`) refuses a target that is missing or already replaced
by someone else; a temporary one (`temporarily`) holds while a step is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from mirrored._core import context as _context

__all__ = ["TARGETS", "Target", "applied", "replace", "resolve", "target", "temporarily"]


@dataclasses.dataclass(frozen=True)
class Target:
    """One attribute of a framework that mirrored replaces."""

    owner: str  # dotted path: a module, then attributes ("flax.nnx.BatchNorm")
    name: str  # the attribute replaced
    reason: str
    checked: str  # the versions it was checked against ("keras 3.15")
    adds: bool = False  # an attribute the framework does not define (a class-level descriptor)

    @property
    def framework(self) -> str:
        return self.owner.split(".")[0]

    def __str__(self) -> str:
        return f"{self.owner}.{self.name}"


TARGETS: list[Target] = []
# (target, the class patched, the framework's original) of every permanent patch applied.
_applied: list[tuple[Target, Any, Any]] = []


def target(owner: str, name: str, *, reason: str, checked: str, adds: bool = False) -> Target:
    """Declare a target (idempotent: a module imported twice declares it once)."""
    found = Target(owner, name, reason, checked, adds)
    if found not in TARGETS:
        TARGETS.append(found)
    return found


@functools.cache
def resolve(owner: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes (found
    once: a temporary patch is entered at every trace)."""
    parts = owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(owner)


def _missing(found: Target, where: Any) -> AttributeError:
    return AttributeError(
        f"mirrored expected {where!r} to have the attribute {found.name!r} it patches "
        f"({found.reason}; checked against {found.checked}); the installed version has none. "
        f"Fix: install a tested version ({found.checked}), or report the version you have."
    )


def replace(
    found: Target, wrap: Callable[[Any], Any], *, owner: Any = None, inherited: bool = False
) -> None:
    """`owner.name = wrap(original)` for good; `owner` defaults to the target's own class (a
    family of classes, such as every optimizer defining `apply`, passes each one). The
    original must be defined on `owner` itself (or, with `inherited`, reachable from it) and
    be the framework's, not already a replacement."""
    cls = resolve(found.owner) if owner is None else owner
    if found.adds:
        if hasattr(cls, found.name):
            raise RuntimeError(
                f"mirrored expected {cls!r} to have no class attribute {found.name!r} (mirrored "
                f"adds one: {found.reason}; checked against {found.checked}); the installed "
                f"version defines it. Fix: install a tested version ({found.checked})."
            )
        setattr(cls, found.name, wrap(None))
        _applied.append((found, cls, None))
        return
    if inherited:
        if not hasattr(cls, found.name):
            raise _missing(found, cls)
        original = getattr(cls, found.name)
    else:
        if found.name not in vars(cls):
            raise _missing(found, cls)
        original = vars(cls)[found.name]
    module = getattr(original, "__module__", None) or ""
    if module.startswith("mirrored"):
        raise RuntimeError(
            f"mirrored expected {cls!r}.{found.name} to be {found.framework}'s own before "
            f"patching it; found mirrored's replacement ({original!r}) already there. Fix: "
            "import mirrored.keras once, never reload it."
        )
    setattr(cls, found.name, wrap(original))
    _applied.append((found, cls, original))


@contextlib.contextmanager
def temporarily(found: Target, replacement: Any, *, owner: Any = None) -> Iterator[None]:
    """`owner.name` is `replacement` while the block runs (nested and threaded uses share one
    patch); `owner` defaults to the target's own class."""
    cls = resolve(found.owner) if owner is None else owner
    if found.name not in vars(cls):
        raise _missing(found, cls)
    with _context.patched_attribute(cls, found.name, replacement):
        yield


def applied() -> list[tuple[Target, Any, Any]]:
    """The permanent patches applied so far: (target, class, the framework's original)."""
    return list(_applied)
