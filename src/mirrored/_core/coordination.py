"""Agreements between processes through jax.distributed's key-value store, off the devices:
nothing waits behind the device queues, and any thread may take part."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

WAIT_SLICE_MS = 10_000  # a peer still busy is asked again; a stalled one is the watchdog's


def coordination_client() -> Any:
    """The client of jax.distributed's coordination service (its key-value store), or None
    in a process that did not start jax.distributed."""
    from jax._src import distributed

    return distributed.global_state.client


class Exchange:
    """Rounds in which every process of `count` gives one text and reads everyone's.

    Each round is one key per process, `{name}/{round}/{rank}`. A process's key of round r is
    deleted when it finishes round r + 1: every process had set its key of round r + 1, so
    had read round r. The processes must run the same rounds in the same order (as they do
    collectives). A peer that never answers is left to the hang watchdog
    (`mirrored._run.hang`), which names it and ends the job; this process waits in the
    "input" phase meanwhile."""

    def __init__(self, name: str, count: int, rank: int) -> None:
        self.name, self.count, self.rank = name, count, rank
        self.round = 0

    def __call__(self, value: str) -> list[str]:
        client = coordination_client()
        if client is None:
            raise RuntimeError(
                "Expected jax.distributed to be running for an input pipeline per process; "
                "found no coordination service. Fix: start the job with `mirrored launch` "
                "or mirrored.MultiWorkerMirroredStrategy()."
            )
        round_, self.round = self.round, self.round + 1
        client.key_value_set(f"{self.name}/{round_}/{self.rank}", value)
        values = [self._get(client, f"{self.name}/{round_}/{r}") for r in range(self.count)]
        if round_:
            client.key_value_delete(f"{self.name}/{round_ - 1}/{self.rank}")
        return values

    @staticmethod
    def _get(client: Any, key: str) -> str:
        while True:
            try:
                return str(client.blocking_key_value_get(key, WAIT_SLICE_MS))
            except Exception as error:  # XlaRuntimeError: DEADLINE_EXCEEDED, or a real one
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise


_decision_rounds: dict[tuple[int, ...], Exchange] = {}  # per group of processes, on first use


def everyones(value: str, owners: Sequence[int] | None = None, tag: str = "") -> list[str]:
    """Every process's `value`, in rank order, among the processes `owners` (a strategy's,
    `devices.owning_processes`; None: every process of the job); `[value]` for one.

    Every process of the group must call it at the same point of the program, as a
    collective. `tag` names the decision: a round in which the processes made different
    decisions (a call made on some processes only) is an error naming both, not one
    decision read as the other's answer."""
    import jax

    group = tuple(range(jax.process_count())) if owners is None else tuple(owners)
    if len(group) == 1:
        return [value]
    exchange = _decision_rounds.get(group)
    if exchange is None:
        name = "mirrored/chief"
        if len(group) != jax.process_count():
            name += "/" + "-".join(map(str, group))
        exchange = Exchange(name, len(group), group.index(jax.process_index()))
        _decision_rounds[group] = exchange
    views = [view.split("|", 1) for view in exchange(f"{tag}|{value}")]
    tags = [tag for tag, _ in views]
    if len(set(tags)) > 1:
        raise RuntimeError(
            "Expected every process to take the same decision in this round of agreement; "
            f"found processes {list(group)} taking {tags}: a call (a callback, an evaluate) "
            "made on some processes only. Fix: give every process of the job the same "
            "callbacks and calls (a callback may act on the chief only inside its hooks)."
        )
    return [value for _, value in views]


def chiefs(value: str, owners: Sequence[int] | None = None, tag: str = "") -> str:
    """The chief's `value` (the first of `owners`), on every process of the group (`value`
    itself for one).

    For a decision that a process's own view could get wrong (a file listing, a clock):
    every process must call it at the same point of the program, as a collective."""
    return everyones(value, owners, tag)[0]
