"""Keras support without importing Keras: `mirrored.keras` is installed when Keras is imported.

`import mirrored` never imports Keras. If Keras (JAX backend) is already imported, or once it
is, mirrored installs its adapter (`mirrored.keras`), so that Keras models created in
`strategy.scope()` are mirrored whichever of the two a script imports first.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import types
from typing import Any

from mirrored._core import hooks

logger = logging.getLogger("mirrored")
_warned = False


def ensure_adapter() -> bool:
    """Install `mirrored.keras` when Keras is imported with the JAX backend; True when it is."""
    global _warned
    if "keras" not in sys.modules:
        return False
    if "mirrored.keras" in sys.modules:
        return True
    keras = sys.modules["keras"]
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if backend is None:  # Keras is still importing: the loader hook installs it afterwards
        return False
    if backend() != "jax":
        if not _warned:
            _warned = True
            logger.warning(
                "Keras is imported with the %r backend: mirrored distributes Keras models on "
                "the JAX backend only, so Keras models here train on one device. Fix: set "
                "KERAS_BACKEND=jax before the first `import keras`.",
                backend(),
            )
        return False
    import mirrored.keras  # noqa: F401 — installs the adapter

    return True


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        ensure_adapter()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the top-level `keras` package."""

    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "keras":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """At `import mirrored`: the adapter now if Keras is loaded, else when it is (and at every
    `strategy.scope()`, for a Keras imported while the finder was not yet in place)."""
    if "keras" not in sys.modules and not os.environ.get("KERAS_BACKEND"):
        # Keras unset tries TensorFlow first (and fails without it); mirrored distributes
        # Keras models on JAX only.
        os.environ["KERAS_BACKEND"] = "jax"
        logger.info(
            "KERAS_BACKEND was not set: mirrored set it to 'jax' for a later `import keras` "
            "(mirrored distributes Keras models on the JAX backend only)."
        )
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    hooks.on_scope(ensure_adapter)
    ensure_adapter()
