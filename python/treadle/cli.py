"""The ``treadle`` command (typer). Each area adds its own sub-app in ``treadle/<area>/cli.py``.

    treadle --version | backends | demo | bench | <area> ...
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="treadle: fused kernels and training-side machinery for LLM post-training.",
                  no_args_is_help=True, add_completion=False)
console = Console()

# (sub-command, module holding a typer `app`); missing modules are skipped so areas land one by one.
AREAS = [
    ("grpo", "treadle.grpo.cli"),
    ("model", "treadle.models.cli"),
    ("stair", "treadle.stair.cli"),
    ("scale", "treadle.scale.cli"),
    ("weft", "treadle.weft.cli"),
    ("rsi", "treadle.rsi.cli"),
]
for _name, _module in AREAS:
    try:
        app.add_typer(importlib.import_module(_module).app, name=_name)
    except ModuleNotFoundError as _err:
        if _err.name is None or not _module.startswith(_err.name):
            raise


def _version_callback(value: bool) -> None:
    if value:
        from treadle import __version__

        console.print(f"treadle {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version_callback, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


@app.command()
def backends(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Which backend each op uses for CPU and CUDA tensors here, and why."""
    import treadle

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
    run_dir: Path = typer.Option(Path("runs/demo"), help="Where run folders (JSONL, PNG, config) go."),
    quick: bool = typer.Option(False, help="Smallest settings (smoke test)."),
) -> None:
    """Run the main job on the embedded defaults: every section, each a thin use of public APIs."""
    from treadle.demo import resolve_sections, run_demo

    try:
        resolve_sections(sections)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--sections") from None
    from treadle.run_dirs import check_out_dir

    try:
        check_out_dir(run_dir, "--run-dir")
    except ValueError as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2) from None
    run_demo(sections, run_dir, quick=quick, console=console)


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
    from treadle.bench_report import run

    try:
        rc = run([o.strip() for o in ops.split(",") if o.strip()], out=out, save=save, compare=compare,
                 report=report, extra=list(extra or []))
    except (FileNotFoundError, ValueError) as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(2) from None
    raise typer.Exit(rc)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
