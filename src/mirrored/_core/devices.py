"""Turning the device names users type (TensorFlow style) into `jax.Device`s."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TypeAlias

import jax

DeviceLike: TypeAlias = str | int | jax.Device

_NAME = re.compile(r"^/?(?:device:)?(?P<kind>[a-zA-Z_]+):(?P<index>\d+)$")
# TensorFlow spells accelerators "gpu"; JAX reports "cuda"/"rocm" as the platform.
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _describe(devices: Sequence[jax.Device]) -> str:
    return ", ".join(device_name(d) for d in devices) or "(none)"


def device_name(device: jax.Device) -> str:
    """TensorFlow-style name of a device, e.g. ``"/cpu:3"`` or ``"/gpu:0"``."""
    kind = "gpu" if device.platform in _GPU_PLATFORMS else device.platform
    return f"/{kind}:{device.id}"


def _candidates(kind: str) -> list[jax.Device]:
    kind = kind.lower()
    platforms = _GPU_PLATFORMS if kind == "gpu" else (kind,)
    found: list[jax.Device] = []
    for platform in platforms:
        try:
            found.extend(jax.local_devices(backend=platform))
        except RuntimeError:
            continue
    return found


def _missing_device_error(spec: object, kind: str) -> ValueError:
    available = _describe(jax.local_devices())
    hint = (
        " If the machine has GPUs, check that a CUDA-enabled jaxlib is installed "
        "(pip install 'mirrored[cuda]') and that CUDA_VISIBLE_DEVICES does not hide them."
        if kind.lower() in _GPU_PLATFORMS
        else ""
    )
    return ValueError(
        f"Expected devices of this machine; found {spec!r}, which does not exist. Devices "
        f"that do exist: {available}.{hint} "
        "Fix: pass one of the devices listed, or devices=None for all local devices."
    )


def resolve_device(spec: DeviceLike) -> jax.Device:
    """Resolve one device given as ``"/gpu:0"``, ``"gpu:0"``, ``"/cpu:3"``, an int or a Device."""
    if isinstance(spec, jax.Device):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"Expected a device name, an int or a jax.Device; found {spec!r}.")
    if isinstance(spec, int):
        local = jax.local_devices()
        if not 0 <= spec < len(local):
            raise _missing_device_error(spec, local[0].platform if local else "")
        return local[spec]
    if isinstance(spec, str):
        match = _NAME.match(spec.strip())
        if match is None:
            raise ValueError(
                f"Expected a device name like '/gpu:0', 'gpu:0' or '/cpu:3'; found {spec!r}. "
                f"Devices that exist: {_describe(jax.local_devices())}."
            )
        kind, index = match["kind"], int(match["index"])
        candidates = _candidates(kind)
        if not 0 <= index < len(candidates):
            raise _missing_device_error(spec, kind)
        return candidates[index]
    raise TypeError(
        f"Expected a device name like '/gpu:0', an int or a jax.Device; found {spec!r} "
        f"of type {type(spec).__name__}."
    )


def resolve_devices(specs: Sequence[DeviceLike] | None) -> list[jax.Device]:
    """All local devices of the default backend when `specs` is None, else each one resolved."""
    if specs is None:
        return list(jax.local_devices())
    if isinstance(specs, str | int | jax.Device):
        specs = [specs]
    devices = [resolve_device(s) for s in specs]
    if not devices:
        raise ValueError(
            "Expected at least one device; found an empty list. "
            "Fix: pass devices=None to use every local device."
        )
    if len(set(devices)) != len(devices):
        raise ValueError(
            f"Expected each device once; found duplicates in {[device_name(d) for d in devices]}. "
            "Fix: list every device a single time."
        )
    platforms = {d.platform for d in devices}
    if len(platforms) > 1:
        raise ValueError(
            f"Expected devices of one platform; found {sorted(platforms)} in "
            f"{[device_name(d) for d in devices]}. Fix: mirror on GPUs or on CPUs, not both."
        )
    return devices


def owning_processes(devices: Sequence[jax.Device]) -> list[int]:
    """The indices of the processes that own `devices`, in order: every process of the job,
    or one alone (a strategy over a process' own devices: the chief's evaluation, say)."""
    return sorted({d.process_index for d in devices})
