"""Input distribution: every source, exact ragged batches, prefetch, InputContext."""

import gc
import subprocess
import sys
import threading

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mirrored
from _helpers import (
    SmallMLP,
    max_relative_difference,
    params_of,
    subprocess_env,
    train_single_device,
    train_step,
)
from mirrored._data import batching as _batching
from mirrored._data import input as _input


@pytest.fixture
def strategy(devices):
    return mirrored.MirroredStrategy(devices)


def real_rows(strategy, value):
    """The real (unpadded) rows of a distributed batch leaf, in replica order."""
    return np.asarray(strategy.gather(value, axis=0))


# -- every example exactly once --------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_example_once_per_epoch_with_a_ragged_last_batch(devices, n, shuffle):
    strategy = mirrored.MirroredStrategy(devices[:n])
    ids = np.arange(1000)
    features = np.stack([ids, -ids], axis=1).astype(np.float32)
    dist = strategy.experimental_distribute_dataset(
        (features, ids), batch_size=64, shuffle=shuffle, seed=1
    )
    assert len(dist) == 16  # ceil(1000 / 64): the last batch holds 40
    seen, shapes = [], set()
    for x, y in dist:
        shapes.add(x.global_value.shape)
        got = real_rows(strategy, y)
        np.testing.assert_array_equal(real_rows(strategy, x)[:, 0], got)
        seen.extend(got.tolist())
    assert sorted(seen) == list(range(1000))
    assert shapes == {(64 + (-64) % n, 2)}  # static: padded to a multiple of n, never smaller


def test_ragged_mask_marks_exactly_the_real_rows(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.arange(13)]))
    mask = np.asarray(batch.mask.global_value)
    assert mask.shape == (16,) and mask.sum() == 13 and mask[:13].all()
    per_replica = [np.asarray(m) for m in strategy.experimental_local_results(batch.mask)]
    assert [int(m.sum()) for m in per_replica] == [2, 2, 2, 2, 2, 2, 1, 0]


# -- exactness of training on ragged data ------------------------------------------------------


@pytest.mark.parametrize("n", [3, 8])
def test_training_with_a_ragged_last_batch_equals_single_device(devices, n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 12)).astype(np.float32)
    y = rng.integers(0, 5, 100).astype(np.int32)
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 100, 32)]  # 32, 32, 32, 4
    expected = train_single_device(batches, lambda: optax.sgd(0.5))
    strategy = mirrored.MirroredStrategy(devices[:n])
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    traces = []

    def step(model, optimizer, x, y):
        traces.append(1)
        return train_step(model, optimizer, x, y)

    for xb, yb in strategy.experimental_distribute_dataset((x, y), batch_size=32):
        strategy.run(step, args=(model, optimizer, xb, yb))
    got = params_of(model)
    for name, value in expected.items():
        assert max_relative_difference(got[name], value) <= 1e-5, name
    assert len(traces) == 2  # layout trace + program trace: the last batch did not recompile


def test_loss_of_a_mostly_padded_batch_averages_only_real_examples(strategy):
    batches = [np.full(16, 1.0, np.float32), np.full(3, 2.0, np.float32)]
    full, ragged = list(strategy.experimental_distribute_dataset(batches))
    assert ragged.global_value.shape == (16,)  # padded to the first batch's static shape

    def fn(x):
        return mirrored.compute_average_loss(x)

    assert float(strategy.reduce("SUM", strategy.run(fn, args=(full,)))) == 1.0
    assert float(strategy.reduce("SUM", strategy.run(fn, args=(ragged,)))) == 2.0


def test_mask_and_count_reach_the_replica_context(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.ones(10, np.float32)]))

    def fn(x):
        ctx = mirrored.get_replica_context()
        return jnp.sum(x * ctx.example_mask), ctx.example_count

    hits, count = strategy.run(fn, args=(batch,))
    assert float(strategy.reduce("SUM", hits)) == 10.0 and int(count) == 10


def test_misaligned_losses_are_refused(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.ones((16, 2), np.float32)]))
    with pytest.raises(ValueError, match=r"this replica's 2 rows"):
        strategy.run(lambda x: mirrored.compute_average_loss(x.reshape(-1)), args=(batch,))


def test_gather_of_a_padded_batch_drops_padding(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([np.arange(11)]))
    np.testing.assert_array_equal(strategy.gather(batch, 0), np.arange(11))


# -- sources -----------------------------------------------------------------------------------


def test_shuffle_is_seeded_and_differs_per_epoch(strategy):
    y = np.arange(64)

    def epoch(dist):
        return np.concatenate([real_rows(strategy, b) for (b,) in dist])

    first = strategy.experimental_distribute_dataset((y,), batch_size=16, shuffle=True, seed=3)
    again = strategy.experimental_distribute_dataset((y,), batch_size=16, shuffle=True, seed=3)
    e1, e2 = epoch(first), epoch(first)
    assert sorted(e1) == list(range(64)) and not np.array_equal(e1, e2)
    assert np.array_equal(e1, epoch(again))


def test_a_restarted_loop_reads_the_order_of_the_epoch_it_asks_for(strategy):
    """Issue 35, item 5: `iter(dataset)` numbers epochs by this process' passes, so a job
    restarted at epoch 2 would replay epoch 1's order. `epoch_iterator(epoch)` asks for the
    epoch: mirrored's own shuffle is seeded by it, and a source with `set_epoch` (PyTorch's
    DistributedSampler convention, directly or as a DataLoader's `sampler`) is told it."""
    y = np.arange(64)

    def rows(batches):
        return np.concatenate([real_rows(strategy, b) for (b,) in batches])

    def shuffled():
        return strategy.experimental_distribute_dataset((y,), batch_size=16, shuffle=True, seed=3)

    uninterrupted = shuffled()
    _, second = rows(uninterrupted), rows(uninterrupted)
    np.testing.assert_array_equal(rows(shuffled().epoch_iterator(2)), second)  # restarted

    class Sampler:  # a per-replica source seeded by its epoch
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    class Source:
        def __init__(self, on_sampler):
            self.sampler = Sampler()
            if not on_sampler:
                self.set_epoch = self.sampler.set_epoch

        def __iter__(self):
            order = np.random.default_rng(self.sampler.epochs[-1]).permutation(64)
            return iter([(y[order[i : i + 2]],) for i in range(0, 64, 2)])

    for on_sampler in (False, True):
        sources = []

        def from_function(ctx, on_sampler=on_sampler, sources=sources):
            sources.append(Source(on_sampler))
            return sources[-1]

        first = strategy.distribute_datasets_from_function(from_function)
        epoch_0, epoch_1 = rows(first), rows(first)
        assert sources[0].sampler.epochs == [0, 1] and not np.array_equal(epoch_0, epoch_1)
        restarted = strategy.distribute_datasets_from_function(from_function)
        np.testing.assert_array_equal(rows(restarted.epoch_iterator(2)), epoch_1)
        assert sources[1].sampler.epochs == [1]


def test_iterables_and_dicts_of_batches(strategy):
    x, y = np.arange(144).reshape(48, 3), np.arange(48)
    batches = [{"x": x[i : i + 16], "y": y[i : i + 16]} for i in range(0, 48, 16)]
    out = list(strategy.experimental_distribute_dataset(batches))
    assert len(out) == 3 and set(out[0]) == {"x", "y"}
    assert out[0]["x"].shape == (2, 3)
    for got, batch in zip(out, batches, strict=True):
        for key in ("x", "y"):
            np.testing.assert_array_equal(real_rows(strategy, got[key]), batch[key])
    generated = list(strategy.experimental_distribute_dataset(b for b in batches))
    assert [real_rows(strategy, b["y"]).tolist() for b in generated] == [
        b["y"].tolist() for b in batches
    ]


def test_grain_datasets(strategy):
    records = np.arange(50)
    batched = grain.MapDataset.source(records).batch(16)
    dist = strategy.experimental_distribute_dataset(batched)
    assert len(dist) == 4
    assert np.concatenate([real_rows(strategy, b) for b in dist]).tolist() == list(range(50))
    by_us = strategy.experimental_distribute_dataset(
        grain.MapDataset.source(records), batch_size=16
    )
    assert sum(len(real_rows(strategy, b)) for b in by_us) == 50
    streamed = grain.MapDataset.source(records).to_iter_dataset().batch(16)
    got = np.concatenate(
        [real_rows(strategy, b) for b in strategy.experimental_distribute_dataset(streamed)]
    )
    assert got.tolist() == list(range(50))


def test_tf_data_when_installed(strategy):
    tf = pytest.importorskip("tensorflow", reason="tensorflow is optional and not installed here")
    ds = tf.data.Dataset.from_tensor_slices((np.arange(20), np.arange(20) * 2)).batch(8)
    rows = [real_rows(strategy, y) for _, y in strategy.experimental_distribute_dataset(ds)]
    assert np.concatenate(rows).tolist() == list(range(0, 40, 2))


def test_torch_dataloader_when_installed(strategy):
    torch = pytest.importorskip("torch", reason="torch is optional and not installed here")
    data = torch.utils.data.TensorDataset(torch.arange(20), torch.arange(20) * 2)
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    rows = [real_rows(strategy, y) for _, y in strategy.experimental_distribute_dataset(loader)]
    assert np.concatenate(rows).tolist() == list(range(0, 40, 2))


def test_drop_remainder(strategy):
    dist = strategy.experimental_distribute_dataset(
        (np.arange(100).reshape(100, 1),), batch_size=32, drop_remainder=True
    )
    assert len(dist) == 3
    rows = [real_rows(strategy, b) for (b,) in dist]
    assert np.concatenate(rows).ravel().tolist() == list(range(96))  # the last 4 dropped


def test_without_prefetch(strategy):
    options = mirrored.InputOptions(experimental_fetch_to_device=False)
    dist = strategy.experimental_distribute_dataset((np.arange(40),), options, batch_size=16)
    assert sum(len(real_rows(strategy, b)) for (b,) in dist) == 40


def test_prefetch_runs_ahead_on_a_background_thread(strategy):
    produced = []

    def source():
        for i in range(4):
            produced.append(threading.current_thread().name)
            yield np.full(8, i)

    options = mirrored.InputOptions(experimental_per_replica_buffer_size=3)
    iterator = iter(strategy.experimental_distribute_dataset(source(), options))
    next(iterator)
    for _ in range(100):  # the producer fills the buffer without being asked
        if len(produced) == 4:
            break
        threading.Event().wait(0.01)
    assert produced == ["mirrored-prefetch"] * 4


def test_an_iterator_dropped_unfinished_stops_its_prefetch_thread(strategy):
    """Before: the thread held its Prefetcher, which was never collected; every abandoned
    iterator left a thread waking 20 times a second for the life of the process."""

    def prefetching():
        return {t for t in threading.enumerate() if t.name == "mirrored-prefetch"}

    before = prefetching()
    options = mirrored.InputOptions(experimental_per_replica_buffer_size=1)
    for _ in range(3):
        for _batch in strategy.experimental_distribute_dataset(
            np.ones((64, 2)), options, batch_size=8
        ):
            break  # 8 batches: the buffer is full and the thread waits to put the next one
    gc.collect()
    for _ in range(200):
        if not prefetching() - before:
            break
        threading.Event().wait(0.01)
    assert not prefetching() - before


_BREAK_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np
import mirrored

strategy = mirrored.MirroredStrategy()
options = mirrored.InputOptions(experimental_per_replica_buffer_size=100_000)
x = np.ones((20_000, 256), np.float32)
for (batch,) in strategy.experimental_distribute_dataset((x,), options, batch_size=8):
    break  # the prefetch thread goes on placing batches as the script ends
print("done")
"""


def test_a_loop_that_breaks_early_lets_the_script_exit_cleanly():
    """Python 3.11/3.12 end a daemon thread that is inside a C++ call (a device_put) at exit
    by unwinding it, which aborted the finished script (134, "FATAL: exception not
    rethrown"); mirrored stops and joins its threads first."""
    result = subprocess.run(
        [sys.executable, "-c", _BREAK_SCRIPT],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "done"), result.stderr[-2000:]


def test_a_bad_batch_midway_raises_in_order(strategy):
    batches = [np.zeros(8), np.zeros(8), np.ones(8), "bad"]
    seen = []
    with pytest.raises(TypeError, match="found str"):
        for batch in strategy.experimental_distribute_dataset(batches):
            seen.append(batch)
    assert len(seen) == 3


# -- distribute_datasets_from_function ------------------------------------------------------------


def test_distribute_datasets_from_function(strategy):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(32)
        return grain.MapDataset.source(np.arange(70)).batch(per_replica)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    (ctx,) = contexts
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 8)
    batches = list(dist)
    assert len(dist) == 3 and len(batches) == 3
    first = [np.asarray(v) for v in strategy.experimental_local_results(batches[0])]
    assert [v.tolist() for v in first[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # replica i: batch i
    assert np.concatenate([real_rows(strategy, b) for b in batches]).tolist() == list(range(70))


class _PeerExchange:
    """`from_function.per_replica_batches`' agreement, as this process of two sees it: the
    other process's values are scripted, this one's are recorded."""

    def __init__(self, peer):
        self.peer, self.sent = list(peer), []

    def __call__(self, value):
        self.sent.append(value)
        return [value, self.peer.pop(0)]


def test_pipelines_of_unequal_lengths_agree_on_each_steps_shape_and_the_end():
    from mirrored._data import from_function

    # Process 0 of 2 (2 replicas each): 2 steps of its own; the other process has rows in 3
    # steps, its longest per-replica batch 3, 1 and 2 rows.
    mine = [np.arange(2.0), np.arange(2.0, 3.0), np.arange(3.0, 6.0)]
    exchange = _PeerExchange(["3", "1", "2", "0"])
    batches = list(
        from_function.per_replica_batches(mine, num_replicas=4, processes=(2, 0), exchange=exchange)
    )
    assert exchange.sent == ["2", "3", "0", "0"] and not exchange.peer
    # Every step as long as the longest per-replica batch of any process so far (3 rows a
    # replica: 12 global), this process's replicas padded, or all padding once it ran out.
    assert [b.size for b in batches] == [12, 12, 12]
    assert [b.mask.tolist() for b in batches] == [
        [1, 1, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]
    assert all(b.real is None for b in batches)  # counted on the devices, over processes
    assert batches[0].leaves[0][:2].tolist() == [0.0, 1.0]
    assert batches[2].leaves[0].shape == (6,) and batches[2].leaves[0].dtype == np.float64
    # A process with no batch at all while another has some cannot pad: a clear error.
    with pytest.raises(ValueError, match="process 1's yielded none while another's did"):
        list(
            from_function.per_replica_batches(
                [], num_replicas=4, processes=(2, 1), exchange=_PeerExchange(["2"])
            )
        )


def test_input_context_per_replica_batch_size():
    ctx = mirrored.InputContext(num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(64) == 8
    with pytest.raises(ValueError, match=r"divisible by the 8 replicas; found 60 \(7.5 per"):
        ctx.get_per_replica_batch_size(60)
    with pytest.raises(ValueError, match="0 examples"):
        ctx.get_per_replica_batch_size(4)


def test_input_options_are_validated():
    with pytest.raises(ValueError, match="positive int"):
        mirrored.InputOptions(experimental_per_replica_buffer_size=0)


# -- multi-process slicing (pure logic, process count mocked) --------------------------------------


def test_process_rows_partition_the_padded_batch():
    blocks = [_batching.process_rows(64, 4, p) for p in range(4)]
    assert [(b.start, b.stop) for b in blocks] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    with pytest.raises(ValueError, match="same number of devices"):
        _batching.process_rows(30, 4, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_process_gathers_only_its_rows(shuffle):
    ids = np.arange(50)
    common = dict(batch_size=16, shuffle=shuffle, seed=0, epoch=1, drop_remainder=False)
    single = list(_input.array_batches((ids,), num_replicas=8, processes=(1, 0), **common))
    parts = [
        list(_input.array_batches((ids,), num_replicas=8, processes=(2, p), **common))
        for p in range(2)
    ]
    for whole, first, second in zip(single, *parts, strict=True):
        rows = np.concatenate([first.leaves[0], second.leaves[0]])
        np.testing.assert_array_equal(np.concatenate([first.mask, second.mask]), whole.mask)
        np.testing.assert_array_equal(rows[whole.mask], whole.leaves[0][whole.mask])
        # Padded rows, on either process, are copies of the batch's real rows.
        assert set(rows[~whole.mask]) <= set(whole.leaves[0][whole.mask])
        assert first.real == whole.real == second.real and first.leaves[0].shape == (8,)


def test_iterable_batches_per_process():
    batches = [np.arange(16), np.arange(16, 21)]
    parts = [
        list(_input.iterable_batches(batches, num_replicas=8, processes=(2, p))) for p in range(2)
    ]
    last = [p[1] for p in parts]
    assert [b.mask.sum() for b in last] == [5, 0] and last[0].real == 5
    assert np.concatenate([b.leaves[0] for b in last])[:5].tolist() == list(range(16, 21))


def test_distributed_dataset_uses_the_process_slice(strategy, monkeypatch):
    monkeypatch.setattr(_input, "process_info", lambda strategy=None: (2, 1))
    dist = _input.distribute_dataset(
        strategy,
        (np.arange(32),),
        None,
        batch_size=32,
        shuffle=False,
        seed=0,
        drop_remainder=False,
    )
    host = list(dist._batches(1))
    assert host[0].leaves[0].tolist() == list(range(16, 32))


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("batches", "error", "match"),
    [
        ([(np.zeros((8, 2)), np.zeros(16))], ValueError, r"same leading \(batch\) size"),
        ([(np.zeros((8, 2)), "labels")], TypeError, "found str"),
        ([], ValueError, "yielded none"),
        ([(np.zeros((8, 2)),), {"x": np.zeros((8, 2))}], ValueError, "structure of the first"),
        ([(np.zeros((0, 2)),)], ValueError, "0 rows"),
        ([(np.float32(1.0),)], ValueError, r"leading batch axis.*\.batch\(global_batch_size\)"),
        ([np.zeros(3)], ValueError, "gives each of the 8 replicas 0 examples"),
    ],
)
def test_bad_batches(strategy, batches, error, match):
    with pytest.raises(error, match=match):
        list(strategy.experimental_distribute_dataset(batches))


def test_bad_arguments(strategy):
    with pytest.raises(TypeError, match="batch_size=256"):
        strategy.experimental_distribute_dataset(np.zeros((8, 2)))
    with pytest.raises(ValueError, match="GLOBAL batch size"):
        strategy.experimental_distribute_dataset((np.zeros((8, 2)),), batch_size=0)
    with pytest.raises(ValueError, match="0 examples"):
        strategy.experimental_distribute_dataset((np.zeros((8, 2)),), batch_size=4)
    with pytest.raises(ValueError, match="shuffle inside the pipeline"):
        strategy.experimental_distribute_dataset([np.zeros(8)], shuffle=True)
    with pytest.raises(ValueError, match="non-empty"):
        strategy.experimental_distribute_dataset((np.zeros((0, 2)),), batch_size=8)
    with pytest.raises(TypeError, match="unknown"):
        len(strategy.experimental_distribute_dataset(b for b in [np.zeros(8)]))


def test_jax_arrays_are_accepted(strategy):
    (batch,) = list(strategy.experimental_distribute_dataset([jax.numpy.ones((16, 2))]))
    assert batch.global_value.sharding.spec == jax.sharding.PartitionSpec(mirrored.REPLICA_AXIS)
