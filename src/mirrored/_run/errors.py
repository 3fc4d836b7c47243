"""Errors and warnings of a step: Python branches on traced values, a peer process that failed,
mirrored state written from one replica's rows, and the N× loss trap."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from flax import nnx

from mirrored._core import background
from mirrored._core import context as _context
from mirrored._core.coordination import coordination_client as coordination_client
from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._core.mesh import REPLICA_AXIS
from mirrored._nnx import metrics
from mirrored._run.arguments import _SPLIT, _STACKED

loss_logger = logging.getLogger("mirrored.loss")
logger = logging.getLogger("mirrored")


def _warn_per_replica_mean(
    fn_name: str,
    ctx: _context.ReplicaContext,
    variables: list[Any],
    before: list[Any],
    after: list[Any],
    kinds: str,
    n: int,
    padded: bool = False,
) -> None:
    """Name the N× trap where it happens: parameters trained from a per-replica mean loss.

    Gradients of mirrored parameters are summed over replicas. A loss averaged over this
    replica's shard (`jnp.mean`) instead of divided by the global batch trains with N× the
    gradient, in TensorFlow too. The step is suspect when it updated parameters from
    replica-varying inputs and never scaled a loss for the sum (compute_average_loss).
    With a masked (distributed) batch such a step also counts a ragged batch's padded rows,
    copies of real ones, unless it masks them itself (`example_mask`): said too.
    """
    if n == 1 or ctx.replica_aware or not (_SPLIT in kinds or _STACKED in kinds):
        return
    trained = [
        v
        for v, old, new in zip(variables, before, after, strict=True)
        if isinstance(v, nnx.Param) and new is not old
    ]
    if not trained:
        return
    padding = ""
    if padded and not ctx.mask_read:
        padding = (
            "\nAnd on a ragged batch the padded rows (copies of real rows, so that every "
            "replica has one shape) enter any loss that reduces over the replica's rows "
            "without the mask: a sum loss is right on full batches only. For a sum:\n"
            "  mask = mirrored.get_replica_context().example_mask\n"
            "  loss = jnp.sum(jnp.where(mask, per_example_loss, 0.0))"
        )
    loss_logger.warning(
        "%r updates mirrored parameters from a loss that mirrored.compute_average_loss did not "
        "scale. Gradients of mirrored parameters are SUMMED over the %d replicas, so a loss "
        "averaged over each replica's shard (jnp.mean, optax...(...).mean()) trains with %d× "
        "the gradient of the global batch (%d× the learning rate).\n"
        "  Right:  loss = mirrored.compute_average_loss(per_example_loss)%s\n"
        "If the step's loss is a sum over examples (masked as above), or divides such a sum "
        "by the global batch size, it is right: silence this check with "
        "logging.getLogger('mirrored.loss').setLevel(logging.ERROR).",
        fn_name,
        n,
        n,
        n,
        padding,
    )


class PythonBranchError(jax.errors.TracerBoolConversionError):
    """Python `if`, `while` or `bool()` on a value inside the step that has no Python truth
    value: traced (compiled mode) or different on each replica (eager mode)."""

    def __init__(self, message: str) -> None:
        TypeError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0])


def _python_branch_error(error: Exception, fn_name: str, eager: bool) -> PythonBranchError:
    varying = "{V:" in str(error)
    fix = (
        "Fix: compute both sides and choose per element with jnp.where(condition, a, b), or "
        "run one branch with jax.lax.cond(predicate, true_fn, false_fn, *operands) "
        "(jax.lax.while_loop for a while)"
    )
    if varying:
        return PythonBranchError(
            f"Python if/while/bool() in {fn_name!r} on a value that differs per replica: "
            "each replica would need its own Python branch, but the step is one program for "
            f"all of them{' (even when run eagerly)' if eager else ''}. {fix}; or make the "
            "value the same on every replica first, e.g. "
            "mirrored.get_replica_context().all_reduce('SUM', value)."
        )
    return PythonBranchError(
        f"Python if/while/bool() in {fn_name!r} on a traced value: strategy.run compiles the "
        f"step, so its values have no Python truth value while it is traced. {fix}; or, to "
        "debug with Python control flow, mirrored.config.run_functions_eagerly(True) (then "
        "Python branches work on values that are the same on every replica)."
    )


class PeerFailureError(RuntimeError):
    """A collective failed because another worker process died, failed or stalled."""


PEER_FAILURE_EXIT_CODE = 43  # a process that saw a PeerFailureError exits with this
HANG_EXIT_CODE = 44  # every process of a job the hang watchdog stopped exits with this


class HangError(PeerFailureError):
    """No process advanced for `hang_timeout` seconds: says which process is behind, where,
    and at which step the others wait (`mirrored._run.hang`)."""


_HANG_DIAGNOSIS: list[Any] = []  # the watchdog's "conclude now", when one runs
HANG_VERDICT: list[str] = []  # the watchdog's verdict, once it has concluded


def _stalled_peer(error: BaseException) -> str:
    """For a collective that failed while this process' watchdog concludes a hang, or timed
    out while every process lives: the hang watchdog's verdict (it names the stalled process
    and ends this one), else "". A dead peer costs no call to the coordination service here
    (with process 0 dead, JAX's client aborts the process while such a call waits)."""
    if not _HANG_DIAGNOSIS:
        return ""
    diagnose, declared = _HANG_DIAGNOSIS[0]
    if declared():
        return str(diagnose(False))
    if "imed out" not in str(error) or _dead_processes():
        return ""
    return str(diagnose(True))


def register_hang_diagnosis(diagnose: Any, declared: Any) -> None:
    """A collective that fails asks the hang watchdog (if any) for its verdict."""
    _HANG_DIAGNOSIS[:] = [(diagnose, declared)]


FAILURE_KEY = "mirrored/failure"  # the first process to fail says why, in JAX's key-value store
_SEEN_DIR = "mirrored/failure_seen/"  # each other process acknowledges it here
WATCH_INTERVAL_S = 0.25  # how often each process looks for a peer's failure
ACK_WAIT_S = 2.0  # how long a failed process waits for the others to read why
_EXIT: list[int] = []  # the code this process ends with, once it must skip JAX's shutdown
_PEER_FAILURE: list[str] = []  # a peer's failure, as it published it


def _exit_without_the_shutdown_barrier(code: int | None = None) -> None:
    """At interpreter exit after this process or a peer failed: end here, with _EXIT's code
    (or `code`).

    JAX's own exit handler shuts `jax.distributed` down through a barrier of every process;
    with one of them dead or failed it waits, then aborts the process (SIGABRT, code 134,
    after ~17 s), so nothing after it runs and a launcher sees a crash. Registered after JAX's
    handler, this one runs first (atexit is last in, first out)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(_EXIT[0] if code is None else code)


def _exit_at_the_end(code: int = PEER_FAILURE_EXIT_CODE) -> None:
    if not _EXIT:
        atexit.register(_exit_without_the_shutdown_barrier)
        _EXIT.append(code)


def _bounded(call: Any, timeout_s: float) -> list[Any]:
    """[call()] if it returns within `timeout_s`, else [] (the coordination service may be the
    one that died, and its calls then wait)."""
    answer: list[Any] = []
    asking = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    asking.start()
    asking.join(timeout_s)
    return answer


_ALIVE_DIR = "mirrored/alive/"  # each process' liveness port, "host:port"
_PROBE_SOCKET: list[socket.socket] = []  # this process' (never accepted: the kernel answers)
_PEER_ADDRESSES: dict[int, tuple[str, int]] = {}  # the others', read once all are there
PROBE_TIMEOUT_S = 1.0


def listen_for_liveness_probes(coordinator_host: str) -> None:
    """Open a port that says "this process is alive" (a connection to it succeeds while the
    process lives and is refused once it is gone) and publish it in JAX's key-value store, on
    the interface that reaches the coordinator (loopback for a one-machine job).

    A survivor of a collective failure probes every peer's port to name the dead ones at once:
    JAX's coordination service only notices after its heartbeat timeout, and asking it then
    blocks until every live process asks too."""
    client = coordination_client()
    if client is None or _PROBE_SOCKET:
        return
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:  # sends nothing
            route.connect((coordinator_host, 9))
            host = route.getsockname()[0]
        listener = socket.create_server((host, 0), backlog=64)
        port = listener.getsockname()[1]
        client.key_value_set(f"{_ALIVE_DIR}{jax.process_index()}", f"{host}:{port}")
    except (OSError, RuntimeError) as error:  # an IPv6-only host, say: no naming, no harm
        logger.debug("No liveness port: %s", error)
        return
    _PROBE_SOCKET.append(listener)


def _read_peer_addresses(client: Any) -> None:
    if len(_PEER_ADDRESSES) == jax.process_count() - 1 or not _PROBE_SOCKET:
        return
    with contextlib.suppress(Exception):
        for key, value in client.key_value_dir_get(_ALIVE_DIR):
            rank = int(key.rsplit("/", 1)[-1])
            host, port = value.rsplit(":", 1)
            if rank != jax.process_index():
                _PEER_ADDRESSES[rank] = (host, int(port))


def _dead_processes(tries: int = 5) -> list[int]:
    """The peers whose liveness port refuses a connection (they are gone); a peer on a lost
    machine, whose probe times out, is counted too. [] when the ports are not known.

    Asked again a few times 0.1 s apart while none is found: a dying process' kernel closes
    its sockets one by one, and its gloo connection may fail before its port does."""
    for attempt in range(tries):
        dead = []
        for rank, address in sorted(_PEER_ADDRESSES.items()):
            try:
                socket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
            except OSError:
                dead.append(rank)
        if dead or not _PEER_ADDRESSES or attempt == tries - 1:
            return dead
        time.sleep(0.1)
    return []


def _publish_failure(error: BaseException) -> None:
    """Tell every other process why this one fails (the first failure in the job wins), and
    wait up to ACK_WAIT_S for them to read it: when this process hosts the coordination
    service, its exit takes the message with it."""
    client = coordination_client()
    if client is None:
        return
    rank = jax.process_index()
    message = f"process {rank} (worker {rank}) failed: {type(error).__name__}: {error}"
    if len(message) > 2000:
        message = message[:2000] + " [...]"
    with contextlib.suppress(Exception):
        client.key_value_set(FAILURE_KEY, message)
    others = jax.process_count() - 1
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline:
        seen = _bounded(lambda: client.key_value_dir_get(_SEEN_DIR), 1.0)
        if seen and len(seen[0]) >= others:
            if rank == 0:  # they exit right after reading; let them go before the service
                time.sleep(0.2)
            return
        time.sleep(0.05)


def _watch_for_peer_failures(stop: threading.Event) -> None:
    """Background thread: when a peer publishes its failure, say so at once and keep it for the
    PeerFailureError that this process' next collective raises."""
    client = coordination_client()
    rank = jax.process_index()
    while not stop.wait(WATCH_INTERVAL_S):
        _read_peer_addresses(client)
        try:
            message = client.key_value_try_get(FAILURE_KEY)
        except Exception:  # not there yet, or the service is gone
            continue
        if message.startswith(f"process {rank} "):
            return
        _PEER_FAILURE.append(message)
        chief = message.startswith("process 0 ")
        print(
            f"mirrored: {message}\nmirrored: process {rank} "
            + ("exits now" if chief else "stops at its next collective and exits")
            + f" with code {PEER_FAILURE_EXIT_CODE}.",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(Exception):
            client.key_value_set(f"{_SEEN_DIR}{rank}", "1")
        if chief:  # the coordination service ends with process 0, and JAX's client then
            _exit_without_the_shutdown_barrier(PEER_FAILURE_EXIT_CODE)  # aborts: leave first
        return


def _peer_failure_text() -> str:
    """The failed peer's own message when it published one; else the peers that are gone."""
    if _PEER_FAILURE:
        return f" The first failure: {_PEER_FAILURE[0]}."
    dead = _dead_processes()
    if not dead:
        return ""
    names = ", ".join(f"process {r} (worker {r})" for r in dead)
    return f" {names[0].upper()}{names[1:]} {'is' if len(dead) == 1 else 'are'} no longer alive."


def exit_cleanly_on_peer_failure() -> None:
    """In a multi-process job (idempotent):

    - an uncaught error in this process is published to every other process (which say which
      process failed and why, and stop at their next collective within seconds, where they
      would otherwise wait out the collective timeout), and this process exits at once with
      code 1 instead of waiting in JAX's shutdown barrier;
    - an uncaught error from a failed collective, wherever it surfaces (`float()` of a step's
      output, a checkpoint, a `reduce`), is explained once and ends the process with
      PEER_FAILURE_EXIT_CODE, never SIGABRT in JAX's shutdown.
    """
    previous = sys.excepthook
    if getattr(previous, "_mirrored_peer_failure", False):
        return
    background.start(
        _watch_for_peer_failures, "mirrored-peer-failures", _STOP_WATCHING, (_STOP_WATCHING,)
    )

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        if isinstance(value, HangError) or HANG_VERDICT or _stalled_peer(value):
            _exit_at_the_end(HANG_EXIT_CODE)  # the hang, reported above
        elif isinstance(value, PeerFailureError) or _collective_failure(value):
            if not isinstance(value, PeerFailureError):
                known = _peer_failure_text()
                print(
                    "mirrored: a collective between the worker processes failed (a peer most "
                    f"likely died).{known} This process exits with code "
                    f"{PEER_FAILURE_EXIT_CODE}. Restart the job (BackupAndRestore resumes it).",
                    file=sys.stderr,
                    flush=True,
                )
            _exit_at_the_end()
        elif jax.process_count() > 1:
            _STOP_WATCHING.set()
            _publish_failure(value)
            print(
                f"mirrored: told the other processes that process {jax.process_index()} "
                "failed; exiting with code 1.",
                file=sys.stderr,
                flush=True,
            )
            _exit_at_the_end(1)

    hook._mirrored_peer_failure = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_STOP_WATCHING = threading.Event()


def _collective_failure(error: BaseException) -> bool:
    text = str(error)
    return any(
        marker in text
        for marker in ("Gloo", "gloo", "Connection reset", "collective", "DEADLINE_EXCEEDED")
    )


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turn a failed cross-process collective into a `PeerFailureError` that says why (the
    failed peer's own error when it published one); the process then exits with
    PEER_FAILURE_EXIT_CODE instead of aborting in JAX's shutdown."""
    try:
        yield
    except Exception as error:
        if HANG_VERDICT:  # the watchdog stopped the job: this is the hang it reported
            raise HangError(HANG_VERDICT[0]) from error
        if jax.process_count() > 1 and _collective_failure(error):
            stalled = _stalled_peer(error)
            if stalled:
                raise HangError(stalled) from error
            _exit_at_the_end()
            raise PeerFailureError(
                "A collective between the worker processes failed: a peer process failed, "
                "died or stalled (its connection was reset, or the collective timed out)."
                f"{_peer_failure_text()} This process cannot continue; it exits "
                f"with code {PEER_FAILURE_EXIT_CODE} when Python ends.\n"
                "Fix: check the other workers' logs for the first error; restart the job "
                "(BackupAndRestore resumes it; `mirrored launch --max-restarts N` restarts it "
                "by itself). The timeout is XLA's --xla_cpu_collective_timeout_seconds (set in "
                "XLA_FLAGS before start)."
            ) from error
        raise


class ReplicaDivergenceError(ValueError):
    """A step wrote a replica-local value into mirrored state."""


def _diverged_error(fn_name: str, args: Any, kwargs: Any, variable: Any) -> ValueError:
    name = type(variable).__name__
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_is_leaf)[0]:
        if leaf is variable:
            name = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])
            break
    if isinstance(variable, nnx.BatchStat) or "aggregation" in variable.get_metadata():
        value = variable.get_raw_value()
        kind = f"{type(variable).__name__} of {getattr(value, 'dtype', type(value).__name__)}"
        declared = variable.get_metadata().get("aggregation")
        why = (
            f"it is declared aggregation={declared!r}, which keeps it identical on every replica"
            if declared is not None and str(declared).lower() == "none"
            else "BatchNorm's statistics (floats) are averaged over the replicas, but integers "
            "cannot be averaged"
        )
        return ReplicaDivergenceError(
            f"{fn_name!r} updated {name} (a {kind}) from this replica's rows, so it differs "
            f"between replicas, and its rule cannot combine them: {why}.\n"
            "Fix: declare how the replicas' values combine, TensorFlow's VariableAggregation "
            "as the Variable's metadata: aggregation='sum' (a counter: every replica's "
            "additions count), 'max' or 'min' (a running extreme), 'only_first_replica', "
            f"e.g. {type(variable).__name__}(value, aggregation='sum')."
        )
    if isinstance(variable, nnx.metrics.MetricState):
        owner = next(
            (
                type(m).__name__
                for m in metrics.flax_metrics((args, kwargs))
                if any(v is variable for v in vars(m).values())
            ),
            "metric",
        )
        return ReplicaDivergenceError(
            f"{fn_name!r} updated the Flax metric state {name} (of a {owner}) from this "
            "replica's shard of the "
            "batch, so it differs between replicas. A Flax metric whose update only adds to "
            "its state (Average, Accuracy, MultiMetrics of them, or your own Metric with "
            "`self.total[...] += ...`) holds sums, which strategy.run adds across replicas for "
            f"you; this {owner}'s update is not a sum (it rescales or replaces its old state, "
            "as Welford's running mean does), so N replicas cannot combine it exactly.\n"
            "Fix: use mirrored.metrics (Mean, Accuracy, SparseCategoricalAccuracy, ...), or "
            "nnx.metrics.Average, whose sums every replica adds to:\n"
            "  with strategy.scope():\n"
            "      accuracy = mirrored.metrics.SparseCategoricalAccuracy()\n"
            "  # in the step: accuracy.update_state(y, logits); after it: accuracy.result()"
        )
    return ReplicaDivergenceError(
        f"{fn_name!r} wrote a value into the mirrored variable {name} that differs between "
        "replicas (it was computed from this replica's shard of the batch). Mirrored state must "
        "stay identical on every replica, or the replicas silently drift apart.\n"
        "Fix: combine the replicas' values before assigning, with the reduction that fits:\n"
        "  ctx = mirrored.get_replica_context()\n"
        "  total[...] = total[...] + ctx.all_reduce('SUM', local_sum)    # counters, sums\n"
        "  stat[...] = ctx.all_reduce('MEAN', local_statistic)           # averages\n"
        "(a running total of a metric needs SUM of the additions, never MEAN of the totals; "
        "mirrored.metrics does it for you), "
        "or keep per-replica running values out of the model: return them from the step and "
        "combine them with strategy.reduce. BatchNorm's nnx.BatchStat statistics are averaged "
        "for you; gradients of a loss from mirrored.compute_average_loss are already summed."
    )


def _output_array(value: Any) -> Any:
    """One leaf of what the step returned, as an array; anything else (a string, an object)
    is an error that says what a step may return."""
    try:
        return jnp.asarray(value)
    except TypeError as error:
        raise TypeError(
            f"Expected strategy.run's step to return arrays, numbers or None, in tuples, lists "
            f"or dicts (a pytree); found {type(value).__name__} {value!r:.60}. Fix: return "
            "jnp arrays (or keep strings and objects outside the step: they cannot cross "
            "the compiled program)."
        ) from error


def _warn_invariant_psums(fn_name: str, closed: Any) -> None:
    """Warn once per step when it sums over the replicas, with `jax.lax.psum` written by
    hand, a value that is already the same on every replica (the gradients of mirrored
    parameters are, summed already): the result is N times it, silently. JAX lowers such a
    sum to `psum_invariant` of a `pvary`; mirrored's `all_reduce` refuses it outright."""

    def found(jaxpr: Any) -> bool:
        made_by = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "psum_invariant" and REPLICA_AXIS in eqn.params["axes"]:
                source = made_by.get(eqn.invars[0])
                if (
                    source is not None
                    and source.primitive.name == "pvary"
                    and not isinstance(source.invars[0], jax.extend.core.Literal)
                    and jnp.issubdtype(source.invars[0].aval.dtype, jnp.floating)
                ):
                    return True
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns") and found(inner):
                    return True
        return False

    if found(closed.jaxpr):
        logger.warning(
            "%r sums over the replicas (jax.lax.psum over %r) a value that is already the same "
            "on every replica: the result is N times it. Gradients of mirrored parameters are "
            "already summed over the replicas by jax.grad; summing them again multiplies the "
            "update by N. Fix: drop the psum/pmean of the gradients (the step is already "
            "synchronous), or use mirrored.get_replica_context().all_reduce, which refuses "
            "such a value.",
            fn_name,
            REPLICA_AXIS,
        )


def _warn_captured_keys(fn_name: str, keys: list[tuple[str, Any]]) -> None:
    """A step that captures a random key compiles it in as a constant: every replica, and
    every step, draws the same numbers (the same dropout mask on every shard)."""
    if not keys:
        return
    logger.warning(
        "%r captures the random key %s, compiled into the step as a constant: every replica "
        "and every step draws the same random numbers. Fix: pass nnx.Rngs created inside "
        "strategy.scope() as an argument (their streams differ per replica and advance every "
        "step), or pass the key and fold in the replica and the step: jax.random.fold_in("
        "jax.random.fold_in(key, step), mirrored.get_replica_context()"
        ".replica_id_in_sync_group).",
        fn_name,
        ", ".join(repr(name) for name, _ in keys),
    )
