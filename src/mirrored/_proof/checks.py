"""The checks `verify` and `doctor` report, each in plain words with its fix: devices, the
all-reduce in the compiled step, replicas in sync, one N-replica step against one device, scaling,
input."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mirrored._core.devices import device_name
from mirrored._core.leaves import raw_array

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"


@dataclasses.dataclass
class Check:
    """The outcome of one check."""

    name: str
    status: str
    summary: str
    explanation: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class HasChecks:
    """A report of `checks`: `ok` when none failed; `report[name]` is the check of that name."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"No check named {name!r}; checks: {[c.name for c in self.checks]}.")


@dataclasses.dataclass
class Report(HasChecks):
    """Every check of one verification; `ok` when none failed."""

    checks: list[Check]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [dataclasses.asdict(c) for c in self.checks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=float)

    def print(self, console: Any = None) -> None:
        from rich.console import Console

        console = console or Console()
        console.print(checks_table(self.checks, "mirrored: proof of distribution"))

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Save the weak-scaling plot (needs the scaling check)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        data = self["Scaling"].data
        if not data.get("replicas"):
            raise ValueError("The report has no scaling measurements; verify with scaling=True.")
        replicas, efficiency = data["replicas"], data["efficiency"]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(replicas, data["examples_per_s"], "o-", label="measured")
        left.plot(replicas, [data["examples_per_s"][0] * r for r in replicas], "--", label="ideal")
        left.set(xlabel="replicas", ylabel="examples / s", title="Weak scaling throughput")
        left.legend()
        right.plot(replicas, efficiency, "o-")
        right.set(xlabel="replicas", ylabel="efficiency", ylim=(0, 1.1), title="Efficiency")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def checks_table(checks: Sequence[Check], title: str) -> Any:
    """A rich table of `checks`: name, coloured status, finding and its explanation."""
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    table.add_column("check")
    table.add_column("status")
    table.add_column("finding")
    colors = {PASS: "green", WARN: "yellow", FAIL: "red", INFO: "blue"}
    for check in checks:
        text = check.summary + (f"\n\n{check.explanation}" if check.explanation else "")
        table.add_row(check.name, f"[{colors[check.status]}]{check.status}[/]", text)
    return table


# -- the checks, each pure -----------------------------------------------------------------


def gpus_visible_to_system() -> bool:
    """Whether the machine shows NVIDIA GPUs, whatever JAX uses."""
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def check_devices(
    *,
    used: Sequence[Any],
    found: Sequence[Any],
    expected_replicas: int | None = None,
    gpus_visible: bool = False,
    unmirrored_state: str | None = None,
) -> Check:
    """Requested vs found vs used devices, and where the state lives."""
    names = [device_name(d) for d in used]
    platform = used[0].platform if used else "none"
    data = {"used": names, "found": [device_name(d) for d in found], "platform": platform}
    summary = f"{len(used)} replica(s) on {', '.join(names)} ({len(found)} device(s) found)"
    if unmirrored_state:
        return Check(
            "Devices", FAIL, summary + "; the state is not mirrored", unmirrored_state, data
        )
    if expected_replicas is not None and len(used) != expected_replicas:
        return Check(
            "Devices",
            FAIL,
            f"{len(used)} replica(s) in sync, but {expected_replicas} were expected",
            f"Training runs on {len(used)} replica(s) although {expected_replicas} were "
            f"expected: it would look distributed and use a fraction of the hardware. Found "
            f"devices: {', '.join(data['found'])}. Fix: build MirroredStrategy() without a "
            "devices= list to use every local device, and check CUDA_VISIBLE_DEVICES / the "
            "installed jaxlib (pip install 'mirrored[cuda]') when GPUs are missing.",
            data,
        )
    if platform == "cpu" and gpus_visible:
        return Check(
            "Devices",
            WARN,
            summary + "; GPUs are visible to the system but JAX uses the CPU",
            "The machine has NVIDIA GPUs, but JAX's default backend is the CPU: training runs "
            "on (simulated) CPU devices. Fix: pip install 'mirrored[cuda]' (jax[cuda12]) and "
            "check that CUDA_VISIBLE_DEVICES does not hide the GPUs.",
            data,
        )
    same_platform = [d for d in found if d.platform == platform]
    if len(used) < len(same_platform):
        return Check(
            "Devices",
            WARN,
            summary + f"; {len(same_platform) - len(used)} device(s) unused",
            f"The strategy uses {len(used)} of {len(same_platform)} {platform} devices. Fix: "
            "MirroredStrategy() without devices= uses them all (ignore if intended).",
            data,
        )
    return Check("Devices", PASS, summary, "", data)


def count_all_reduces(hlo_text: str) -> int:
    """All-reduce operations in compiled HLO text (sync and async forms)."""
    return len(re.findall(r"\ball-reduce(?:-start)?\(", hlo_text))


def check_collectives(hlo_text: str, num_replicas: int) -> Check:
    """The compiled step must all-reduce across replicas when there is more than one."""
    count = count_all_reduces(hlo_text)
    data = {"all_reduce_ops": count, "replicas": num_replicas}
    if num_replicas > 1 and count == 0:
        return Check(
            "Collectives",
            FAIL,
            f"no all-reduce in the compiled step over {num_replicas} replicas",
            "The compiled program never communicates between replicas: each trains on its own "
            'shard ("pretend-distributed"). Fix: compute the loss with '
            "mirrored.compute_average_loss inside strategy.run and take gradients of mirrored "
            "parameters passed as arguments; JAX then sums them across replicas.",
            data,
        )
    if num_replicas == 1:
        return Check(
            "Collectives", INFO, f"1 replica: {count} all-reduce op(s) needed none", "", data
        )
    return Check(
        "Collectives", PASS, f"{count} all-reduce op(s) over {num_replicas} replicas", "", data
    )


def check_in_sync(arrays: dict[str, jax.Array]) -> Check:
    """Every device holds bit-identical copies of every mirrored array."""
    for name, array in arrays.items():
        shards = [np.asarray(raw_array(s.data)) for s in array.addressable_shards]
        first = shards[0]
        for shard in shards[1:]:
            if shard.tobytes() != first.tobytes():
                diff = float(np.max(np.abs(shard.astype(np.float64) - first.astype(np.float64))))
                return Check(
                    "Replicas in sync",
                    FAIL,
                    f"{name} differs between devices (max difference {diff:.3g})",
                    "The replicas hold different values of a mirrored variable, so they train "
                    "different models. Fix: write only values that are identical on every "
                    "replica into mirrored state (all_reduce replica-local statistics first), "
                    "and never build mirrored arrays from per-device data.",
                    {"variable": name, "max_difference": diff},
                )
    return Check(
        "Replicas in sync",
        PASS,
        f"{len(arrays)} mirrored array(s) bit-identical on every device",
        "",
        {"arrays": len(arrays)},
    )


def _diagnose(factor: float, n: int) -> str:
    if n > 1 and math.isclose(factor, n, rel_tol=0.02):
        return (
            f"The factor is the replica count ({n}): the per-replica loss is averaged over the "
            "replica's own examples (loss.mean()) or divided by the per-replica batch size, and "
            "the gradients of mirrored parameters are then SUMMED over replicas. Fix: "
            "loss = mirrored.compute_average_loss(per_example_loss) (divides by the GLOBAL "
            "batch), and do not all-reduce the gradients yourself."
        )
    if n > 1 and math.isclose(factor, 1 / n, rel_tol=0.02):
        return (
            f"The factor is 1/{n}: the loss is divided by the replica count once too often "
            "(e.g. compute_average_loss with the global batch AND a division by "
            "num_replicas_in_sync). Fix: use compute_average_loss(per_example_loss) alone."
        )
    return "Fix: compute the loss with mirrored.compute_average_loss(per_example_loss)."


def check_equivalence(
    replicated_update: dict[str, np.ndarray],
    single_update: dict[str, np.ndarray],
    num_replicas: int,
    *,
    rtol: float = 1e-4,
) -> Check:
    """One N-replica step must update the parameters as one single-device step does."""
    names = sorted(single_update)
    a = np.concatenate([np.ravel(replicated_update[k]).astype(np.float64) for k in names])
    b = np.concatenate([np.ravel(single_update[k]).astype(np.float64) for k in names])
    norm_b = float(np.linalg.norm(b))
    if norm_b == 0.0:
        return Check(
            "Single-device equivalence",
            WARN,
            "the step did not change any parameter; nothing to compare",
            "One step on a single device left every parameter unchanged (a zero learning rate, "
            "or a step that does not update the model?).",
        )
    relative = float(np.linalg.norm(a - b) / norm_b)
    factor = float(a @ b / (b @ b))
    residual = float(np.linalg.norm(a - factor * b)) / max(float(np.linalg.norm(a)), 1e-30)
    data = {"relative_difference": relative, "factor": factor, "replicas": num_replicas}
    if relative <= rtol:
        return Check(
            "Single-device equivalence",
            PASS,
            f"one {num_replicas}-replica step equals one single-device step "
            f"(relative difference {relative:.2g})",
            "",
            data,
        )
    if residual <= 1e-3:
        size = "large" if factor > 1 else "small"
        return Check(
            "Single-device equivalence",
            FAIL,
            f"updates are {factor:.1f}× too {size} compared with one device",
            _diagnose(factor, num_replicas),
            data,
        )
    return Check(
        "Single-device equivalence",
        FAIL,
        f"updates differ from one device's (relative difference {relative:.2g}), not by a "
        "constant factor",
        "The replicas do not compute the global-batch update: gradients are not combined over "
        "the whole batch, or replicas see different parameters. Fix: take gradients of "
        "mirrored parameters passed to strategy.run, with compute_average_loss.",
        data,
    )


def check_scaling(throughput: dict[int, float], platform: str) -> Check:
    """Weak-scaling efficiency: examples/s at n replicas over n × the 1-replica rate."""
    replicas = sorted(throughput)
    rates = [throughput[n] for n in replicas]
    efficiency = [rates[i] / (replicas[i] * rates[0]) for i in range(len(replicas))]
    data = {"replicas": replicas, "examples_per_s": rates, "efficiency": efficiency}
    summary = ", ".join(f"{n}: {e:.0%}" for n, e in zip(replicas, efficiency, strict=True))
    if platform == "cpu":
        return Check(
            "Scaling",
            INFO,
            f"weak-scaling efficiency {summary}",
            "Simulated CPU devices share the host's cores, so adding replicas adds no compute: "
            "these numbers test the machinery, not speed-up. Run on accelerators to judge.",
            data,
        )
    status = PASS if efficiency[-1] >= 0.7 else WARN
    return Check(
        "Scaling",
        status,
        f"weak-scaling efficiency {summary}",
        ""
        if status == PASS
        else "Efficiency drops as replicas are added: the step may be too small per replica "
        "(raise the per-replica batch), or input may starve it.",
        data,
    )


def check_input(
    num_replicas: int,
    global_batch: int,
    *,
    dataset_size: int | None = None,
    steps_per_epoch: int | None = None,
) -> Check:
    """Per-replica and global batch sizes, steps per epoch, and a ragged last batch."""
    padded = global_batch + (-global_batch) % num_replicas
    per_replica = padded // num_replicas
    data: dict[str, Any] = {
        "global_batch": global_batch,
        "per_replica_batch": per_replica,
        "replicas": num_replicas,
    }
    parts = [f"global batch {global_batch} = {num_replicas} × {per_replica} per replica"]
    if padded != global_batch:
        parts.append(f"padded to {padded}")
    if dataset_size is not None:
        expected = math.ceil(dataset_size / global_batch)
        ragged = dataset_size % global_batch
        data.update(dataset_size=dataset_size, steps_per_epoch=expected, last_batch=ragged or None)
        parts.append(f"{expected} steps per epoch")
        if ragged:
            parts.append(f"ragged last batch of {ragged} (padded and masked)")
        if steps_per_epoch is not None and steps_per_epoch != expected:
            return Check(
                "Input",
                WARN,
                "; ".join(parts) + f"; but steps_per_epoch={steps_per_epoch}",
                f"An epoch of {dataset_size} examples at global batch {global_batch} is "
                f"{expected} steps; steps_per_epoch={steps_per_epoch} "
                + ("skips data" if steps_per_epoch < expected else "runs out of data")
                + ". A common cause is computing it from the per-replica batch. Fix: leave "
                "steps_per_epoch unset.",
                data,
            )
    if num_replicas > 1 and per_replica < 8:
        # A small per-replica batch is no evidence of a mistake by itself (a global 32 on 8
        # replicas is a valid choice); one example per replica nearly always is one.
        return Check(
            "Input",
            WARN if per_replica == 1 else INFO,
            "; ".join(parts),
            f"Each replica gets only {per_replica} example(s) per step. batch_size is the "
            f"GLOBAL batch: if {global_batch} was meant per replica, pass "
            f"batch_size={global_batch * num_replicas}.",
            data,
        )
    return Check("Input", PASS, "; ".join(parts), "", data)


# -- verify: the checks on a real step -----------------------------------------------------------
