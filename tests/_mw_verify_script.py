"""A worker of a multi-worker job, started by test_multiworker through `mirrored launch`:
`mirrored.verify` on several processes (issue 33, item 13). Each process builds its model
with its own seed; prints one line per verification: `VERIFY <case> <check>=<status>...`.

    python _mw_verify_script.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import mirrored

strategy = mirrored.MultiWorkerMirroredStrategy()  # first: starts jax.distributed

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _helpers import SmallMLP, global_batches, train_step  # noqa: E402

rank = jax.process_index()


def show(case, report):
    statuses = " ".join(f"{c.name.replace(' ', '_')}={c.status}" for c in report.checks)
    print(f"VERIFY {case} {statuses}", flush=True)
    if case == "diverged":
        print(f"SUMMARY {report['Processes agree'].summary}", flush=True)


with strategy.scope():
    model = SmallMLP(rngs=nnx.Rngs(100 + rank))  # unseeded, as far as the processes go
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
((x, y),) = list(strategy.experimental_distribute_dataset(global_batches(1, 64)))
show("dataset", mirrored.verify(strategy, train_step, (model, optimizer, x, y)))

xs, ys = global_batches(1, 64)[0]


def dataset_fn(ctx):
    low = ctx.input_pipeline_id * 32  # each process its own half of the global batch
    return [(xs[low : low + 32], ys[low : low + 32])]


((bx, by),) = list(strategy.distribute_datasets_from_function(dataset_fn))
show("from_function", mirrored.verify(strategy, train_step, (model, optimizer, bx, by)))

keras.utils.set_random_seed(rank)
with strategy.scope():
    keras_model = keras.Sequential([keras.Input((xs.shape[1],)), keras.layers.Dense(5)])
    keras_model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
show("keras", mirrored.verify(strategy, keras_model, (xs, ys), batch_size=32))

# A process writes its own value into mirrored state outside run: the processes diverged.
kernel = model.hidden.kernel
local = np.asarray(kernel.get_value().addressable_data(0)) + rank
kernel.set_value(jax.make_array_from_process_local_data(kernel.get_value().sharding, local))
show("diverged", mirrored.verify(strategy, train_step, (model, optimizer, x, y)))
