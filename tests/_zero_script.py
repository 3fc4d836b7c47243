"""A worker of a 2-process job (test_sharded_optimizer): trains SmallMLP with a mirrored
nnx.Optimizer, a ShardedOptimizer (ZeRO-1) and one with shard_gradients=True (ZeRO-2) on the
same batches; checks that no device holds a whole split state leaf; saves the ZeRO-1 state
and restores it into fresh optimizers of both kinds. The chief writes OUT/result.npz.

    python _zero_script.py OUT
"""

import os
import sys

import mirrored

strategy = mirrored.MultiWorkerMirroredStrategy()  # first: starts jax.distributed

import jax  # noqa: E402
import jax.experimental.multihost_utils  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP, global_batches, train_step  # noqa: E402

out = sys.argv[1]
rank, n = jax.process_index(), strategy.num_replicas_in_sync
batches = global_batches(6, 24, seed=1)
x = np.concatenate([b[0] for b in batches])[:130]  # 130 rows: the last batch is ragged
y = np.concatenate([b[1] for b in batches])[:130]
makers = {
    "mirrored": lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param),
    "zero1": lambda m: mirrored.ShardedOptimizer(m, optax.adam(1e-2)),
    "zero2": lambda m: mirrored.ShardedOptimizer(m, optax.adam(1e-2), shard_gradients=True),
}
result = {}
trained = {}
for name, make in makers.items():
    with strategy.scope():
        model = SmallMLP(rngs=nnx.Rngs(0))
        optimizer = make(model)
    for xb, yb in strategy.experimental_distribute_dataset((x, y), batch_size=24):
        strategy.run(train_step, args=(model, optimizer, xb, yb))
    trained[name] = (model, optimizer)
    state = jax.tree.leaves(nnx.state((model, optimizer)))
    for i, leaf in enumerate(state):  # every process holds the whole of each (gathered)
        result[f"{name}/{i}"] = np.asarray(
            jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)
        )
    if name != "mirrored":  # no device holds a whole split leaf
        for leaf in jax.tree.leaves(nnx.state(optimizer.opt_state)):
            if leaf.ndim and not leaf.sharding.is_fully_replicated:
                for shard in leaf.addressable_shards:
                    assert shard.data.size * n == leaf.size, (leaf.shape, shard.data.shape)

model, optimizer = trained["zero1"]
mirrored.save_checkpoint(os.path.join(out, "ckpt"), model, optimizer, step=3)  # every process
jax.experimental.multihost_utils.sync_global_devices("saved")  # the chief has written it
for name in ("mirrored", "zero1"):
    with strategy.scope():
        target = SmallMLP(rngs=nnx.Rngs(9))
        target_optimizer = makers[name](target)
    assert mirrored.restore_checkpoint(os.path.join(out, "ckpt"), target, target_optimizer) == 3
    for i, leaf in enumerate(jax.tree.leaves(nnx.state((target, target_optimizer)))):
        result[f"restored_{name}/{i}"] = np.asarray(
            jax.experimental.multihost_utils.process_allgather(leaf, tiled=True)
        )
if rank == 0:
    np.savez(os.path.join(out, "result.npz"), **result)
print(f"process {rank} done", flush=True)
