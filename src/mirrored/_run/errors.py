"""Errors and warnings of a step: Python branches on traced values, a peer process that failed,
mirrored state written from one replica's rows, and the N× loss trap."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from mirrored._core import context as _context
from mirrored._core.leaves import is_leaf as _is_leaf
from mirrored._nnx import metrics
from mirrored._run.arguments import _SPLIT, _STACKED

loss_logger = logging.getLogger("mirrored.loss")


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
    """A collective failed because another worker process died or stalled."""


PEER_FAILURE_EXIT_CODE = 43  # a process that saw a PeerFailureError exits with this
_EXIT_INSTALLED: list[bool] = []


def _exit_without_the_shutdown_barrier() -> None:
    """At interpreter exit after a peer failed: end here, with PEER_FAILURE_EXIT_CODE.

    JAX's own exit handler shuts `jax.distributed` down through a barrier of every process;
    with one of them dead it waits, then aborts the process (SIGABRT, code 134, after ~17 s),
    so nothing after it runs and a launcher sees a crash. Registered after JAX's handler, this
    one runs first (atexit is last in, first out)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(PEER_FAILURE_EXIT_CODE)


def _dead_processes(timeout_s: float = 2.0) -> list[int]:
    """The processes JAX's coordination service no longer counts alive (asked with a bound:
    the service may be the one that died); [] when it does not know."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return []
    count = jax.process_count()
    answer: list[Any] = []
    asking = threading.Thread(
        target=lambda: answer.append(client.get_live_nodes(list(range(count)))), daemon=True
    )
    asking.start()
    asking.join(timeout_s)
    if not answer:
        return []
    return [p for p in range(count) if p not in answer[0]]


def _exit_at_the_end() -> None:
    if not _EXIT_INSTALLED:
        atexit.register(_exit_without_the_shutdown_barrier)
        _EXIT_INSTALLED.append(True)


def exit_cleanly_on_peer_failure() -> None:
    """In a multi-process job: an uncaught error from a failed collective, wherever it surfaces
    (`float()` of a step's output, a checkpoint, a `reduce`), is explained once and ends the
    process with PEER_FAILURE_EXIT_CODE, never SIGABRT in JAX's shutdown (idempotent)."""
    previous = sys.excepthook
    if getattr(previous, "_mirrored_peer_failure", False):
        return

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        if isinstance(value, PeerFailureError) or _collective_failure(value):
            if not isinstance(value, PeerFailureError):
                print(
                    "mirrored: a collective between the worker processes failed (a peer most "
                    "likely died); this process exits with code "
                    f"{PEER_FAILURE_EXIT_CODE}. Restart the job (BackupAndRestore resumes it).",
                    file=sys.stderr,
                    flush=True,
                )
            _exit_at_the_end()

    hook._mirrored_peer_failure = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _collective_failure(error: BaseException) -> bool:
    text = str(error)
    return any(
        marker in text
        for marker in ("Gloo", "gloo", "Connection reset", "collective", "DEADLINE_EXCEEDED")
    )


@contextlib.contextmanager
def peer_failures() -> Iterator[None]:
    """Turn a failed cross-process collective into a `PeerFailureError` that says why; the
    process then exits with PEER_FAILURE_EXIT_CODE instead of aborting in JAX's shutdown."""
    try:
        yield
    except Exception as error:
        if jax.process_count() > 1 and _collective_failure(error):
            _exit_at_the_end()
            dead = _dead_processes()
            known = f"; process {', '.join(map(str, dead))} is no longer alive" if dead else ""
            raise PeerFailureError(
                "A collective between the worker processes failed: a peer process most likely "
                f"died or stalled{known} (its connection was reset, or the collective timed "
                "out). This process cannot continue; it exits "
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
