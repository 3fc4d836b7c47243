"""Multi-worker jobs that fail fast and say why; the launcher's output and usage; clusters found
the way `jax.distributed.initialize()` finds them.

Real processes talk only to 127.0.0.1, each under `timeout`, with a few seconds' budget.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from jax._src import clusters

import mirrored
from _helpers import subprocess_env
from mirrored._cluster.launch import free_port, is_gloo_noise
from mirrored._cluster.rendezvous import initialization_seconds
from mirrored._cluster.resolvers import resolve_cluster

ROOT = Path(__file__).resolve().parents[1]
STRATEGY = "import mirrored; mirrored.MultiWorkerMirroredStrategy({})"
# Two workers of two simulated CPU devices each; prints what a worker sees of the job.
REDUCE = """
import sys
import mirrored
mirrored.simulate_cpu_devices(2)
strategy = mirrored.MultiWorkerMirroredStrategy()
value = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group + 1.0)
total = float(strategy.reduce("SUM", value, axis=None))
print("argv", sys.argv[1:], "replicas", strategy.num_replicas_in_sync, "sum", total, flush=True)
"""
CLUSTER_VARIABLES = ("MIRRORED_", "TF_CONFIG", "SLURM_", "OMPI_", "JAX_COORDINATOR", "KUBERNETES_")


def tf_config(ports, index):
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})


def worker_env(**extra):
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(CLUSTER_VARIABLES)}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def start(code, env, *args, limit=60):
    return subprocess.Popen(
        ["timeout", "-k", "5", str(limit), sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def output(process):
    return process.communicate(timeout=90)[0]


# -- a worker that never starts ----------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_that_never_starts_is_a_python_error_in_the_chief():
    port = free_port()
    ports = [port, port + 1]  # nothing ever listens on the second: worker 1 never starts
    chief = start(
        STRATEGY.format(""), worker_env(TF_CONFIG=tf_config(ports, 0), MIRRORED_INIT_TIMEOUT="5")
    )
    text = output(chief)
    assert chief.returncode == 1, text[-3000:]  # a Python exception; abort 134, `timeout` 124
    assert "TimeoutError: MultiWorkerMirroredStrategy expected all 2 workers" in text, text
    assert f"found 1 of 2 missing: worker 1 at 127.0.0.1:{port + 1}" in text
    assert f"coordinator at 127.0.0.1:{port} within 5 s" in text
    assert "same cluster spec" in text and "MIRRORED_INIT_TIMEOUT=120" in text
    assert "Terminating process" not in text and "another task died" not in text


@pytest.mark.slow
def test_a_chief_that_never_starts_is_a_python_error_in_the_worker():
    port = free_port()  # nothing listens on it: the chief never starts
    code = STRATEGY.format("initialization_timeout=3")
    worker = start(code, worker_env(TF_CONFIG=tf_config([port, port + 1], 1)))
    text = output(worker)
    assert worker.returncode == 1, text[-3000:]  # a Python exception, not `timeout`'s 124
    chief = f"127.0.0.1:{port}"
    assert (
        f"TimeoutError: MultiWorkerMirroredStrategy expected the chief (worker 0 at {chief})"
        in text
    )
    assert f"to accept worker 1 at 127.0.0.1:{port + 1} within 3 s" in text
    assert "Connection refused" in text and "initialization_timeout=120" in text


@pytest.mark.slow
def test_workers_that_disagree_on_the_cluster_both_fail_at_once():
    port = free_port()
    env = worker_env(MIRRORED_INIT_TIMEOUT="20")
    chief = start(STRATEGY.format(""), {**env, "TF_CONFIG": tf_config([port, port + 1], 0)})
    three = tf_config([port, port + 1, port + 2], 1)
    worker = start(STRATEGY.format(""), {**env, "TF_CONFIG": three})
    texts = [output(chief), output(worker)]
    for process, text in zip((chief, worker), texts, strict=True):
        assert process.returncode == 1, text[-3000:]
        assert (
            "ValueError: Expected every worker to see a cluster of 2 processes, as the chief "
            "does; found process 1 seeing 3." in text
        )
        assert "TimeoutError" not in text  # at once, not after the 20 s initialization timeout


@pytest.mark.slow
def test_tf_config_workers_with_several_cpu_devices_each():
    """The docs' recipe: simulate_cpu_devices(k) before the strategy, the cluster from TF_CONFIG."""
    port = free_port()
    env = worker_env(MIRRORED_INIT_TIMEOUT="30")
    workers = [
        start(REDUCE, {**env, "TF_CONFIG": tf_config([port, port + 1], i)}, "x") for i in range(2)
    ]
    for process, text in zip(workers, [output(w) for w in workers], strict=True):
        assert process.returncode == 0, text[-3000:]
        assert "argv ['x'] replicas 4 sum 10.0" in text


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0, "initialization_timeout to be a positive number of seconds; found 0"),
        (float("inf"), "found inf"),
        ("60", "found '60'"),
    ],
)
def test_bad_initialization_timeout(value, match, monkeypatch):
    for name in list(os.environ):
        if name.startswith(CLUSTER_VARIABLES):
            monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=match):
        mirrored.MultiWorkerMirroredStrategy(initialization_timeout=value)


def test_initialization_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("MIRRORED_INIT_TIMEOUT", raising=False)
    assert initialization_seconds(None) == 60.0 and initialization_seconds(2) == 2.0
    monkeypatch.setenv("MIRRORED_INIT_TIMEOUT", "7.5")
    assert initialization_seconds(None) == 7.5 and initialization_seconds(3) == 3.0
    monkeypatch.setenv("MIRRORED_INIT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MIRRORED_INIT_TIMEOUT to be .* found 'soon'. Fix"):
        initialization_seconds(None)


# -- the launcher --------------------------------------------------------------------------------


def test_gloo_connection_reports_are_noise():
    report = "is connected to {} peer ranks. Expected number of connected peer ranks is : {}\n"
    whole = "[Gloo] Rank 0 " + report.format(1, 1)
    # Two threads of one worker printing at once (seen with 2 devices per process):
    mixed = ["[Gloo] Rank [Gloo] Rank 2 " + report.format(3, 3), "3 " + report.format(3, 3)]
    assert is_gloo_noise(whole) and all(map(is_gloo_noise, mixed))
    short = "[Gloo] Rank 0 " + report.format(0, 1)
    assert not is_gloo_noise(short)  # names a missing peer: kept
    assert not any(map(is_gloo_noise, ["42\n", "loss 0.5\n", "we have 3 peer ranks\n", "\n"]))


@pytest.mark.slow
def test_launch_leaves_out_gloo_reports_and_passes_options_to_the_script(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(REDUCE.replace("mirrored.simulate_cpu_devices(2)\n", ""))
    result = subprocess.run(
        [
            "timeout", "-k", "10", "120", sys.executable, "-m", "mirrored.cli", "launch",
            "-n", "2", "--devices-per-process", "2", "--grace", "2",
            str(script), "-n", "7", "--grace", "x",
        ],
        capture_output=True,
        text=True,
        env=worker_env(),
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank in (0, 1):
        line = f"[rank {rank}] argv ['-n', '7', '--grace', 'x'] replicas 4 sum 10.0"
        assert line in result.stdout, result.stdout
    assert "Gloo" not in result.stdout and "peer ranks" not in result.stdout, result.stdout


def test_launch_usage_names_the_script_and_its_arguments():
    result = subprocess.run(
        [sys.executable, "-m", "mirrored.cli", "launch", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    assert "launch [OPTIONS] SCRIPT [ARGS]..." in result.stdout, result.stdout


# -- clusters detected by JAX, without starting anything -----------------------------------------


@pytest.fixture
def bare_env(monkeypatch):
    """No cluster variables; returns a function that sets some."""
    for name in list(os.environ):
        if name.startswith(CLUSTER_VARIABLES):
            monkeypatch.delenv(name)

    def set_env(variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


def jax_detects():
    """What `jax.distributed.initialize()` with no arguments would use: address, count, id."""
    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, None
    )
    return found[:3]


def srun(nodelist="gpu[003-004,009]", ntasks="3", procid="2"):
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_NTASKS": ntasks,
        "SLURM_PROCID": procid,
        "SLURM_LOCALID": "0",
    }


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[003-004,009]", "gpu003"),
        ("node001", "node001"),
        ("node7,node8", "node7"),
        ("node[001,007-015],host2", "node001"),
    ],
)
def test_slurm_resolves_to_what_jax_detects(nodelist, host, bare_env):
    bare_env(srun(nodelist))
    resolver = resolve_cluster()
    assert isinstance(resolver, mirrored.SlurmClusterResolver)
    port = 4242 % 4096 + 61440  # JAX's port for job 4242
    found = (resolver.coordinator_address, resolver.num_processes, resolver.process_id)
    assert found == (f"{host}:{port}", 3, 2) == jax_detects()


def test_slurm_port(bare_env):
    bare_env(srun())
    assert mirrored.SlurmClusterResolver(port=5555).coordinator_address == "gpu003:5555"
    bare_env({"JAX_COORDINATOR_PORT": "7777"})
    assert mirrored.SlurmClusterResolver().coordinator_address == "gpu003:7777"
    assert jax_detects()[0] == "gpu003:7777"


def test_bad_slurm_environments_are_explained(bare_env):
    bare_env({"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[01-02]"})  # salloc, no srun
    with pytest.raises(ValueError, match=r"found \['SLURM_JOB_ID', 'SLURM_STEP_NODELIST'.*srun"):
        resolve_cluster()
    bare_env(srun(ntasks="2", procid="2"))
    with pytest.raises(ValueError, match="process_id < num_processes"):
        resolve_cluster()


def test_a_single_srun_task_runs_alone(bare_env):
    bare_env(srun(ntasks="1", procid="0"))
    assert resolve_cluster().num_processes == 1


OPEN_MPI = {
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
}


def test_open_mpi_resolves_to_what_jax_detects(bare_env):
    bare_env(OPEN_MPI)
    resolver = resolve_cluster()
    port = 1531576320 // 4096 % 4096 + 61440  # JAX's port for this Open MPI job
    found = (resolver.coordinator_address, resolver.num_processes, resolver.process_id)
    assert found == (f"10.96.0.1:{port}", 4, 1) == jax_detects()
    bare_env(srun())  # mpirun inside a SLURM allocation: Open MPI first, as in JAX
    assert resolve_cluster().process_id == 1 == jax_detects()[2]
    bare_env({"OMPI_MCA_orte_hnp_uri": "1531576320.0;unix://nowhere"})
    with pytest.raises(ValueError, match="Open MPI.*mpirun"):
        resolve_cluster()


def test_own_variables_come_before_jax_detection(bare_env):
    bare_env(srun())
    bare_env({"TF_CONFIG": tf_config([1, 2], 1)})
    assert isinstance(resolve_cluster(), mirrored.TFConfigClusterResolver)
    bare_env(
        {
            "MIRRORED_COORDINATOR_ADDRESS": "127.0.0.1:9",
            "MIRRORED_NUM_PROCESSES": "2",
            "MIRRORED_PROCESS_ID": "1",
        }
    )
    assert isinstance(resolve_cluster(), mirrored.EnvironmentClusterResolver)
