"""The per-step cost of the hang watchdog (issue 37): the seed MLP's training step (batch 256,
Adam) with the watchdog on (`MIRRORED_HANG_TIMEOUT=300`, its heartbeats published once a
second) against the same job with it off (`=0`), at 2 and 4 processes × 1 device on
127.0.0.1 (gloo). Launches alternate, off then on, `--rounds` times; the ratio is of the
medians. Also: the step path's own heartbeat writes, timed alone, and the all-reduce count of
the compiled step with the watchdog on and off (it adds no collective).

    python benchmarks/hang_overhead.py [--steps 200] [--rounds 3] [--processes 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def worker(out: str, steps: int) -> None:
    import mirrored

    strategy = mirrored.MultiWorkerMirroredStrategy()
    import jax
    import optax
    from _models import MLP, synthetic_batches, train_step
    from flax import nnx

    with strategy.scope():
        model = MLP((128,), rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batches = list(strategy.experimental_distribute_dataset(synthetic_batches(256, count=4)))

    def timed() -> float:
        jax.block_until_ready(nnx.state(model))
        start = time.perf_counter()
        for i in range(steps):
            x, y = batches[i % len(batches)]
            strategy.run(train_step, args=(model, optimizer, x, y))
        jax.block_until_ready(nnx.state(model))
        return (time.perf_counter() - start) / steps

    timed()  # compiled, warm
    seconds = statistics.median(timed() for _ in range(3))
    x, y = batches[0]
    text = strategy._compiled_text(train_step, (model, optimizer, x, y), {})
    if strategy.is_chief:
        with open(out, "w") as f:
            json.dump({"step_s": seconds, "all_reduces": text.count("all-reduce(")}, f)


def heartbeat_writes_ns() -> float:
    """What `_call` adds per step for the watchdog: its attribute writes, timed alone."""
    from mirrored._core.heartbeat import BEAT

    count = 1_000_000
    start = time.perf_counter()
    for _ in range(count):
        beat = BEAT
        beat.beats += 1
        beat.phase = "step"
        beat.fn = "train_step"
        beat.steps += 1
        beat.beats += 1
        beat.phase = "host"
    return (time.perf_counter() - start) / count * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--worker-out", default="")
    args = parser.parse_args()
    if args.worker_out:
        worker(args.worker_out, args.steps)
        return
    from mirrored._cluster.launch import launch

    writes_ns = heartbeat_writes_ns()
    rows = []
    for processes in args.processes:
        runs: dict[str, list[dict[str, float]]] = {"0": [], "300": []}
        for _ in range(args.rounds):
            for timeout in ("0", "300"):
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "result.json")
                    command = [sys.executable, __file__, "--steps", str(args.steps)]
                    command += ["--worker-out", out]
                    os.environ["MIRRORED_HANG_TIMEOUT"] = timeout
                    code = launch(command, num_processes=processes, devices_per_process=1)
                    if code:
                        raise SystemExit(f"workers failed with exit code {code}")
                    with open(out) as f:
                        runs[timeout].append(json.load(f))
        off = statistics.median(r["step_s"] for r in runs["0"])
        on = statistics.median(r["step_s"] for r in runs["300"])
        spread = [r["step_s"] / off - 1 for r in runs["0"]]
        rows.append(
            {
                "processes": processes,
                "step_ms_off": round(off * 1e3, 3),
                "step_ms_on": round(on * 1e3, 3),
                "overhead": round(on / off - 1, 4),
                "noise_band_off": [round(min(spread), 4), round(max(spread), 4)],
                "heartbeat_writes_share": round(writes_ns * 1e-9 / off, 6),
                "all_reduces_off_on": [runs["0"][0]["all_reduces"], runs["300"][0]["all_reduces"]],
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"benchmark": "hang_overhead", "heartbeat_writes_ns": round(writes_ns, 1)}
    print(json.dumps({**result, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
