"""Eager mode (`run_functions_eagerly`): eager shard_map's per-primitive programs, cached."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

from mirrored._core import patching


class _CachingJit:
    """`jax._src.api` for eager `shard_map`, whose every primitive calls `api.jit` on a new
    (but equal) `HashablePartial`: here the compiled function is kept per partial, so a
    primitive seen before dispatches from cache instead of being traced, lowered and looked
    up in the compilation cache again (measured on a 12-32-5 MLP with Adam: 4.9 s → 0.4 s
    per eager step on one device, 9 s → 0.8 s on 8)."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def jit(self, fun: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return self._api.jit(fun, *args, **kwargs)
        try:
            compiled = self._cache.get(fun)
        except TypeError:  # unhashable parameters
            return self._api.jit(fun)
        if compiled is None:
            compiled = self._cache[fun] = self._api.jit(fun)
            if len(self._cache) > 4096:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(fun)
        return compiled


_EAGER_JIT: list[_CachingJit] = []
_SHARD_MAP_API = patching.target(
    "jax._src.shard_map",
    "api",
    reason="eager shard_map's per-primitive programs cached (10x faster eager steps)",
    checked="jax 0.10.2",
)


@contextlib.contextmanager
def _cached_eager_primitives() -> Iterator[None]:
    """While a step runs eagerly: eager shard_map's per-primitive programs are cached."""
    from jax._src import shard_map as shard_map_impl

    original = getattr(shard_map_impl, "api", None)
    if original is None or isinstance(original, _CachingJit):  # another JAX, or nested
        yield
        return
    if not _EAGER_JIT:
        _EAGER_JIT.append(_CachingJit(original))
    with patching.temporarily(_SHARD_MAP_API, _EAGER_JIT[0]):
        yield
