"""Cluster resolvers (TensorFlow's names): who the workers are and where the coordinator is,
from the `MIRRORED_*` variables `mirrored launch` sets, TensorFlow's `TF_CONFIG`, SLURM or
Open MPI."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jax._src.clusters import ClusterEnv, OmpiCluster, SlurmCluster


class ClusterResolver:
    """Where the coordinator is, how many processes there are, and which one this is."""

    def __init__(
        self,
        *,
        coordinator_address: str,
        num_processes: int,
        process_id: int,
        task_type: str = "worker",
        task_id: int | None = None,
        local_devices: int | None = None,
    ) -> None:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"Expected 0 <= process_id < num_processes; found process_id={process_id}, "
                f"num_processes={num_processes}."
            )
        self.coordinator_address = coordinator_address
        self.num_processes = num_processes
        self.process_id = process_id
        self.task_type = task_type
        self.task_id = process_id if task_id is None else task_id
        self.local_devices = local_devices

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(coordinator_address={self.coordinator_address!r}, "
            f"num_processes={self.num_processes}, process_id={self.process_id}, "
            f"task_type={self.task_type!r}, task_id={self.task_id})"
        )

    def _task_name(self, process_id: int) -> str:
        # How the user's cluster spec names a process, for error messages.
        return f"worker {process_id}"


def _tf_config_error(found: str, fix: str) -> ValueError:
    return ValueError(
        f'Expected TF_CONFIG to be JSON like {{"cluster": {{"worker": ["host0:port", '
        f'"host1:port"]}}, "task": {{"type": "worker", "index": 0}}}}; {found}. '
        f"Fix: {fix}"
    )


def _check_addresses(name: str, addresses: Any) -> None:
    """TensorFlow's schema: cluster.<type> is a list of "host:port" strings."""
    if not isinstance(addresses, list):
        raise _tf_config_error(
            f"found cluster.{name} = {addresses!r} ({type(addresses).__name__})",
            f'make cluster.{name} a list, even of one: "{name}": [{addresses!r}].',
        )
    for address in addresses:
        host, _, port = str(address).rpartition(":") if isinstance(address, str) else ("", "", "")
        if not host or not port.isdigit():
            raise _tf_config_error(
                f"found {address!r} in cluster.{name}",
                'write each address as "host:port", e.g. "10.0.0.1:12345".',
            )


class TFConfigClusterResolver(ClusterResolver):
    """TensorFlow's `TF_CONFIG`: `cluster.chief`/`cluster.worker` addresses and this `task`.

    The chief (or worker 0 when there is no chief) is process 0 and hosts the coordinator at
    its address.
    """

    def __init__(self, tf_config: str | Mapping[str, Any] | None = None) -> None:
        raw = os.environ.get("TF_CONFIG") if tf_config is None else tf_config
        if raw is None or raw == "":
            raise _tf_config_error("found no TF_CONFIG variable", "set TF_CONFIG on every worker.")
        if isinstance(raw, str):
            try:
                config = json.loads(raw)
            except json.JSONDecodeError as error:
                raise _tf_config_error(
                    f"found malformed JSON ({error.msg} at character {error.pos}): {raw[:80]!r}",
                    "quote keys and strings with double quotes.",
                ) from error
        else:
            config = dict(raw)
        cluster = config.get("cluster") if isinstance(config, dict) else None
        if not isinstance(cluster, dict) or not (cluster.get("worker") or cluster.get("chief")):
            raise _tf_config_error(
                "found no cluster.worker list", "list every worker's host:port under cluster."
            )
        task = config.get("task")
        if not isinstance(task, dict) or "type" not in task or "index" not in task:
            raise _tf_config_error(
                f"found task={task!r}",
                'give each process its task: {"type": "worker", "index": i}.',
            )
        # TensorFlow's multi_worker_util._validate_cluster_spec, plus what would collide here.
        other = sorted(set(cluster) - {"chief", "worker", "evaluator"})
        if other:
            raise _tf_config_error(
                f"found the task type(s) {other} in cluster",
                "list only 'chief' and 'worker' (an 'evaluator' is ignored); parameter "
                "servers do not exist here.",
            )
        for name in ("chief", "worker"):
            _check_addresses(name, cluster.get(name, []))
        chiefs, workers = list(cluster.get("chief", [])), list(cluster.get("worker", []))
        if len(chiefs) > 1:
            raise _tf_config_error(
                f"found {len(chiefs)} entries in cluster.chief",
                "keep one chief (TensorFlow's rule too) and list the others as workers.",
            )
        twice = sorted({a for a in chiefs + workers if (chiefs + workers).count(a) > 1})
        if twice:
            raise _tf_config_error(
                f"found the address(es) {twice} for more than one task",
                "give every task its own host:port (two processes cannot bind one port).",
            )
        kind, index = task["type"], task["index"]
        if kind not in ("chief", "worker"):
            raise _tf_config_error(
                f"found task type {kind!r}",
                "use 'worker' (or 'chief'); parameter servers do not exist here.",
            )
        members = chiefs if kind == "chief" else workers
        if not isinstance(index, int) or not 0 <= index < len(members):
            raise _tf_config_error(
                f"found task index {index!r} but cluster.{kind} has {len(members)} entries",
                f"use an index from 0 to {len(members) - 1}.",
            )
        ordered = chiefs + workers
        process_id = index if kind == "chief" else len(chiefs) + index
        super().__init__(
            coordinator_address=ordered[0],
            num_processes=len(ordered),
            process_id=process_id,
            task_type=kind,
            task_id=index,
        )
        self._tasks = [f"chief {i} at {a}" for i, a in enumerate(chiefs)] + [
            f"worker {i} at {a}" for i, a in enumerate(workers)
        ]

    def _task_name(self, process_id: int) -> str:
        return self._tasks[process_id]


_SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)


def _from_jax_cluster(cluster: type[ClusterEnv], port: int | None) -> dict[str, Any]:
    # The same coordinator, count and id that jax.distributed.initialize() would detect.
    override = str(port) if port is not None else os.environ.get("JAX_COORDINATOR_PORT")
    return {
        "coordinator_address": cluster.get_coordinator_address(
            timeout_secs=None, override_coordinator_port=override
        ),
        "num_processes": cluster.get_process_count(),
        "process_id": cluster.get_process_id(),
    }


class SlurmClusterResolver(ClusterResolver):
    """SLURM's `srun` variables, read by JAX's own SLURM detection.

    The coordinator is the first node of the job step; `SLURM_NTASKS` processes, this one is
    `SLURM_PROCID` — exactly what `jax.distributed.initialize()` detects.

    Args:
        port: the coordinator's port. Default: JAX's choice — `JAX_COORDINATOR_PORT`, else a
            port derived from `SLURM_JOB_ID`, so that two jobs sharing a node do not collide.

    Differs from tf.distribute: no `jobs`/`gpus_per_node` options; GPUs are assigned the way
    `jax.distributed.initialize()` assigns them (one per task, by `SLURM_LOCALID`).
    """

    def __init__(self, *, port: int | None = None) -> None:
        if not SlurmCluster.is_env_present():
            missing = [v for v in _SLURM_VARIABLES if v not in os.environ]
            raise ValueError(
                f"Expected the variables srun sets for each task ({', '.join(_SLURM_VARIABLES)}); "
                f"found {missing} missing. Fix: start the workers with srun, one task per "
                "process (`srun --ntasks=4 python train.py`), not directly in the batch script."
            )
        super().__init__(**_from_jax_cluster(SlurmCluster, port))


class EnvironmentClusterResolver(ClusterResolver):
    """The variables `mirrored launch` sets: MIRRORED_COORDINATOR_ADDRESS, …_NUM_PROCESSES,
    …_PROCESS_ID and optionally …_LOCAL_DEVICES (simulated CPU devices per process)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        names = ("MIRRORED_COORDINATOR_ADDRESS", "MIRRORED_NUM_PROCESSES", "MIRRORED_PROCESS_ID")
        missing = [n for n in names if n not in env]
        if missing:
            raise ValueError(
                f"Expected {', '.join(names)}; found {missing} missing. Fix: start the workers "
                "with `mirrored launch -n N script.py`."
            )
        local = env.get("MIRRORED_LOCAL_DEVICES")
        super().__init__(
            coordinator_address=env["MIRRORED_COORDINATOR_ADDRESS"],
            num_processes=int(env["MIRRORED_NUM_PROCESSES"]),
            process_id=int(env["MIRRORED_PROCESS_ID"]),
            local_devices=int(local) if local else None,
        )


_JAX_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _from_jax_variables(env: Mapping[str, str]) -> ClusterResolver | None:
    """Kubeflow Trainer's `jax-distributed` runtime: JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID (JAX itself reads only the first)."""
    present = [name for name in _JAX_VARIABLES if env.get(name)]
    if not present or present == ["JAX_COORDINATOR_ADDRESS"]:  # JAX's own override alone
        return None
    missing = [name for name in _JAX_VARIABLES if name not in present]
    try:
        if missing:
            raise ValueError(f"{missing} missing")
        return ClusterResolver(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    except ValueError as error:
        raise ValueError(
            f"Expected {', '.join(_JAX_VARIABLES)} (Kubeflow Trainer's jax-distributed "
            f"runtime): an address host:port and two integers; found them incomplete or "
            f"malformed ({error}). Fix: set all three, or none."
        ) from error


def resolve_cluster() -> ClusterResolver | None:
    """The cluster this process belongs to, from its environment; None when it runs alone.

    First match: `mirrored launch`'s variables, `TF_CONFIG`, Kubeflow Trainer's
    `JAX_COORDINATOR_ADDRESS` / `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`, then the environments
    `jax.distributed.initialize()` detects from variables alone, in JAX's order: Open MPI
    (`mpirun`), SLURM (`srun`).
    """
    env = os.environ
    if "MIRRORED_COORDINATOR_ADDRESS" in env:
        return EnvironmentClusterResolver()
    if env.get("TF_CONFIG"):
        return TFConfigClusterResolver()
    kubeflow = _from_jax_variables(env)
    if kubeflow is not None:
        return kubeflow
    if OmpiCluster.is_env_present():
        try:
            return ClusterResolver(**_from_jax_cluster(OmpiCluster, None))
        except (KeyError, ValueError, RuntimeError) as error:
            raise ValueError(
                "Expected Open MPI's OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE and "
                f"OMPI_COMM_WORLD_RANK; found them incomplete or malformed ({error!r}). Fix: "
                "start the workers with mpirun (Open MPI 4), one process per worker."
            ) from error
    if SlurmCluster.is_env_present() or env.get("SLURM_NTASKS", "1") not in ("", "1"):
        return SlurmClusterResolver()
    return None
