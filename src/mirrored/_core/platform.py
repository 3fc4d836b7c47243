"""Simulating several CPU devices, for tests, the demo and laptops without accelerators."""

from __future__ import annotations

import os
import time

import jax


def _backends_initialized() -> bool:
    # Private in JAX; if it moves, assume the backend is not up yet and let JAX decide.
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - depends on the JAX version
        return False
    check = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(check()) if check is not None else False


def simulate_cpu_devices(n: int) -> None:
    """Make JAX's CPU backend expose `n` devices. Call before any JAX computation.

    Also sizes XLA's CPU thread pool (`NPROC`) to at least twice the device count: with fewer
    threads than the collectives need, simulated devices deadlock in all-reduce.

    Example:
        >>> import mirrored
        >>> mirrored.simulate_cpu_devices(8)
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"Expected a positive number of CPU devices; found {n!r}.")
    if _backends_initialized():
        found = len(jax.devices("cpu"))
        if found == n:
            return
        raise RuntimeError(
            f"Expected to simulate {n} CPU devices, but JAX's backend already started with "
            f"{found}. Fix: call mirrored.simulate_cpu_devices({n}) before any JAX computation "
            "(right after the imports), or set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{n} before starting Python."
        )
    threads = max(2 * n, os.cpu_count() or 1)
    if int(os.environ.get("NPROC", "0") or 0) < threads:
        os.environ["NPROC"] = str(threads)
    jax.config.update("jax_num_cpu_devices", n)


_IMPORTED = time.perf_counter()


def seconds_since_start() -> float:
    """Seconds since this process started (Linux); elsewhere since mirrored was imported."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command's name
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return up - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED
