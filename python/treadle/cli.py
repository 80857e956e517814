"""The ``treadle`` command (typer). Each area adds its own sub-app in ``treadle/<area>/cli.py``.

    treadle --version | backends | demo | bench | <area> ...

Rules every command follows: area sub-apps are imported only when they run (``treadle --help`` imports
no torch); a usage error is one line ``Error: ...`` naming the flag, exit 2, before expensive work;
output folders are ``--out`` under one rule (:mod:`treadle.run_dirs`); third-party progress bars and
deprecation warnings are silenced (:mod:`treadle.cli_output`).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import typer
from typer import _click as click  # typer vendors click: its exceptions and Group are these

from treadle.cli_output import make_console, quiet_third_party
from typer.core import TyperGroup

# (sub-command, module holding a typer `app`[, one-line help]); areas whose module file is missing are
# skipped, so areas land one by one. Area modules are imported only when their sub-command runs, so that
# `treadle --help` (and `treadle --version`) never import torch.
AREAS = [
    ("grpo", "treadle.grpo.cli", "GRPO family: group-relative advantages and the TRL/verl adapters."),
    ("model", "treadle.models.cli", "Embedded default models (tiny Qwen3 trained locally; any local HF checkpoint)."),
    ("stair", "treadle.stair.cli", "STAIR: reflected read-out of earlier responses' K/V (train, evaluate)."),
    ("scale", "treadle.scale.cli", "SCALE: per-token gated LoRA (Stage I SFT, Stage II gates, (L, U) sweeps)."),
    ("weft", "treadle.weft.cli", "WEFT runtime: stateful MCP tool environments, sessions, verification."),
    ("rsi", "treadle.rsi.cli"),
    ("llm", "treadle.llm.cli"),
]


def _module_file_exists(module: str) -> bool:
    """Whether ``treadle.x.cli`` exists as a file, found without importing ``treadle.x`` (which imports torch)."""
    root = Path(__file__).resolve().parent
    rel = Path(*module.split(".")[1:])
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _areas() -> dict:
    """name -> (module, help) of the areas present in this install."""
    out = {}
    for entry in AREAS:
        name, module = entry[0], entry[1]
        if _module_file_exists(module):
            out[name] = (module, entry[2] if len(entry) > 2 else f"`treadle {name} ...` commands.")
    return out


class _AreaStub(TyperGroup):
    """An area's sub-command as listed by ``treadle --help``: a name and a help line, no import. When the
    sub-command runs, :meth:`make_context` imports the area's typer app and hands over to it."""

    def __init__(self, name: str, module: str, help: str):
        super().__init__(name=name, help=help, short_help=help)
        self.module = module

    def load(self) -> click.Command:
        cmd = typer.main.get_command(importlib.import_module(self.module).app)
        cmd.name = self.name
        return cmd

    def make_context(self, info_name, args, parent=None, **extra):
        return self.load().make_context(info_name, args, parent=parent, **extra)


#: treadle.dispatch.BACKENDS, repeated here so that the root command checks $TREADLE_BACKEND without importing
#: torch (tests/cli/test_root.py keeps the two equal)
_BACKEND_NAMES = ("reference", "cpp", "cuda", "triton")


#: what pydantic puts before a validator's message (typer checks Literal/Enum choices through pydantic):
#: "Invalid value for '--category': Value error, 'x' is not one of ..." reads as "... '--category': 'x' ..."
_PYDANTIC_PREFIX = re.compile(r"(?<=: )(?:Value error|Assertion failed), ")


def _plain_message(err: click.exceptions.ClickException) -> str:
    """A usage error's message on one line, without pydantic's "Value error, " prefix; a bad choice says
    which values the flag takes: "Invalid value for '--category': 'x' is not one of 'base', 'miss_func'."."""
    return _PYDANTIC_PREFIX.sub("", " ".join(err.format_message().split()))


class _RootGroup(TyperGroup):
    """The root ``treadle`` group: its own commands plus one lazily imported sub-app per area."""

    def list_commands(self, ctx) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in _areas() if n not in self.commands)]

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """As click's, but a usage error (bad option value, unknown command...) prints ONE line on stderr,
        ``Error: <what was wrong, naming the flag>``, and exits 2."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        env_backend = os.environ.get("TREADLE_BACKEND")
        argv = sys.argv[1:] if args is None else list(args)
        helping = not argv or any(a in ("--help", "--version") for a in argv)
        if env_backend and env_backend not in _BACKEND_NAMES and not helping:  # before any command runs
            click.echo(f"Error: $TREADLE_BACKEND: unknown backend {env_backend!r}; expected one of "
                       f"{', '.join(_BACKEND_NAMES)}, or unset it for the dispatch rule", err=True)
            sys.exit(2)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:
            err.show()
            sys.exit(err.exit_code)
        except click.exceptions.ClickException as err:
            message = _plain_message(err)
            if isinstance(err, click.exceptions.UsageError) and "No such command" in message:
                message += " See 'treadle --help'."
            click.echo(f"Error: {message}", err=True)
            sys.exit(err.exit_code)
        except Exception as err:
            # a backend forced by $TREADLE_BACKEND (or backend=) that cannot run some op here: one line (the
            # error class is looked up only once raised: dispatch imports torch, the root command does not)
            run_dirs = sys.modules.get("treadle.run_dirs")
            if run_dirs is not None and isinstance(err, run_dirs.StoredFileError):  # a damaged run file: one line
                click.echo(f"Error: {' '.join(str(err).split())}", err=True)
                sys.exit(2)
            dispatch = sys.modules.get("treadle.dispatch")
            if dispatch is None or not isinstance(err, dispatch.BackendUnavailableError):
                raise
            hint = (f" ($TREADLE_BACKEND={os.environ['TREADLE_BACKEND']}: unset it, or pick a backend that runs "
                    f"every op on this device)" if os.environ.get("TREADLE_BACKEND") else "")
            click.echo(f"Error: {' '.join(str(err).split())}{hint}", err=True)
            sys.exit(2)
        except typer.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def get_command(self, ctx, cmd_name: str):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is None and cmd_name in _areas():
            module, text = _areas()[cmd_name]
            cmd = _AreaStub(cmd_name, module, text)
        return cmd


app = typer.Typer(cls=_RootGroup,
                  help="treadle: fused kernels and training-side machinery for LLM post-training.",
                  no_args_is_help=True, add_completion=False)
console = make_console()


def _version_callback(value: bool) -> None:
    if value:
        from treadle import __version__

        console.print(f"treadle {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    quiet_third_party()


@app.command()
def backends(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Which backend each op uses for CPU and CUDA tensors here, and why."""
    import treadle

    from rich.table import Table

    table = treadle.backends()
    if as_json:
        console.print_json(json.dumps(table))
        return
    t = Table(title="treadle backends")
    for col in ("op", "CPU tensor", "why", "CUDA tensor", "why"):
        t.add_column(col)
    for op, devs in table.items():
        t.add_row(op, devs["cpu"]["backend"], devs["cpu"]["reason"], devs["cuda"]["backend"], devs["cuda"]["reason"])
    console.print(t)


@app.command()
def demo(
    sections: str = typer.Option("all", help="Comma-separated demo sections, or 'all'."),
    out: Path = typer.Option(None, "--out", help="Run folder (one sub-folder per section: JSONL, PNG, config); "
                                                 "default runs/demo (--quick: runs/demo-quick, so a quick run never "
                                                 "replaces the full one). A finished run of the same settings there "
                                                 "is kept, other settings are refused; --overwrite replaces it."),
    run_dir: Path = typer.Option(None, "--run-dir", hidden=True, help="Old name of --out."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out."),
    quick: bool = typer.Option(False, help="Smallest settings (smoke test)."),
) -> None:
    """Run the main job on the embedded defaults: every section, each a thin use of public APIs."""
    from treadle.cli_runs import open_run, pick_out, recorded
    from treadle.demo import check_env_model, resolve_sections, run_demo

    out = pick_out(out, run_dir, "runs/demo-quick" if quick else "runs/demo")
    try:
        chosen = resolve_sections(sections)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--sections") from None
    bad_model = check_env_model(chosen, quick=quick)  # before any section runs or anything is written
    if bad_model is not None:
        raise bad_model
    run = open_run(out, command="demo", config={"sections": chosen, "quick": quick}, overwrite=overwrite)
    if run.finished:
        console.print(f"{out} already holds this finished demo run (sections {', '.join(chosen)}, "
                      f"{'quick' if quick else 'full'} settings; finished {run.previous.get('ended')}); its results "
                      f"are unchanged. Add --overwrite to run it again.", markup=False)
        return
    with recorded(run, console, saved=lambda: "the sections finished so far (one sub-folder each)"):
        run_demo(sections, out, quick=quick, console=console)


@app.command()
def bench(
    ops: str = typer.Option("", help="Comma-separated ops (grpo, stair, scale...); default: all suites."),
    save: str = typer.Option("", help="Save a pytest-benchmark baseline under this name (a full run saves 'full')."),
    out: Path = typer.Option(None, help="Report folder (default: bench/results/report-<date>)."),
    report: bool = typer.Option(True, help="Write report.md, report.json and ratios.png."),
    compare: bool = typer.Option(True, help="Print pytest-benchmark's comparison with the last saved baseline."),
    extra: list[str] = typer.Argument(None, help="Extra arguments passed to pytest."),
) -> None:
    """Run the benchmark suites in bench/ (peers side by side in one run) and write a report."""
    from treadle.bench_report import BenchNotRunError, run
    from treadle.cli_runs import usage_exit

    names = [o.strip() for o in ops.split(",") if o.strip()]
    if ops.strip() and not names:  # "--ops ," named no suite: never read as "all suites" (minutes of work)
        usage_exit(f"--ops: no suite named in {ops!r}; give names like grpo,stair or leave --ops out for all")
    if out is not None:
        from treadle.run_dirs import check_out_dir

        try:
            check_out_dir(out, "--out")
        except ValueError as err:
            usage_exit(str(err))
    try:
        rc = run(names, out=out, save=save, compare=compare,
                 report=report, extra=list(extra or []))
    except (FileNotFoundError, ValueError) as err:
        usage_exit(str(err))
    except BenchNotRunError as err:
        if err.rc in (4, 5):  # pytest refused its arguments or they selected nothing: the user's input
            usage_exit(f"EXTRA (the pytest arguments {' '.join(extra or []) or '(none)'}): {err}")
        typer.echo(f"Error: {err}", err=True)
        raise typer.Exit(err.rc) from None
    raise typer.Exit(rc)


def _sigterm_as_interrupt() -> None:
    """Make SIGTERM (``kill PID``, ``timeout``, a batch scheduler, torchrun stopping its ranks) act as Ctrl-C:
    it raises KeyboardInterrupt in the main thread, so every command's interrupt path runs (run.json
    "interrupted", what was saved and how to resume, child processes such as ``transformers serve``
    stopped). A second SIGTERM ends the process at once. A SIGTERM that the parent set to be ignored, or a
    handler someone else installed, is left as it is."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return

    def _handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next SIGTERM is not caught: stop waiting for cleanup
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _handler)


def main() -> None:
    _sigterm_as_interrupt()
    app()


if __name__ == "__main__":
    main()
