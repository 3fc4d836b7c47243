"""What the layers above lend the core: the contracts they fill, and the registry of extensions.

The core never imports an optional framework. An extension (`mirrored.keras`) registers an
object that satisfies `Extension` when its framework is imported; `strategy.run`, `run_steps`,
restoring a checkpoint and `verify` ask the registered extensions, so the hot path pays one
`if extensions:` check when none is installed. A second registration under one name is refused,
as Flax's graph node registry refuses one.

Types needed low but defined high are `Protocol`s here (`StrategyLike`), as optax keeps its
contracts in `_src/base.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = [
    "NOT_BOUND",
    "Extension",
    "StrategyLike",
    "extensions",
    "load_extensions",
    "on_scope",
    "register",
]

# What `Extension.bind` returns for a step that reaches none of its framework's state.
NOT_BOUND = object()


class StrategyLike(Protocol):
    """What the layers below `_strategy/` read of a strategy."""

    @property
    def num_replicas_in_sync(self) -> int: ...

    _mesh: Any  # the strategy's Mesh, one axis: REPLICA_AXIS
    _replicated: Any  # NamedSharding: every device holds the whole value
    _split: Any  # NamedSharding: the leading axis split over the replicas

    @property
    def extended(self) -> Any: ...

    def scope(self) -> AbstractContextManager[Any]: ...

    def _check_pending(self) -> None: ...


class Extension(Protocol):
    """What an optional framework installs (Keras: `mirrored.keras`)."""

    name: str

    def bind(self, runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any) -> Any:
        """Run `fn` with the framework's state it reaches as arguments, or `NOT_BOUND`."""

    def bind_steps(
        self, runner: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any, batches: Any
    ) -> Any:
        """`run_steps`' K steps of `fn` over `batches` with the framework's state it reaches as
        arguments, or `NOT_BOUND`."""

    def masked_trace_patches(self) -> Sequence[Callable[[], AbstractContextManager[None]]]:
        """Patches entered while the step of a padded batch is traced (Keras' metrics)."""

    def prepare_restore(self, model: Any, optimizer: Any) -> None:
        """Before a checkpoint restores into `model`/`optimizer`: create lazily made state."""

    def prepare_verify(
        self, strategy: Any, step_fn: Callable[..., Any], args: list[Any], batch_size: Any
    ) -> Any:
        """`verify`'s explicit form of a framework step or model (`.step`, `.args`,
        `.deterministic()`, `.explicit_step()`, `.dataset_size`), or None when `step_fn` is
        not one."""


_registry: dict[str, Extension] = {}
# The registered extensions, in order; read on every step (empty: nothing to ask).
extensions: list[Extension] = []
# Functions that install an extension whose framework was imported since (`mirrored/__init__`
# adds Keras' autoload); called when a scope is entered.
_loaders: list[Callable[[], object]] = []


def register(extension: Extension) -> None:
    """Install `extension`; a second one under the same name is an error."""
    if extension.name in _registry:
        raise ValueError(
            f"mirrored expected one extension named {extension.name!r}; found a second "
            f"registration ({extension!r}, after {_registry[extension.name]!r}). Fix: import "
            "the extension's module once, and do not register it by hand."
        )
    _registry[extension.name] = extension
    extensions.append(extension)


def on_scope(loader: Callable[[], object]) -> None:
    """Call `loader` whenever a strategy's scope is entered."""
    if loader not in _loaders:
        _loaders.append(loader)


def load_extensions() -> None:
    """Install the extensions of frameworks imported since the last call."""
    for loader in _loaders:
        loader()
