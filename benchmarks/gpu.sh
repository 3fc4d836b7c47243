#!/usr/bin/env bash
# Everything a lent GPU machine should measure, in one command (under 8 minutes on one GPU):
# installs mirrored with the CUDA extra, runs the checks that need an accelerator, `mirrored
# doctor`, `mirrored bench` and the step, fit, mixed-precision and ZeRO benchmarks on the GPU, and
# writes one JSON.
#
#     benchmarks/gpu.sh [OUT.json]           # default: $OUT/gpu.json, else ./gpu.json
#     MIRRORED_GPU_DRY_RUN=1 benchmarks/gpu.sh /tmp/gpu.json   # on CPU, into .venv: the script
#
# Offline machines: put wheels in .whl/ (pip download ...) and they are used first. A machine
# whose Python already has CUDA JAX (and flax, optax) gets a venv that sees it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-.}/gpu.json}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ "${MIRRORED_GPU_DRY_RUN:-0}" == 1 ]]; then
    python=.venv/bin/python
    flag=(--allow-cpu)
    bench_devices=(--devices 2)
    zero_devices=(--devices 2 --rounds 1 --steps 3)
else
    python=.venv-gpu/bin/python
    flag=()
    bench_devices=()
    zero_devices=(--accelerator)
    if [[ ! -x $python ]]; then
        python3 -m venv --system-site-packages .venv-gpu
    fi
    links=()
    [[ -d .whl ]] && links=(--find-links .whl)
    if "$python" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
        # CUDA JAX is there already: add mirrored and what it needs beside it.
        "$python" -m pip install --quiet "${links[@]}" -e . || "$python" -m pip install \
            --quiet --no-index "${links[@]}" -e .
    else
        "$python" -m pip install --quiet "${links[@]}" -c constraints.txt -e ".[cuda]"
    fi
fi
bin=$(dirname "$python")

step() {  # step NAME SECONDS COMMAND...: its JSON (stdout) into $work/NAME.json, or an error
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    if timeout "$limit" "$@" >"$work/$name.json" 2>"$work/$name.err"; then
        echo "   ok" >&2
    else
        echo "   failed ($?): $(tail -3 "$work/$name.err")" >&2
        printf '{"error": %s}' "$("$python" -c 'import json,sys; print(json.dumps(sys.stdin.read()[-2000:]))' <"$work/$name.err")" >"$work/$name.json"
    fi
}

export PYTHONUNBUFFERED=1
step checks 120 "$python" benchmarks/gpu_checks.py "${flag[@]}"
step doctor 60 "$bin/mirrored" doctor --json "${bench_devices[@]}"
step bench 120 "$bin/mirrored" bench --json --steps 20 "${bench_devices[@]}"
step step_overhead 60 "$python" benchmarks/step_overhead.py --devices 1 --steps 200 --repeats 3
step fit_throughput 90 "$python" benchmarks/fit_throughput.py --devices 1 --repeats 3
step loop_ops 60 "$python" benchmarks/loop_ops.py --devices 1 --repeats 3
step mixed_precision 60 "$python" benchmarks/mixed_precision.py --devices 1
# ZeRO on the GPU(s): at N = 1 ShardedOptimizer must equal nnx.Optimizer bitwise at >= 0.98x
# its step time; peak_bytes_in_use recorded.
step zero 90 "$python" benchmarks/zero.py "${zero_devices[@]}"

"$python" - "$work" "$out" <<'PY'
import json, pathlib, platform, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
report = {"machine": platform.node()}
names = ("checks", "doctor", "bench", "step_overhead", "fit_throughput", "loop_ops",
         "mixed_precision", "zero")
for name in names:
    text = (work / f"{name}.json").read_text()
    try:
        report[name] = json.loads(text)
    except json.JSONDecodeError:
        report[name] = {"error": "not JSON", "output": text[-2000:]}
out.write_text(json.dumps(report, indent=2))
print(f"wrote {out}")
failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
sys.exit(1 if failed or not report["checks"].get("ok") else 0)
PY
