"""Process-wide settings behind `mirrored.config` (TensorFlow's `tf.config` names where it has
them): the persistent compilation cache, device-resident training data, eager execution. The
user-facing description is `mirrored.config`'s docstring."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import jax

logger = logging.getLogger("mirrored")

ENV = "MIRRORED_COMPILATION_CACHE"
DEVICE_DATA_ENV = "MIRRORED_DEVICE_DATA_BYTES"
DEVICE_DATA_BYTES = 2**30
MAX_CACHE_BYTES = 4 * 2**30
_OFF = frozenset({"", "0", "off", "false", "no", "none"})
_decided = False  # set once mirrored or the user has chosen the cache for this process


_eager = False  # run_functions_eagerly's setting
_eager_within = 0  # Trainer(run_eagerly=True) is running one of its loops
_eager_warned = False


def run_functions_eagerly(run_eagerly: bool) -> None:
    """Run every step op by op (True) or compiled (False, the default), as TensorFlow's
    `tf.config.run_functions_eagerly`: for debugging with `print` and `breakpoint()`.

    Example:
        >>> mirrored.config.run_functions_eagerly(True)
        >>> strategy.run(train_step, args=(model, optimizer, x, y))   # print() shows replicas
        >>> mirrored.config.run_functions_eagerly(False)
    """
    global _eager, _eager_warned
    if not isinstance(run_eagerly, bool):
        raise TypeError(
            f"Expected run_eagerly to be True or False; found {run_eagerly!r}. Fix: "
            "mirrored.config.run_functions_eagerly(True)."
        )
    _eager = run_eagerly
    _eager_warned = _eager_warned and run_eagerly  # warn again after the next switch on


def functions_run_eagerly() -> bool:
    """Whether steps run op by op (`run_functions_eagerly(True)`, or inside a
    `Trainer(run_eagerly=True)` loop)."""
    return _eager or _eager_within > 0


@contextlib.contextmanager
def eager_within(enabled: bool) -> Iterator[None]:
    """Inside: steps run eagerly when `enabled` (Trainer's and Keras' `run_eagerly`)."""
    global _eager_within
    _eager_within += enabled
    try:
        yield
    finally:
        _eager_within -= enabled


def warn_eager_once() -> None:
    """TensorFlow's warning: eager steps are slow; how to turn them off."""
    global _eager_warned
    if _eager_warned:
        return
    _eager_warned = True
    logger.warning(
        "Running steps eagerly (op by op, not compiled): for debugging only, it is much "
        "slower. Turn it off with mirrored.config.run_functions_eagerly(False) (or "
        "Trainer(..., run_eagerly=False))."
    )


def device_data_bytes(platform: str | None = None) -> int:
    """The most bytes of training arrays `fit` keeps on each device of `platform` (see the
    module's note): on CPU, unless `MIRRORED_DEVICE_DATA_BYTES` is set, none."""
    chosen = os.environ.get(DEVICE_DATA_ENV)
    if chosen is None:
        return 0 if platform == "cpu" else DEVICE_DATA_BYTES
    try:
        return max(0, int(chosen))
    except ValueError:
        raise ValueError(
            f"Expected {DEVICE_DATA_ENV} to be a number of bytes; found {chosen!r}. Fix: e.g. "
            f"{DEVICE_DATA_ENV}=2000000000, or 0 to read every batch from the host."
        ) from None


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/mirrored/xla`, or `~/.cache/mirrored/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mirrored", "xla")


def compilation_cache_dir() -> str | None:
    """The persistent compilation cache directory this process uses (None: none)."""
    path = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]
    return str(path) if path else None


def set_compilation_cache(path: str | os.PathLike[str] | None) -> None:
    """Cache compiled programs in `path` from now on; `None` turns the cache off.

    Every compiled program is cached (not only those slower than JAX's 1 s default), with
    locked writes and least-recently-used eviction beyond `MAX_CACHE_BYTES`, which scans the
    directory only when it may be full (`_scan_only_when_full`).

    Example:
        >>> mirrored.config.set_compilation_cache("/scratch/xla-cache")
        >>> mirrored.config.set_compilation_cache(None)   # compile everything afresh
    """
    from jax.experimental.compilation_cache import compilation_cache

    global _decided
    _decided = True
    if path is None:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
        return
    directory = os.path.abspath(os.fspath(path))
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # A size bound makes JAX take a file lock around every read and write.
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    _scan_only_when_full()
    compilation_cache.reset_cache()  # a cache opened on another directory is closed


EVICT_TO = 0.9  # a full cache is cut to this fraction of its bound, leaving room to write
_jax_scan: Any = None  # JAX's own LRUCache._evict_if_needed, once replaced


def _scan_only_when_full() -> None:
    """Make JAX's bounded cache scan its directory only when it may be over its bound.

    JAX's `LRUCache.put` stats every entry (and reads its access-time file) before each write:
    measured 160 ms a compiled program with 1,000 entries and 1.5 s with 10,000, so a cache
    that has grown made every compile slower than no cache (an eager step compiles each op:
    25 s became 184 s). Here each process counts the entries' bytes once, then counts the
    bytes it writes; when the count would pass the bound JAX scans and evicts the least
    recently used entries down to `EVICT_TO` of the bound. Other processes' writes are seen
    at the next scan, so the directory exceeds the bound by at most what they wrote since."""
    global _jax_scan
    from jax._src import lru_cache

    if _jax_scan is not None:
        return
    _jax_scan = lru_cache.LRUCache._evict_if_needed
    suffix = lru_cache._CACHE_SUFFIX
    counted: dict[str, int] = {}  # directory -> its bytes: at the last count, plus writes since

    def evict_if_needed(self: Any, *, additional_size: int = 0) -> None:
        directory = str(self.path)
        if directory not in counted:  # a cheaper first count than JAX's scan
            counted[directory] = _bytes_in(directory, suffix)
        if counted[directory] + additional_size <= self.max_size:
            counted[directory] += additional_size
            return
        room = int(self.max_size * (1 - EVICT_TO))
        assert _jax_scan is not None
        _jax_scan(self, additional_size=min(additional_size + room, self.max_size))
        counted[directory] = _bytes_in(directory, suffix) + additional_size

    lru_cache.LRUCache._evict_if_needed = evict_if_needed  # type: ignore[method-assign]


def use_default_compilation_cache() -> None:
    """The default, applied when the first strategy is created (see the module's table)."""
    global _decided
    if _decided:
        return
    _decided = True
    chosen = os.environ.get(ENV)
    if chosen is not None:
        if chosen.strip().lower() not in _OFF:
            set_compilation_cache(chosen)
        return
    if compilation_cache_dir() is not None:  # the user's own JAX setting: theirs to keep
        return
    try:
        set_compilation_cache(default_cache_dir())
    except OSError as error:
        logger.warning(
            "mirrored expected to create its compilation cache in %s; found %s. Programs are "
            "compiled afresh in every process. Fix: set %s to a writable directory, or to 0 to "
            "silence this.",
            default_cache_dir(),
            error,
            ENV,
        )


def _bytes_in(directory: str, suffix: str) -> int:
    """The bytes of the cache entries (names ending in `suffix`) in `directory`."""
    total = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(suffix):
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                    total += entry.stat().st_size
    return total
