"""mirrored.verify / mirrored doctor catch each planted mistake with the right diagnosis."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import mirrored
from _helpers import SmallMLP, global_batches, subprocess_env, train_step
from mirrored._proof import checks as _checks

ROOT = Path(__file__).resolve().parents[1]


def setup(devices, *, inside_scope=True, batch=64):
    strategy = mirrored.MirroredStrategy(devices)
    if inside_scope:
        with strategy.scope():
            model = SmallMLP(rngs=nnx.Rngs(0))
    else:
        model = SmallMLP(rngs=nnx.Rngs(0))
    with strategy.scope():
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ((x, y),) = list(strategy.experimental_distribute_dataset(global_batches(1, batch)))
    return strategy, (model, optimizer, x, y)


def statuses(report):
    return {c.name: c.status for c in report.checks}


def test_a_correct_step_passes_every_check(devices):
    strategy, args = setup(devices)
    before = np.asarray(args[0].out.kernel.get_value())
    report = mirrored.verify(strategy, train_step, args, expected_replicas=8, scaling=True)
    assert report.ok
    assert set(statuses(report).values()) <= {"PASS", "INFO"}, statuses(report)
    assert report["Collectives"].data["all_reduce_ops"] >= 1
    # The checks ran on copies: the caller's model did not train.
    np.testing.assert_array_equal(args[0].out.kernel.get_value(), before)


def test_state_created_outside_the_scope(devices):
    strategy, args = setup(devices, inside_scope=False)
    report = mirrored.verify(strategy, train_step, args)
    check = report["Devices"]
    assert check.status == "FAIL" and not report.ok
    assert "created outside" in check.explanation and "strategy.scope()" in check.explanation


def test_loss_averaged_per_replica_is_named_as_8x_gradients(devices):
    strategy, args = setup(devices)

    def mean_per_replica(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        optimizer.update(model, nnx.grad(loss_fn)(model))

    check = mirrored.verify(strategy, mean_per_replica, args)["Single-device equivalence"]
    assert check.status == "FAIL"
    assert check.summary == "updates are 8.0× too large compared with one device"
    assert "compute_average_loss" in check.explanation and "replica count (8)" in check.explanation


def test_per_replica_batch_passed_as_the_global_one_to_the_loss(devices):
    strategy, args = setup(devices)

    def per_replica_size(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return mirrored.compute_average_loss(per_example, global_batch_size=8)  # 64 / 8

        optimizer.update(model, nnx.grad(loss_fn)(model))

    report = mirrored.verify(strategy, per_replica_size, args)
    assert not report.ok
    failed = [c for c in report.checks if c.status == "FAIL"]
    assert "failed to compile: compute_average_loss expected the GLOBAL" in failed[0].summary
    assert "global_batch_size=64" in failed[0].explanation


def test_per_replica_batch_size_passed_where_the_global_one_is_expected(devices):
    strategy, args = setup(devices, batch=32)  # 4 each: a hint, not evidence of a mistake
    check = mirrored.verify(strategy, train_step, args)["Input"]
    assert check.status == "INFO"
    assert "4 example(s)" in check.explanation and "batch_size=256" in check.explanation
    check = _checks.check_input(8, 8)  # one example per replica: nearly always a mix-up
    assert check.status == "WARN" and "batch_size=64" in check.explanation


def test_a_step_that_never_synchronises(devices):
    strategy, args = setup(devices)

    def local_update(model, optimizer, x, y):
        model.out.bias[...] = model.out.bias[...] - 0.1 * x.mean(axis=0)[:5]  # replica-local

    report = mirrored.verify(strategy, local_update, args)
    assert report["Collectives"].status == "FAIL"
    assert "pretend-distributed" in report["Collectives"].explanation
    sync = report["Replicas in sync"]
    assert sync.status == "FAIL" and "args[0].out.bias" in sync.summary


def test_diverged_arrays_are_named_with_their_difference(devices):
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(devices), ("r",)), jax.sharding.PartitionSpec()
    )
    shards = [
        jax.device_put(np.full(3, float(i == 5), np.float32), d) for i, d in enumerate(devices)
    ]
    diverged = jax.make_array_from_single_device_arrays((3,), sharding, shards)
    check = _checks.check_in_sync({"model.w": diverged, "ok": jax.device_put(np.ones(3), sharding)})
    assert check.status == "FAIL" and check.data == {"variable": "model.w", "max_difference": 1.0}


def test_silently_on_one_device_when_eight_were_expected(devices):
    strategy, args = setup(devices[:1])
    check = mirrored.verify(strategy, train_step, args, expected_replicas=8)["Devices"]
    assert check.status == "FAIL"
    assert check.summary == "1 replica(s) in sync, but 8 were expected"
    assert "CUDA_VISIBLE_DEVICES" in check.explanation


def test_pure_checks():
    assert _checks.count_all_reduces("%a = f32[] all-reduce(x)\n%b = all-reduce-start(y)") == 2
    assert _checks.check_collectives("", 4).status == "FAIL"
    gpu_warning = _checks.check_devices(
        used=jax.devices()[:1], found=jax.devices()[:1], gpus_visible=True
    )
    assert gpu_warning.status == "WARN" and "jax[cuda12]" in gpu_warning.explanation
    unused = _checks.check_devices(used=jax.devices()[:2], found=jax.devices())
    assert unused.status == "WARN" and "6 device(s) unused" in unused.summary
    steps = _checks.check_input(8, 64, dataset_size=1000, steps_per_epoch=125)
    assert steps.status == "WARN" and "16 steps" in steps.explanation
    ragged = _checks.check_input(8, 64, dataset_size=1000)
    assert ragged.data["last_batch"] == 40 and "ragged last batch of 40" in ragged.summary
    half = _checks.check_equivalence({"w": np.full(3, 0.5)}, {"w": np.ones(3)}, 2)
    assert "0.5× too small" in half.summary and "1/2" in half.explanation


def test_trainer_verify(devices):
    strategy = mirrored.MirroredStrategy(devices)
    with strategy.scope():
        trainer = mirrored.Trainer(
            SmallMLP(rngs=nnx.Rngs(0)),
            optax.sgd(0.1),
            "sparse_categorical_crossentropy",
            ["accuracy"],
            from_logits=True,
        )
    x, y = global_batches(1, 100)[0]
    report = trainer.verify(x, y, batch_size=32, expected_replicas=8)
    assert report.ok, report.to_json()
    assert report["Input"].data["steps_per_epoch"] == 4
    assert report["Input"].data["last_batch"] == 4


def _doctor(*args):
    env = subprocess_env()
    return subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, "-m", "mirrored.cli", "doctor", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=False,
    )


def test_doctor_cli_json_plot_and_exit_codes(tmp_path):
    plot = tmp_path / "scaling.png"
    result = _doctor("--devices", "4", "--json", "--plot", str(plot), "--batch-size", "100")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["checks"][-1]["data"]["global_batch"] == 100
    assert report["ok"] and [c["name"] for c in report["checks"]] == [
        "Devices",
        "Collectives",
        "Memory per device",
        "Replicas in sync",
        "Single-device equivalence",
        "Scaling",
        "Input",
    ]
    assert plot.read_bytes()[:4] == b"\x89PNG"
    failing = _doctor("--devices", "2", "--expect", "4", "--no-scaling")
    assert failing.returncode == 1 and "FAIL" in failing.stdout


def test_doctor_checks_a_users_step(tmp_path):
    script = tmp_path / "my_step.py"
    script.write_text(
        "import mirrored, optax\n"
        "from flax import nnx\n"
        "import numpy as np\n"
        "def step(model, optimizer, x):\n"
        "    loss_fn = lambda m: (m(x) ** 2).mean()  # averaged per replica: wrong\n"
        "    optimizer.update(model, nnx.grad(loss_fn)(model))\n"
        "def make():\n"
        "    strategy = mirrored.MirroredStrategy()\n"
        "    with strategy.scope():\n"
        "        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))\n"
        "        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)\n"
        "    (x,) = list(strategy.experimental_distribute_dataset([np.ones((16, 3))]))\n"
        "    return strategy, step, (model, optimizer, x)\n"
    )
    result = _doctor("--devices", "4", "--step", f"{script}:make", "--no-scaling")
    assert result.returncode == 1
    assert "4.0× too large" in result.stdout
    missing = _doctor("--step", f"{tmp_path}/nope.py:make")
    assert missing.returncode == 2
    assert "expected --step's FILE to be a Python file" in missing.stderr
