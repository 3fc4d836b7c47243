"""TensorFlow's PreemptionCheckpointHandler (issue 35): a termination notice to any process
makes every process stop at the same step S, the chief saves one checkpoint tagged S, all
exit 42; started again, the loop resumes from S and ends bit-identical to an uninterrupted
run (parameters and Adam state, whose count proves no step was lost or repeated)."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import mirrored
from _helpers import job_env, run_two_workers, start_worker, subprocess_env

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "_preempt_script.py")


def _one_process(out, *extra):
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(out), *extra]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=HERE, env=subprocess_env(), check=False
    )


def _launch_command(out, n, k, *extra, launcher=()):
    command = ["timeout", "-k", "10", "240", sys.executable, "-m", "mirrored.cli", "launch"]
    command += ["-n", str(n), "--devices-per-process", str(k), "--grace", "10", *launcher]
    return [*command, SCRIPT, str(out), "--workers", *extra]


def _launch(out, n, k, *extra, launcher=()):
    return subprocess.run(
        _launch_command(out, n, k, *extra, launcher=launcher),
        capture_output=True,
        text=True,
        cwd=HERE,
        env=subprocess_env(),
        check=False,
    )


def _none_left(out):
    """Every worker that wrote a pid file has exited."""
    for pid_file in out.glob("pid.*"):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


def _result(out):
    return dict(np.load(out / "result.npz"))


def _assert_bitwise_equal(resumed, reference):
    assert resumed.keys() == reference.keys()
    for name in reference:
        if name != "ran":
            np.testing.assert_array_equal(resumed[name], reference[name], err_msg=name)
    counts = [name for name in reference if name.endswith("count")]
    assert counts and all(int(reference[c]) == reference["ran"][1] for c in counts)


def _preempted_steps(output):
    return {int(s) for s in re.findall(r"preempted at step (\d+)", output)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    run = _one_process(out)
    assert run.returncode == 0, run.stderr[-3000:]
    return _result(out)


@pytest.mark.parametrize("signal_at", [0, 3], ids=["the-first-step", "mid-run"])
def test_sigterm_saves_the_step_exits_42_and_a_restart_resumes_bitwise(
    tmp_path, uninterrupted, signal_at
):
    """One process (TensorFlow's local mode). Before: SIGTERM killed it at once (-15), nothing
    saved."""
    preempted = _one_process(tmp_path, "--sigterm-rank", "0", "--sigterm-at", str(signal_at))
    assert preempted.returncode == 42, preempted.stderr[-3000:]
    step = signal_at + 1  # the signal came during step `signal_at`
    assert _preempted_steps(preempted.stderr) == {step}
    assert sorted(p.name for p in (tmp_path / "preemption").iterdir()) == [str(step)]
    resumed = _one_process(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"starts at step {step}" in resumed.stdout
    result = _result(tmp_path)
    assert list(result["ran"]) == [step, 8]
    _assert_bitwise_equal(result, uninterrupted)


def test_a_notice_in_the_last_step_lets_the_loop_finish(tmp_path, uninterrupted):
    """The agreed step is the one after the signal; when the loop ends first, it just ends
    (TensorFlow's behaviour): no checkpoint, exit 0, the uninterrupted result."""
    run = _one_process(tmp_path, "--sigterm-rank", "0", "--sigterm-at", "7")
    assert run.returncode == 0, run.stderr[-3000:]
    assert not _preempted_steps(run.stderr) and not (tmp_path / "preemption").exists()
    _assert_bitwise_equal(_result(tmp_path), uninterrupted)


@pytest.mark.parametrize(
    ("options", "code", "saved"),
    [
        (["--exit-code", "7"], 7, True),  # exit_fn
        (["--no-save"], 42, False),  # a save_fn that saves nothing: TF's test_passed_in_save_fn
    ],
    ids=["exit_fn", "save_fn"],
)
def test_termination_config_replaces_the_exit_and_the_save(tmp_path, options, code, saved):
    run = _one_process(tmp_path, "--sigterm-rank", "0", "--sigterm-at", "2", *options)
    assert run.returncode == code, run.stderr[-3000:]
    assert (tmp_path / "preemption" / "3").exists() == saved


def test_a_termination_watcher_acts_as_sigterm(tmp_path):
    flag = tmp_path / "terminate-now"
    run = _one_process(
        tmp_path, "--steps", "40", "--watch-file", str(flag), "--touch-at", "2", "--pause", "0.1"
    )
    assert run.returncode == 42, run.stderr[-3000:]
    (step,) = _preempted_steps(run.stderr)
    assert 3 <= step < 40
    assert sorted(p.name for p in (tmp_path / "preemption").iterdir()) == [str(step)]


def test_bad_arguments_are_refused_with_the_fix(tmp_path):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="dict of the objects to save"):
        mirrored.PreemptionCheckpointHandler(None, model, tmp_path)
    with pytest.raises(TypeError, match="checkpoint_dir to be a directory path"):
        mirrored.PreemptionCheckpointHandler(None, {"model": model}, None)
    with pytest.raises(TypeError, match="mirrored.TerminationConfig"):
        mirrored.PreemptionCheckpointHandler(None, {"model": model}, tmp_path, {"exit_fn": 1})
    with pytest.raises(TypeError, match=r"exit_fn=\.\.\.\) to be a function"):
        mirrored.TerminationConfig(exit_fn=42)
    for grace in (-1, "5", True):
        with pytest.raises(ValueError, match="a number of seconds >= 0"):
            mirrored.TerminationConfig(grace_period=grace)


# -- several processes: JAX's preemption service agrees on the step ------------------------------


STEPS = ["--steps", "30", "--pause", "0.1"]


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted 2-process x 2-device run."""
    out = tmp_path_factory.mktemp("reference")
    run = _launch(out, 2, 2, *STEPS)
    assert run.returncode == 0, run.stdout[-3000:]
    return _result(out)


@pytest.mark.slow
def test_sigterm_to_the_chief_of_four_stops_all_four_at_one_step_and_resumes_bitwise(
    tmp_path, two_process_reference
):
    """4 processes x 1 device, SIGTERM to the chief: all four save at one step, exit 42, and
    under --max-restarts 1 resume and end bitwise equal to the uninterrupted run on the same 4
    replicas (2 processes x 2 devices: the same global batches and reductions)."""
    run = _launch(
        tmp_path,
        4,
        1,
        *STEPS,
        "--sigterm-rank",
        "0",
        "--sigterm-at",
        "2",
        launcher=("--max-restarts", "1"),
    )
    assert run.returncode == 0, run.stdout[-3000:]
    (step,) = _preempted_steps(run.stdout)
    assert run.stdout.count(f"preempted at step {step}") == 4
    assert "restarting all 4 workers (restart 1/1)" in run.stdout
    result = _result(tmp_path)
    assert list(result["ran"]) == [step, 30]
    _assert_bitwise_equal(result, two_process_reference)
    _none_left(tmp_path)


# -- mirrored launch --max-restarts, and SIGTERM to the launcher (item 4) ---------------------


@pytest.mark.slow
def test_the_launcher_restarts_a_preempted_job_which_resumes_bitwise(
    tmp_path, two_process_reference
):
    """torchrun's --max-restarts: the workers exit 42 after the preemption checkpoint, the
    launcher starts them all again (MIRRORED_RESTART_COUNT=1), they resume from the agreed
    step and end bit-identical to an uninterrupted run."""
    run = _launch(
        tmp_path,
        2,
        2,
        *STEPS,
        "--sigterm-rank",
        "1",
        "--sigterm-at",
        "3",
        launcher=("--max-restarts", "1"),
    )
    assert run.returncode == 0, run.stdout[-3000:]
    (step,) = _preempted_steps(run.stdout)  # one step, every process
    assert run.stdout.count(f"preempted at step {step}") == 2
    assert re.search(
        r"worker \d exited with code 42; restarting all 2 workers \(restart 1/1\)", run.stdout
    )
    assert f"process 0 starts at step {step} (restart 1)" in run.stdout
    result = _result(tmp_path)
    assert list(result["ran"]) == [step, 30]
    _assert_bitwise_equal(result, two_process_reference)
    _none_left(tmp_path)


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_once_and_exits_42_without_restarting(tmp_path):
    """Before: the launcher died and both workers trained on, orphaned."""
    command = _launch_command(
        tmp_path, 2, 2, "--steps", "200", "--pause", "0.1", launcher=("--max-restarts", "3")
    )
    launcher = subprocess.Popen(
        command[4:],  # without `timeout`: the signal goes to the launcher itself
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=HERE,
        env=subprocess_env(),
    )
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if sum("starts at step" in seen for seen in lines) == 2:
                break
        time.sleep(1.0)  # a few steps in
        launcher.send_signal(signal.SIGTERM)
        output = "".join(lines) + launcher.communicate(timeout=60)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 42, output[-3000:]
    (step,) = _preempted_steps(output)
    assert output.count(f"preempted at step {step}") == 2
    assert "exiting 42 without a restart" in output and "restarting" not in output
    assert sorted(p.name for p in (tmp_path / "preemption").iterdir()) == [str(step)]
    _none_left(tmp_path)


# -- fit: BackupAndRestore(save_before_preemption=True) (item 3) ---------------------------------


def _fit(backup, out, *extra):
    command = ["timeout", "-k", "10", "240", sys.executable, str(HERE / "_fit_script.py")]
    return subprocess.run(
        [*command, str(backup), str(out), "--preemption", *extra],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=HERE,
        check=False,
    )


@pytest.fixture(scope="module")
def clean_fit(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean_fit")
    clean = _fit(out / "backup", out / "clean.npz")
    assert clean.returncode == 0, clean.stderr[-3000:]
    return np.load(out / "clean.npz")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signal_at", "saved_at"),
    [(6, 7), (10, 11), (20, 21)],
    ids=["an-epochs-last-step", "mid-epoch", "the-final-step"],
)
def test_a_preempted_fit_backs_up_exits_42_and_resumes_bitwise(
    tmp_path, clean_fit, signal_at, saved_at
):
    """tf-keras' BackupAndRestore(save_freq=False, save_before_preemption=True): SIGTERM in
    step `signal_at` (200 rows in batches of 32: 7 steps an epoch, 21 in all) backs up at the
    next step and exits 42 — also when that step ends an epoch (before its epoch-end work) or
    the whole fit; the rerun resumes there and ends as a fit never interrupted. Before:
    SIGTERM killed the process (-15) with nothing saved."""
    preempted = _fit(tmp_path / "backup", tmp_path / "x.npz", "--sigterm-at", str(signal_at))
    assert preempted.returncode == 42, preempted.stderr[-3000:]
    assert _preempted_steps(preempted.stderr) == {saved_at}  # the step after the signal
    assert len(list((tmp_path / "backup").iterdir())) == 1  # the preemption backup, kept
    resumed = _fit(tmp_path / "backup", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = np.load(tmp_path / "resumed.npz")
    assert set(clean_fit.files) == set(got.files)
    for name in clean_fit.files:
        np.testing.assert_array_equal(got[name], clean_fit[name], err_msg=name)
    assert not (tmp_path / "backup").exists()  # deleted after the completed fit


def test_save_freq_false_needs_save_before_preemption():
    with pytest.raises(ValueError, match=r"save_freq=False.*save_before_preemption=True"):
        mirrored.callbacks.BackupAndRestore("backup", save_freq=False)
    callback = mirrored.callbacks.BackupAndRestore(
        "backup", save_freq=False, save_before_preemption=True
    )
    assert callback.save_freq is False and callback.save_before_preemption


def test_one_process_under_the_launcher_restarts_and_resumes_bitwise(tmp_path, uninterrupted):
    """Item 9: `mirrored launch -n 1 --max-restarts 1`, SIGTERM during step 3."""
    run = _launch(
        tmp_path, 1, 2, "--sigterm-rank", "0", "--sigterm-at", "3", launcher=("--max-restarts", "1")
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert _preempted_steps(run.stdout) == {4}
    assert "restarting all 1 workers (restart 1/1)" in run.stdout
    result = _result(tmp_path)
    assert list(result["ran"]) == [4, 8]
    _assert_bitwise_equal(result, uninterrupted)


# -- where users run it: Kubeflow Trainer's jax-distributed runtime (item 10) -------------------


def test_kubeflow_variables_resolve_the_cluster(monkeypatch):
    from mirrored._cluster.resolvers import resolve_cluster

    for name in ("MIRRORED_COORDINATOR_ADDRESS", "TF_CONFIG", "SLURM_NTASKS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "trainer-node-0:1234")
    assert resolve_cluster() is None  # JAX's own override alone: not a cluster by itself
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    with pytest.raises(ValueError, match=r"(?s)JAX_PROCESS_ID.*missing.*set all three"):
        resolve_cluster()
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    resolver = resolve_cluster()
    assert (resolver.coordinator_address, resolver.num_processes, resolver.process_id) == (
        "trainer-node-0:1234",
        4,
        2,
    )
    monkeypatch.setenv("JAX_PROCESS_ID", "two")
    with pytest.raises(ValueError, match="malformed"):
        resolve_cluster()


@pytest.mark.slow
def test_preemption_under_kubeflow_variables(tmp_path):
    """Two processes started with the variables Kubeflow Trainer sets (no launcher): SIGTERM to
    one stops both at one step with exit 42, as under `mirrored launch`."""
    from mirrored._cluster.launch import free_port

    env = subprocess_env()
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2")
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(tmp_path), "--workers"]
    command += [*STEPS, "--sigterm-rank", "1", "--sigterm-at", "3"]
    codes, outputs = run_two_workers(command, env, "JAX_PROCESS_ID")
    assert codes == [42, 42], outputs[0][-2000:]
    (step,) = _preempted_steps("".join(outputs))
    assert all(f"preempted at step {step}" in output for output in outputs)
    assert sorted(p.name for p in (tmp_path / "preemption").iterdir()) == [str(step)]


# -- no wider door than needed (item 11) -----------------------------------------------------------


def _listeners(pid):
    """The local addresses (hex, as /proc/net/tcp writes them) pid listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.slow
def test_a_one_host_job_listens_on_loopback_only_and_drops_strangers(tmp_path):
    """Before: JAX's coordinator and the rendezvous bound every interface ([::]:port) and
    accepted any client. Now: 127.0.0.1 alone, and the rendezvous admits this job's token."""
    env = job_env(MIRRORED_JOB_TOKEN="this-job")
    port = int(env["MIRRORED_COORDINATOR_ADDRESS"].rpartition(":")[2])
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(tmp_path), "--workers"]
    command += ["--steps", "30", "--pause", "0.2"]
    chief = start_worker(command, env, 0)
    for message in (
        b'{"hello": "mirrored-rendezvous", "process_id": 1, "token": "other"}\n',
        b"GET /\n",
    ):
        deadline = time.monotonic() + 60
        while True:  # the chief listens once it has started
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as stranger:
                    stranger.sendall(message)
                    stranger.recv(100)  # dropped: closed without an answer
                break
            except OSError:
                assert time.monotonic() < deadline, "the chief never listened"
                time.sleep(0.2)
    worker = start_worker(command, env, 1)
    deadline = time.monotonic() + 90
    while not (tmp_path / "pid.1").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # JAX's coordinator and gloo are up
    listening = {rank: _listeners(int((tmp_path / f"pid.{rank}").read_text())) for rank in (0, 1)}
    outputs = [chief.communicate(timeout=120)[0], worker.communicate(timeout=120)[0]]
    assert chief.returncode == worker.returncode == 0, outputs[0][-3000:]
    assert outputs[0].count("dropped a connection to the coordinator's port") == 2
    assert listening[0] and all(address in LOOPBACK for address in listening[0] + listening[1])


# -- a dead peer (item 6) --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0], ids=["worker", "chief"])
def test_the_survivor_of_a_dead_peer_exits_with_43_not_sigabrt(tmp_path, dead):
    """No launcher: worker `dead` ends abruptly (os._exit) during step 3; the survivor's failure
    surfaces outside `run` (`float()` of the reduced loss). Before: a raw JaxRuntimeError, then
    SIGABRT (134) about 17 s later in JAX's shutdown barrier; with the chief dead, a C++ abort."""
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(tmp_path), "--workers"]
    command += ["--steps", "20", "--die-rank", str(dead), "--die-at", "3"]
    codes, outputs = run_two_workers(command, job_env())
    survivor = 1 - dead
    assert codes[dead] == 3
    if dead == 0 and codes[survivor] == -signal.SIGABRT:
        # documented (multi-worker.md, Faults): the chief takes JAX's coordination service with
        # it, and JAX's client may abort the survivor before Python has raised; never a hang
        assert "coordination service" in outputs[survivor], outputs[survivor][-3000:]
        return
    assert codes[survivor] == 43, outputs[survivor][-3000:]
    assert "exits with code 43" in outputs[survivor]
    # named from its liveness port, which refuses connections once the process is gone
    assert f"Process {dead} (worker {dead}) is no longer alive" in outputs[survivor]


# -- an error in one worker (item 8) ---------------------------------------------------------------


def _run_two_workers_timed(command, env):
    """Workers 0 and 1 of `command` to the end: exit codes, outputs and exit times."""
    workers = [start_worker(command, env, rank) for rank in range(2)]
    ends = [0.0, 0.0]
    deadline = time.monotonic() + 150
    while not all(ends) and time.monotonic() < deadline:
        for rank, worker in enumerate(workers):
            if not ends[rank] and worker.poll() is not None:
                ends[rank] = time.time()
        time.sleep(0.05)
    outputs = [worker.communicate(timeout=30)[0] for worker in workers]
    return [worker.returncode for worker in workers], outputs, ends


@pytest.mark.slow
@pytest.mark.parametrize("failing", [1, 0], ids=["worker", "chief"])
def test_an_error_in_one_worker_stops_every_worker_within_seconds_naming_it(tmp_path, failing):
    """TensorFlow's test_error_propagation: worker `failing` raises in its step 3. Before: it hung
    31 s in JAX's shutdown and its peer waited out gloo's 30 s timeout for a raw "Timed out
    waiting 30000ms" naming no process. Now the peer says which process failed and why, and
    both are gone within 5 s of the raise (the failing one with Python's code 1). When process 0
    fails, its peers exit as soon as they have read why (JAX's client would abort them once
    the coordination service in process 0 is gone)."""
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(tmp_path), "--workers"]
    command += ["--steps", "20", "--raise-rank", str(failing), "--raise-at", "3"]
    codes, outputs, ends = _run_two_workers_timed(command, job_env())
    peer = 1 - failing
    assert codes[failing] == 1, outputs[failing][-3000:]
    assert f"ValueError: boom in process {failing} at step 3" in outputs[failing]
    assert codes[peer] == 43, outputs[peer][-3000:]
    why = f"process {failing} (worker {failing}) failed: ValueError: boom in process {failing}"
    assert why in outputs[peer]
    if failing:  # the peer raises at its collective, its error saying why too
        assert f"The first failure: {why}" in outputs[peer]
    else:  # process 0 hosts the coordination service: its peers leave before it goes
        assert "process 1 exits now with code 43" in outputs[peer]
    raised = float(re.search(r"raising at ([\d.]+)", outputs[failing]).group(1))
    assert max(ends) - raised < 5.0, (max(ends) - raised, outputs[peer][-2000:])


# -- a grace period (item 2) -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_grace_period_saves_at_once_trains_on_and_saves_again_before_it_ends(tmp_path):
    """TerminationConfig(grace_period=5), SIGTERM to worker 1 at step 3 (0.2 s per step): both
    workers save at one step S1, train on, save the final checkpoint at one later step S2
    before the 5 s are over, and exit 42 within grace + 15 s of the signal (TF's bound)."""
    command = ["timeout", "-k", "10", "120", sys.executable, SCRIPT, str(tmp_path), "--workers"]
    command += ["--steps", "100", "--sigterm-rank", "1", "--sigterm-at", "3", "--pause", "0.2"]
    codes, outputs, ends = _run_two_workers_timed([*command, "--grace", "5"], job_env())
    assert codes == [42, 42], outputs[1][-3000:]
    first = [_preempted_steps(output) for output in outputs]
    final = [set(map(int, re.findall(r"final checkpoint at step (\d+)", o))) for o in outputs]
    assert first[0] == first[1] and len(first[0]) == 1, first
    assert final[0] == final[1] and len(final[0]) == 1, final
    (s1,), (s2,) = first[0], final[0]
    assert 3 < s1 < s2 < 100
    assert "training on for the grace period (5 s)" in outputs[0]
    signalled = float(re.search(r"sigterm at ([\d.]+)", outputs[1]).group(1))
    assert max(ends) - signalled < 5 + 15
    assert Path(mirrored.latest_checkpoint(tmp_path / "preemption")).name == str(s2)
