"""TensorFlow's `distribute_datasets_from_function`: an input pipeline per process, each
local replica taking its own batch from it; across processes, each step's batch shape and the
end of the data are agreed (`mirrored._core.coordination.Exchange`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from mirrored._core import coordination as _coordination
from mirrored._data import batching as _batching
from mirrored._data import input as _input

if TYPE_CHECKING:
    from mirrored._core.hooks import StrategyLike as Strategy

_PIPELINES = itertools.count()  # datasets from a function over processes, in creation order


def per_replica_batches(
    source: Iterable[Any],
    *,
    num_replicas: int,
    processes: tuple[int, int],
    exchange: _coordination.Exchange | None = None,
) -> Iterator[_input.HostBatch]:
    """TensorFlow's `distribute_datasets_from_function`: each local replica takes its own batch.

    With several processes each one's pipeline is its own, and their lengths and ragged
    batches may differ: each step's longest per-replica batch is agreed through `exchange`
    (TensorFlow all-reduces "has data" every step), so every process places a batch of the
    same shape, and one whose data ran out gives replicas of padding alone until every
    process's has run out."""
    local_replicas = num_replicas // processes[0]
    structure = _input.Structure()
    target = 0
    elements = iter(source)
    last: list[Any] | None = None  # the last real leaves: padding for a process out of data
    while True:
        parts = []
        for batch in itertools.islice(elements, local_replicas):
            _, leaves = structure.leaves(batch)
            rows = _batching.leading_size(leaves)
            _input.nonempty(rows)
            parts.append((leaves, rows))
        longest = max((rows for _, rows in parts), default=0)
        if exchange is not None:
            longest = max(int(value) for value in exchange(str(longest)))
        if longest == 0:
            return
        if parts:
            last = parts[0][0]
        elif last is None:
            raise ValueError(
                f"Expected every process's input pipeline to yield a batch at the first step; "
                f"process {processes[1]}'s yielded none while another's did. Fix: give each "
                "process's dataset_fn at least one batch (shard the data so that every "
                "input_context.input_pipeline_id gets some)."
            )
        target = max(target, longest)
        assert last is not None and structure.treedef is not None
        empty = [np.zeros((0, *np.shape(x)[1:]), np.asarray(x).dtype) for x in last]
        parts += [(empty, 0)] * (local_replicas - len(parts))  # the data ran out mid-step
        columns = zip(
            *(_batching.pad_to(leaves, rows, target, last) for leaves, rows in parts),
            strict=True,
        )
        leaves = [np.concatenate(column) for column in columns]
        mask = np.concatenate([_batching.example_mask(rows, target) for _, rows in parts])
        # Each process's pipeline sees only its own rows: across processes the real count is
        # the sum of every process's mask, taken on the devices.
        count = sum(rows for _, rows in parts) if processes[0] == 1 else None
        yield _input.HostBatch(structure.treedef, leaves, mask, count, target * num_replicas)


def distribute_from_function(
    strategy: Strategy,
    dataset_fn: Callable[[_input.InputContext], Any],
    options: _input.InputOptions | None,
) -> _input.DistributedDataset:
    n = strategy.num_replicas_in_sync
    processes = _input.process_info(strategy)
    context = _input.InputContext(processes[0], processes[1], n)
    dataset = dataset_fn(context)
    if not isinstance(dataset, Iterable):
        raise TypeError(
            f"Expected dataset_fn to return an iterable of per-replica batches; found "
            f"{type(dataset).__name__}. Fix: return a dataset batched with "
            "input_context.get_per_replica_batch_size(global_batch_size)."
        )
    length = _input.source_length(dataset)
    local_replicas = n // processes[0]
    steps = None if length is None else math.ceil(length / local_replicas)
    exchange = None
    if processes[0] > 1:  # the same creation order on every process names the same rounds
        exchange = _coordination.Exchange(f"mirrored/input/{next(_PIPELINES)}", *processes)
        lengths = exchange("" if steps is None else str(steps))
        steps = None if "" in lengths else max(int(value) for value in lengths)

    def batches(source: Iterable[Any]) -> Iterator[_input.HostBatch]:
        return per_replica_batches(source, num_replicas=n, processes=processes, exchange=exchange)

    return _input.DistributedDataset(
        strategy, _input.each_epoch(dataset, batches), length=steps, options=options
    )
