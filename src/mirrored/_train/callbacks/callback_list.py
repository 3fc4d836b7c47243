"""The list that calls a `fit`'s callbacks, adding `History` and the progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from mirrored._core import coordination as _coordination
from mirrored._train.callbacks.base import Callback, History, _implements
from mirrored._train.callbacks.progress import ProgbarLogger


class CallbackList:
    """Calls every callback's hook in order, skipping the ones a callback does not implement.

    As in Keras' `CallbackList(add_history=..., add_progbar=...)`, a `History` and a
    `ProgbarLogger(verbose)` are appended after the given callbacks unless one is among them,
    so they see what the others add to the logs.
    """

    def __init__(
        self,
        callbacks: Sequence[Callback] = (),
        *,
        add_history: bool = False,
        add_progbar: bool = False,
        verbose: int = 1,
    ) -> None:
        self.callbacks = list(callbacks)  # checked by fit/evaluate/predict (as_callbacks)
        self.history = next((c for c in self.callbacks if isinstance(c, History)), None)
        if self.history is None and add_history:
            self.history = History()
            self.callbacks.append(self.history)
        if add_progbar and not any(isinstance(c, ProgbarLogger) for c in self.callbacks):
            self.callbacks.append(ProgbarLogger(verbose))
        # The loops ("train", ...) in which every process reads each batch's logs.
        self._read_everywhere: set[str] = set()

    def with_batch_hooks(self, kind: str = "train") -> list[Callback]:
        """The callbacks that implement `on_{kind}_batch_begin` or `on_{kind}_batch_end`."""
        hooks = (f"on_{kind}_batch_begin", f"on_{kind}_batch_end")
        return [c for c in self.callbacks if any(_implements(c, h) for h in hooks)]

    def agree_batch_hooks(
        self, kind: str, owners: Sequence[int], fixed: bool = False
    ) -> tuple[bool, bool]:
        """Whether the `kind` loop ("train", "test", "predict") calls its batch hooks, and
        whether `fit` keeps one step per program (`fixed`, or a hook that reads every batch),
        agreed by the processes `owners` (the strategy's; one: nothing to agree).

        The processes' programs and collectives must match: a process whose callbacks have
        no batch hook runs the same steps as one whose callbacks do, and where some process
        would read a batch's logs (an all-reduce) where another would not (a batch hook of
        your own, or the same callback, on some processes only), every process reads each
        batch's logs, so that no process runs one alone. The progress bar never reads them
        mid-epoch on several processes: it may differ."""
        hooked = self.with_batch_hooks(kind)
        fixed = fixed or any(c.reads_every_batch for c in hooked)
        if len(owners) == 1:
            return bool(hooked), fixed
        end = f"on_{kind}_batch_end"
        ending = [c for c in hooked if _implements(c, end) and not isinstance(c, ProgbarLogger)]
        reads = any(not c.logs_read_on_every_process for c in ending)
        names = ",".join(f"{type(c).__module__}.{type(c).__qualname__}" for c in ending)
        mine = f"{int(fixed)}{int(bool(hooked))}{int(reads)}{names}"
        views = _coordination.everyones(mine, owners, tag=f"batch hooks ({kind})")
        if any(view[2] == "1" for view in views) or len({view[3:] for view in views}) > 1:
            self._read_everywhere.add(kind)
        return any(view[1] == "1" for view in views), any(view[0] == "1" for view in views)

    def __getattr__(self, hook: str) -> Any:
        if hook.startswith("__"):
            raise AttributeError(hook)
        methods = [
            getattr(c, hook)
            for c in self.callbacks
            if not hook.startswith("on_") or _implements(c, hook)
        ]

        # Several processes: logs read lazily on one process only would run the read's
        # all-reduce there alone, and the job would hang; read them on every process first.
        everywhere = (
            hook.endswith("_batch_end")
            and (
                hook.split("_")[1] in self._read_everywhere
                or not all(
                    getattr(getattr(m, "__self__", None), "logs_read_on_every_process", False)
                    for m in methods
                )
            )
            and jax.process_count() > 1
        )

        def call(*args: Any, **kwargs: Any) -> None:
            if everywhere and kwargs.get("logs") is not None:
                kwargs["logs"] = dict(kwargs["logs"])
            elif everywhere and len(args) > 1 and args[1] is not None:
                args = (args[0], dict(args[1]), *args[2:])
            for method in methods:
                method(*args, **kwargs)

        setattr(self, hook, call)  # resolved once per fit
        return call
