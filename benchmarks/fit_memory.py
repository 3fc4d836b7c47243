"""Peak host memory of `Trainer.fit` on 100 MB of in-memory arrays (issue 39 item 8).

Each case runs in a fresh process: make the arrays (32,768 x 784 float32 = 103 MB, and int32
labels), build the seed MLP's Trainer, then `fit` for one epoch more than there are replicas
(so that arrays allowed to stay on the devices are placed there). It reports the process's
peak resident memory (ru_maxrss) after the arrays were made and after `fit`, and the
difference: what `fit` itself added at its peak (its copies of the data, the batches in
flight, the compiled programs). Simulated CPU devices live in host memory: a copy "on the
devices" is a copy in this process, one per device. Prints JSON.

    python benchmarks/fit_memory.py [--devices 8] [--rows 32768]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = {
    "1 step per execution": {"k": 1, "device_data": None},
    "32 steps, arrays kept on the devices": {"k": 32, "device_data": str(2**30)},
    "32 steps, read from the host": {"k": 32, "device_data": "0"},
}


def _case(devices: int, rows: int, k: int) -> None:
    import resource

    import mirrored

    mirrored.simulate_cpu_devices(devices)
    import numpy as np
    import optax
    from _models import MLP
    from flax import nnx

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 784), dtype=np.float32)  # no float64 copy: no early peak
    y = rng.integers(0, 10, rows).astype(np.int32)
    strategy = mirrored.MirroredStrategy()
    with strategy.scope():
        trainer = mirrored.Trainer(
            MLP((128,), rngs=nnx.Rngs(0)),
            optax.adam(1e-3),
            "sparse_categorical_crossentropy",
            from_logits=True,
            steps_per_execution=k,
        )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # More epochs than replicas: arrays that may stay on the devices are placed there.
    trainer.fit(x, y, batch_size=256, epochs=devices + 1, verbose=0)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "data_mb": round((x.nbytes + y.nbytes) / 2**20, 1),
                "before_mb": before,
                "peak_mb": after,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--case-k", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case_k:
        _case(args.devices, args.rows, args.case_k)
        return
    results = []
    for devices in sorted({1, args.devices}):
        for name, case in CASES.items():
            env = dict(os.environ)
            if case["device_data"] is not None:
                env["MIRRORED_DEVICE_DATA_BYTES"] = case["device_data"]
            command = [
                sys.executable,
                __file__,
                "--devices",
                str(devices),
                "--rows",
                str(args.rows),
                "--case-k",
                str(case["k"]),
            ]
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row.update(
                case=name, devices=devices, fit_added_mb=round(row["peak_mb"] - row["before_mb"], 1)
            )
            results.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "fit_memory", "results": results}, indent=2))


if __name__ == "__main__":
    main()
