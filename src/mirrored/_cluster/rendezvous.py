"""Every worker meets the chief before jax.distributed starts, or all of them learn who is missing.

jax.distributed waits for missing tasks in C++ and then aborts the process ("another task
died"), naming nobody. So the chief first listens on the coordinator's port itself; every other
worker connects and says who it is; the chief answers all of them at once — go, or which
workers never came, or how their cluster specs disagree — and the port is free again for JAX's
coordinator service.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import math
import os
import select
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mirrored._cluster.resolvers import ClusterResolver

logger = logging.getLogger("mirrored")

INIT_TIMEOUT_VARIABLE = "MIRRORED_INIT_TIMEOUT"
TOKEN_VARIABLE = "MIRRORED_JOB_TOKEN"  # `mirrored launch` sets one per job
DEFAULT_INIT_TIMEOUT_S = 60.0
_HELLO = "mirrored-rendezvous"
_GRACE_S = 10.0  # beyond the chief's deadline, for its verdict to arrive


def initialization_seconds(value: float | None) -> float:
    """Seconds to wait for every worker: `value`, else $MIRRORED_INIT_TIMEOUT, else 60."""
    source, found = "initialization_timeout", repr(value)
    if value is None:
        raw = os.environ.get(INIT_TIMEOUT_VARIABLE)
        if raw is None:
            return DEFAULT_INIT_TIMEOUT_S
        source, found = INIT_TIMEOUT_VARIABLE, repr(raw)
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(
            f"Expected {source} to be a positive number of seconds; found {found}. Fix: "
            f"MultiWorkerMirroredStrategy(initialization_timeout=60) or {INIT_TIMEOUT_VARIABLE}=60."
        )
    return float(value)


def _host_and_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"Expected the coordinator address as host:port; found {address!r}. Fix: give the "
            "chief (or worker 0) an address like 'host0:12345' in the cluster spec."
        )
    return host.strip("[]"), int(port)


def _fix(resolver: ClusterResolver) -> str:
    return (
        "Fix: start every worker with the same cluster spec (the same TF_CONFIG cluster with "
        "its own task index, one srun, or one `mirrored launch`); check that "
        f"{resolver.coordinator_address} is the chief's address and that every worker can "
        "reach its port; or wait longer: MultiWorkerMirroredStrategy(initialization_timeout="
        f"120) or {INIT_TIMEOUT_VARIABLE}=120."
    )


def _send(sock: socket.socket, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):  # that worker is gone; the others still get an answer
        sock.sendall(json.dumps(message).encode() + b"\n")


def _hung_up(sock: socket.socket) -> bool:
    try:
        return not sock.recv(4096)
    except OSError:
        return True


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def bind_address(resolver: ClusterResolver) -> str | None:
    """Where the coordinator's port listens: `host:port` for a job on one machine (a loopback
    coordinator: nothing else can reach it), None (every interface, JAX's default) when other
    machines must connect. A machine's own name can resolve to 127.0.1.1 on itself, so a
    multi-host job keeps every interface and relies on the rendezvous' job token."""
    host, port = _host_and_port(resolver.coordinator_address)
    if not _is_loopback(host):
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def coordinator_host(resolver: ClusterResolver) -> str:
    """The coordinator's host name or address."""
    return _host_and_port(resolver.coordinator_address)[0]


def _listen(resolver: ClusterResolver, port: int) -> socket.socket:
    host = _host_and_port(resolver.coordinator_address)[0]
    try:
        if bind_address(resolver) is not None:
            return socket.create_server((host, port))
        if socket.has_dualstack_ipv6():  # every interface, as JAX's coordinator binds
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as error:
        raise RuntimeError(
            f"Expected to host the coordinator at {resolver.coordinator_address}; found its port "
            f"{port} unavailable ({error}). Fix: stop the process that uses it (an earlier run "
            "of this job?) or give the chief another port in the cluster spec."
        ) from error


_VERDICTS: dict[str, type[Exception]] = {"TimeoutError": TimeoutError, "ValueError": ValueError}


def _as_verdict(failure: Exception) -> dict[str, Any]:
    return {"ok": False, "kind": type(failure).__name__, "error": str(failure)}


def _message(line: bytes) -> dict[str, Any]:
    """One line of the rendezvous; {} for an empty line (a closed connection) or garbage."""
    try:
        message = json.loads(line or b"{}")
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


def _read_hello(conn: socket.socket, peer: Any) -> dict[str, Any] | None:
    """A worker's hello, or None (logged) for a connection that is not one of this job's."""
    conn.settimeout(2.0)  # a worker says hello as soon as it connects
    try:
        with conn.makefile("rb") as stream:
            hello = _message(stream.readline(4096))
    except OSError:
        hello = {}
    if hello.get("hello") == _HELLO and hello.get("token") == os.environ.get(TOKEN_VARIABLE):
        return hello
    logger.warning(
        "MultiWorkerMirroredStrategy: dropped a connection to the coordinator's port from %s "
        "that is not a worker of this job (%s)",
        peer,
        "another job's token" if hello.get("hello") == _HELLO else "no rendezvous hello",
    )
    return None


def _cluster_problem(
    resolver: ClusterResolver, hello: Mapping[str, Any], joined: Mapping[int, Any]
) -> ValueError | None:
    pid, count = hello.get("process_id"), hello.get("num_processes")
    if count != resolver.num_processes:
        return ValueError(
            f"Expected every worker to see a cluster of {resolver.num_processes} processes, as "
            f"the chief does; found process {pid} seeing {count}. Fix: give every worker the "
            "same cluster spec (only the task index differs)."
        )
    if not isinstance(pid, int) or not 0 < pid < count:
        return ValueError(
            f"Expected the other workers to be processes 1 to {count - 1}; found process {pid!r}. "
            "Fix: give each worker its own task index in the cluster spec."
        )
    if pid in joined:
        return ValueError(
            "Expected each worker to have its own task index; found a second "
            f"{resolver._task_name(pid)}. Fix: give each worker its own task index in the "
            "cluster spec."
        )
    return None


def _host_rendezvous(resolver: ClusterResolver, timeout_s: float) -> None:
    n = resolver.num_processes
    deadline = time.monotonic() + timeout_s
    warn_at = time.monotonic() + min(10.0, timeout_s / 2)
    joined: dict[int, socket.socket] = {}
    answered: list[socket.socket] = []  # every worker that said hello gets the verdict
    failure: Exception | None = None
    with _listen(resolver, _host_and_port(resolver.coordinator_address)[1]) as listener:
        try:
            while len(joined) < n - 1 and not failure and time.monotonic() < deadline:
                if time.monotonic() >= warn_at:
                    warn_at = math.inf
                    logger.warning(
                        "MultiWorkerMirroredStrategy: the coordinator at %s still waits for %s "
                        "(%.0f s left)",
                        resolver.coordinator_address,
                        ", ".join(resolver._task_name(p) for p in range(1, n) if p not in joined),
                        deadline - time.monotonic(),
                    )
                wait = max(0.0, min(deadline, warn_at) - time.monotonic())
                ready, _, _ = select.select([listener, *joined.values()], [], [], wait)
                for sock in ready:
                    if sock is not listener:  # a worker that joined hung up: it died
                        if _hung_up(sock):
                            joined = {p: s for p, s in joined.items() if s is not sock}
                            answered.remove(sock)
                            sock.close()
                        continue
                    conn, peer = listener.accept()
                    hello = _read_hello(conn, peer)
                    if hello is None:  # not one of our workers
                        conn.close()
                        continue
                    answered.append(conn)
                    failure = _cluster_problem(resolver, hello, joined)
                    if not failure:
                        joined[hello["process_id"]] = conn
                        _send(conn, {"wait": deadline - time.monotonic()})
            missing = [p for p in range(1, n) if p not in joined]
            if missing and not failure:
                failure = TimeoutError(
                    f"MultiWorkerMirroredStrategy expected all {n} workers to join the "
                    f"coordinator at {resolver.coordinator_address} within {timeout_s:g} s; found "
                    f"{len(missing)} of {n} missing: "
                    f"{', '.join(resolver._task_name(p) for p in missing)} (joined: "
                    f"{', '.join(resolver._task_name(p) for p in [0, *sorted(joined)])}). "
                    + _fix(resolver)
                )
            verdict = {"ok": True} if failure is None else _as_verdict(failure)
            for sock in answered:
                _send(sock, verdict)
            for sock in answered:  # they hang up first, so that JAX can bind the port at once
                sock.settimeout(2.0)
                while not _hung_up(sock):
                    pass
        finally:
            for sock in answered:
                sock.close()
    if failure is not None:
        raise failure


def _join_rendezvous(resolver: ClusterResolver, timeout_s: float) -> None:
    host, port = _host_and_port(resolver.coordinator_address)
    chief = resolver._task_name(0)
    if resolver.coordinator_address not in chief:
        chief += f" at {resolver.coordinator_address}"
    deadline = time.monotonic() + timeout_s
    warned, last_error = False, "none"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"MultiWorkerMirroredStrategy expected the chief ({chief}) to accept "
                f"{resolver._task_name(resolver.process_id)} within {timeout_s:g} s; found no "
                f"answer (last error: {last_error}). " + _fix(resolver)
            )
        if not warned and timeout_s - remaining >= min(10.0, timeout_s / 2):
            warned = True
            logger.warning(
                "MultiWorkerMirroredStrategy: still waiting for the chief (%s), up to %.0f s more",
                chief,
                remaining,
            )
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
            break
        except OSError as error:
            last_error = str(error)
            time.sleep(min(0.2, remaining))
    hello = {
        "hello": _HELLO,
        "process_id": resolver.process_id,
        "num_processes": resolver.num_processes,
        "token": os.environ.get(TOKEN_VARIABLE),
    }
    with sock, sock.makefile("rb") as answers:
        try:
            sock.sendall(json.dumps(hello).encode() + b"\n")
            sock.settimeout(max(deadline - time.monotonic(), 5.0))
            ack = _message(answers.readline())
            if isinstance(ack.get("wait"), int | float):
                sock.settimeout(ack["wait"] + _GRACE_S)
                verdict = _message(answers.readline())
            else:  # no ack, but perhaps already the verdict (a problem) or nothing at all
                verdict = ack
        except OSError as error:
            verdict = {"error": str(error)}
    if verdict.get("ok"):
        return
    if verdict.get("kind") in _VERDICTS:
        raise _VERDICTS[verdict["kind"]](verdict["error"])
    raise RuntimeError(
        f"MultiWorkerMirroredStrategy expected the chief ({chief}) to report whether every "
        "worker joined; found the connection lost or unanswered "
        f"({verdict.get('error') or 'closed'}): the chief most likely died, or is not a mirrored "
        "worker (see its output). " + _fix(resolver)
    )


def rendezvous(resolver: ClusterResolver, timeout_s: float) -> None:
    """Return once every process of the cluster is up; raise within about `timeout_s` if not.

    TimeoutError: a worker never came (the chief names it in every worker that did).
    ValueError: the workers' cluster specs disagree. RuntimeError: the chief's port is taken,
    or the chief went away.
    """
    if resolver.process_id == 0:
        _host_rendezvous(resolver, timeout_s)
    else:
        _join_rendezvous(resolver, timeout_s)
