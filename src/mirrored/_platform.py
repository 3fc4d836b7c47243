"""Simulating several CPU devices, for tests, the demo and laptops without accelerators."""

from __future__ import annotations

import os

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
