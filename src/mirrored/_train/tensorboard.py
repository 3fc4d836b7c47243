"""TensorBoard event files, written with tensorboardX (imported only when a writer is made)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def _import_error(package: str, purpose: str, error: ImportError) -> ImportError:
    return ImportError(
        f"Expected the {package!r} package, {purpose}; found it missing ({error}). Fix: "
        f"pip install {package}"
    )


class EventWriter:
    """Appends summaries to one `events.out.tfevents.*` file in `log_dir`."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise _import_error(
                "tensorboardX", "which the TensorBoard callback writes with", error
            ) from error
        self._writer = SummaryWriter(os.fspath(log_dir))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, step)

    def histogram(self, tag: str, values: np.ndarray, step: int) -> None:
        self._writer.add_histogram(tag, values, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(path: str | os.PathLike[str]) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in one event file, in order (needs `tensorboard`)."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import (
            LegacyEventFileLoader,
        )
    except ImportError as error:
        raise _import_error("tensorboard", "which reads event files back", error) from error
    out: list[tuple[int, str, float]] = []
    event: Any
    for event in LegacyEventFileLoader(os.fspath(path)).Load():
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.append((event.step, value.tag, value.simple_value))
    return out
