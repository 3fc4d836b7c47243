"""The `mirrored` command."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import NoReturn

import typer

app = typer.Typer(
    help="mirrored: TensorFlow's MirroredStrategy on JAX.",
    no_args_is_help=True,
    add_completion=False,
)


def _has_accelerator_plugin() -> bool:
    # Decided without starting JAX's backend, which would freeze the CPU device count.
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "libtpu")
    )


def _fail(message: str) -> NoReturn:
    """A usage error: one line on stderr, exit code 2 (never a traceback)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _check_output_file(path: str | None, option: str) -> None:
    """`path` can be written: its folder exists and it is not a folder (before any work)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        found = "a folder" if os.path.isdir(path) else f"in {folder}, which does not exist"
        _fail(
            f"expected {option} to name a file to write in an existing folder; found "
            f"{path!r}, {found}. Fix: create the folder, or pass e.g. {option} scaling.png"
        )


def _check_step_spec(spec: str) -> None:
    """--step FILE.py:FUNCTION names a file that exists (before JAX starts)."""
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier():
        _fail(
            f"expected --step FILE.py:FUNCTION; found {spec!r}. Fix: e.g. --step "
            "train.py:make_step, where make_step() returns (strategy, step_fn, args)"
        )
    if not os.path.isfile(path):
        _fail(
            f"expected --step's FILE to be a Python file; found {path!r}, which does not "
            f"exist (relative to {os.getcwd()}). Fix: check the path"
        )


def _setup_devices(devices: int | None) -> None:
    import jax

    import mirrored

    if devices is not None:
        jax.config.update("jax_platforms", "cpu")
        mirrored.simulate_cpu_devices(devices)
    elif not _has_accelerator_plugin():
        mirrored.simulate_cpu_devices(8)


@app.command()
def demo(
    devices: int | None = typer.Option(
        None,
        "--devices",
        min=1,
        help="Simulate this many CPU devices (default: 8 when no accelerator is installed).",
    ),
    loop: str = typer.Option(
        "fit", help="'fit' (Trainer.fit) or 'custom' (a strategy.run training loop)."
    ),
    epochs: int = typer.Option(20, min=1, help="Passes over the training data."),
    batch_size: int = typer.Option(128, min=1, help="GLOBAL batch size, split over replicas."),
    learning_rate: float = typer.Option(3e-3, help="Adam learning rate."),
    seed: int = typer.Option(0, help="Seed for initialisation and shuffling."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show INFO logs."),
) -> None:
    """Train an MLP on scikit-learn's bundled digits with a MirroredStrategy."""
    if loop not in ("fit", "custom"):
        _fail(f"expected --loop fit or --loop custom; found {loop!r}. Fix: --loop fit")
    if not learning_rate > 0:
        _fail(
            f"expected --learning-rate > 0; found {learning_rate}. Fix: e.g. --learning-rate 3e-3"
        )
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _setup_devices(devices)
    from mirrored._cli.demo import run_demo

    try:
        run_demo(
            loop=loop,
            epochs=epochs,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
        )
    except ValueError as error:
        _fail(str(error))


@app.command()
def doctor(
    devices: int | None = typer.Option(
        None, "--devices", min=1, help="Simulate this many CPU devices (default: 8 without GPUs)."
    ),
    expect: int | None = typer.Option(
        None, "--expect", min=1, help="Replicas you expect; fewer is a failure."
    ),
    step: str | None = typer.Option(
        None,
        "--step",
        help="Check your own step: FILE.py:FUNCTION, where FUNCTION() returns "
        "(strategy, step_fn, args).",
    ),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        min=1,
        help="The global batch of the built-in step (default 128), or of the fit of a Keras "
        "model that FUNCTION returns in place of step_fn (default 32, as fit's).",
    ),
    json_output: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot: str | None = typer.Option(None, "--plot", help="Save the scaling plot (PNG) here."),
    scaling: bool = typer.Option(True, help="Measure weak scaling over 1..N replicas."),
    profile: str | None = typer.Option(
        None,
        "--profile",
        metavar="DIR",
        help="Also profile a few steps with jax.profiler: the trace goes to DIR (TensorBoard, "
        "Perfetto) and a breakdown of the step's time (compute, collectives, input, idle).",
    ),
    profile_steps: int = typer.Option(5, "--profile-steps", min=1, help="Steps to profile."),
) -> None:
    """Prove that training is really distributed: devices, collectives, sync, scale, input."""
    if step:
        _check_step_spec(step)
    _check_output_file(plot, "--plot")
    if profile and os.path.isfile(profile):
        _fail(
            f"expected --profile DIR to be a folder (made if missing); found the file "
            f"{profile!r}. Fix: pass a folder, e.g. --profile profile/"
        )
    _setup_devices(devices)
    from mirrored._cli.doctor import builtin_step, user_step
    from mirrored._proof.verify import verify

    if not step:
        strategy, step_fn, args = builtin_step(batch_size or 128)
    try:
        if step:
            strategy, step_fn, args = user_step(step)
        report = verify(
            strategy,
            step_fn,
            args,
            expected_replicas=expect,
            scaling=scaling,
            batch_size=batch_size if step else None,
        )
    except (OSError, ValueError, TypeError, AttributeError) as error:
        _fail(str(error))
    except Exception as error:  # the user's own code failed: one line, and how to see more
        if not step:
            raise
        _fail(
            f"expected --step {step} to load and run; found {type(error).__name__}: {error}. "
            "Fix: run the file with python to see the traceback, and fix the step"
        )
    import json

    profiled = None
    if profile:
        from mirrored._cli.doctor import profile_step

        profiled = profile_step(
            strategy, step_fn, args, logdir=profile, steps=profile_steps, batch_size=batch_size
        )
    if json_output:
        out = report.to_dict()
        if profiled is not None:
            out["profile"] = profiled.to_dict()
            out["ok"] = out["ok"] and profiled.ok
        typer.echo(json.dumps(out, indent=2, default=float))
    else:
        report.print()
        if profiled is not None:
            profiled.print()
    if plot:
        report.plot(plot)
        if not json_output:
            typer.echo(f"scaling plot: {plot}")
    if not report.ok or (profiled is not None and not profiled.ok):
        raise typer.Exit(1)


@app.command()
def bench(
    devices: int | None = typer.Option(
        None, "--devices", min=1, help="Simulate this many CPU devices (default: 8 without GPUs)."
    ),
    models: str = typer.Option("seed_mlp,wide_mlp", help="Comma-separated: seed_mlp, wide_mlp."),
    steps: int = typer.Option(20, min=1, help="Timed steps per point (wide MLP: a fifth)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    plot: str | None = typer.Option(None, "--plot", help="Save the efficiency plot (PNG) here."),
) -> None:
    """Weak and strong scaling of the seed and wide MLPs over 1, 2, 4 … N replicas."""
    from mirrored._cli.bench import MODELS

    names = [m.strip() for m in models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        _fail(
            f"expected --models from {', '.join(sorted(MODELS))} (comma-separated); found "
            f"{models!r}. Fix: e.g. --models seed_mlp,wide_mlp"
        )
    _check_output_file(plot, "--plot")
    _setup_devices(devices)
    import json

    from mirrored._cli.bench import plot_report, print_report, scaling

    report = scaling(names, steps=steps)
    if json_output:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report)
    if plot:
        plot_report(report, plot)


@app.command(
    # Everything after SCRIPT is the script's: `mirrored launch -n 2 train.py -n 5` passes -n 5.
    context_settings={"allow_extra_args": True, "allow_interspersed_args": False},
    options_metavar="[OPTIONS] SCRIPT [ARGS]...",
)
def launch(
    ctx: typer.Context,
    num_processes: int = typer.Option(..., "-n", "--num-processes", min=1, help="Workers."),
    devices_per_process: int | None = typer.Option(
        None, "--devices-per-process", min=1, help="Simulated CPU devices in each worker."
    ),
    grace: float = typer.Option(
        5.0, min=0.0, help="Seconds the workers get to exit before SIGKILL, after a failure."
    ),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        min=0,
        help="Restart every worker after a failure (exit 42 included), at most this often.",
    ),
) -> None:
    """Run SCRIPT [ARGS]... as N local workers of a MultiWorkerMirroredStrategy job.

    SCRIPT is a .py file (run with this Python) or a program; every worker gets the same ARGS.
    After a failure every worker is started again, up to --max-restarts times
    (MIRRORED_RESTART_COUNT tells them which start this is); SIGTERM to the launcher reaches
    the workers, whose PreemptionCheckpointHandler saves, and the launcher exits 42.
    """
    import shutil
    import sys

    from mirrored._cluster.launch import launch as run_workers

    if not ctx.args:
        _fail("expected a script; found none. Fix: mirrored launch -n 2 train.py [args]")
    script, *rest = ctx.args
    if not (os.path.isfile(script) if script.endswith(".py") else shutil.which(script)):
        _fail(
            f"expected SCRIPT to be a .py file or a program on PATH; found {script!r}, "
            "which is neither. Fix: check the path (relative to "
            f"{os.getcwd()}), e.g. mirrored launch -n 2 train.py"
        )
    command = [sys.executable, script, *rest] if script.endswith(".py") else [script, *rest]
    code = run_workers(
        command,
        num_processes=num_processes,
        devices_per_process=devices_per_process,
        grace_s=grace,
        max_restarts=max_restarts,
    )
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the versions of mirrored and its stack."""
    import flax
    import jax
    import optax

    import mirrored

    typer.echo(
        f"mirrored {mirrored.__version__} (jax {jax.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__})"
    )


def main() -> None:
    app()


if __name__ == "__main__":
    main()
