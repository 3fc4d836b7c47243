"""MultiWorkerMirroredStrategy: one mesh over the devices of every process (jax.distributed).

The cluster comes from a resolver: the `MIRRORED_*` variables `mirrored launch` sets,
TensorFlow's `TF_CONFIG`, or what `jax.distributed.initialize()` itself detects (Open MPI,
SLURM). Worker 0 (or the chief) hosts the coordinator. Before JAX's runtime starts, every
worker meets the chief at the coordinator's port, so that a worker that never starts is a
Python error in the others within `initialization_timeout`, not a C++ abort minutes later. On
CPUs the collectives go through gloo, with a timeout so that a dead or stalled peer becomes a
Python exception in the survivors instead of a hang.
"""

from __future__ import annotations

import logging
import math
import os

import jax

from mirrored._cluster.rendezvous import (
    bind_address,
    coordinator_host,
    initialization_seconds,
    rendezvous,
)
from mirrored._cluster.resolvers import ClusterResolver, resolve_cluster
from mirrored._core.devices import device_name
from mirrored._core.platform import _backends_initialized, simulate_cpu_devices
from mirrored._run.errors import exit_cleanly_on_peer_failure, listen_for_liveness_probes
from mirrored._strategy.strategy import Strategy

logger = logging.getLogger("mirrored")

COLLECTIVE_TIMEOUT_S = 30


def _initialize(resolver: ClusterResolver, timeout_s: float) -> None:
    if jax.distributed.is_initialized():
        return
    if _backends_initialized():
        raise RuntimeError(
            "Expected MultiWorkerMirroredStrategy to start JAX's distributed runtime, but JAX "
            "already started its backend in this process. Fix: create the strategy before any "
            "JAX computation (right after the imports)."
        )
    rendezvous(resolver, timeout_s)
    if resolver.local_devices:
        simulate_cpu_devices(resolver.local_devices)
    # A dead peer must become an exception in the survivors within seconds, not a hang.
    flag = f"--xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S}"
    if "xla_cpu_collective_timeout_seconds" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=resolver.coordinator_address,
        num_processes=resolver.num_processes,
        process_id=resolver.process_id,
        initialization_timeout=math.ceil(timeout_s),
        heartbeat_timeout_seconds=20,
        # One machine's job: the loopback address alone, not every interface ([::]:port).
        coordinator_bind_address=bind_address(resolver),
    )
    exit_cleanly_on_peer_failure()  # a dead peer: a clear error and code 43, not SIGABRT
    listen_for_liveness_probes(coordinator_host(resolver))  # which peer died: named at once


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of several processes (and machines).

    Create it first thing in every worker: it starts `jax.distributed` from the cluster
    resolver (default: `mirrored launch`'s variables, else `TF_CONFIG`, else Open MPI or SLURM
    as JAX detects them; alone, it runs as one process). Everything else — scope, run, reduce,
    input, Trainer, checkpoints, verify — works unchanged; `num_replicas_in_sync` counts every
    replica of every worker.

    Args:
        cluster_resolver: where the cluster is; None resolves it from the environment.
        initialization_timeout: seconds to wait for every worker to start. A worker that is
            still missing then is a `TimeoutError` in every worker that did start, naming it.
            Default: `$MIRRORED_INIT_TIMEOUT`, else 60.
        hang_timeout: seconds in which no process advances (no step, input or result)
            before the job is reported as hung: every process prints which process is behind
            and where, and at which step the others wait, dumps its threads' stacks, raises
            `mirrored.HangError` and exits with code 44. Default `$MIRRORED_HANG_TIMEOUT`,
            else 300 with several processes (600 s more while one compiles or writes a
            checkpoint); 0 turns it off.

    Differs from tf.distribute: TensorFlow has no such timeout (its workers wait for each
    other); here a missing worker is an error within `initialization_timeout`. TensorFlow's
    `CommunicationOptions(timeout_seconds=)` raises a DeadlineExceededError naming nothing;
    `hang_timeout` names the stalled process.

    Example:
        >>> strategy = mirrored.MultiWorkerMirroredStrategy()   # in a script run by
        >>> # mirrored launch -n 2 --devices-per-process 2 train.py
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        *,
        initialization_timeout: float | None = None,
        max_in_flight: int | None = None,
        donate: bool = True,
        hang_timeout: float | None = None,
    ) -> None:
        timeout_s = initialization_seconds(initialization_timeout)
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        if resolver is not None and resolver.num_processes > 1:
            _initialize(resolver, timeout_s)
        elif resolver is not None and resolver.local_devices:
            simulate_cpu_devices(resolver.local_devices)
        self.cluster_resolver = resolver or ClusterResolver(
            coordinator_address="", num_processes=1, process_id=0
        )
        devices = jax.devices()
        super().__init__(
            devices, max_in_flight=max_in_flight, donate=donate, hang_timeout=hang_timeout
        )
        if self.is_chief:
            logger.info(
                "MultiWorkerMirroredStrategy: %d replica(s) in %d process(es): %s",
                len(devices),
                jax.process_count(),
                ", ".join(f"{device_name(d)}@{d.process_index}" for d in devices),
            )

    @property
    def is_chief(self) -> bool:
        """Whether this process prints and writes files (process 0)."""
        return jax.process_index() == 0
