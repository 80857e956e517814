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
    ("llm", "treadle.llm.cli"),
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
    save: str = typer.Option("", help="Save results under this name (pytest-benchmark --benchmark-save)."),
    extra: list[str] = typer.Argument(None, help="Extra arguments passed to pytest."),
) -> None:
    """Run the benchmark suites in bench/ (pytest-benchmark; peers side by side in one run)."""
    root = Path(__file__).resolve().parents[2] / "bench"
    if not root.is_dir():
        console.print(f"[red]bench/ not found next to the package ({root}); run from a source checkout[/red]")
        raise typer.Exit(2)
    files = [str(root / f"bench_{o.strip()}.py") for o in ops.split(",") if o.strip()] or [str(root)]
    missing = [f for f in files if not Path(f).exists()]
    if missing:
        raise typer.BadParameter(f"no such benchmark suite: {missing}; have {sorted(p.name for p in root.glob('bench_*.py'))}")
    cmd = [sys.executable, "-m", "pytest", *files, "--benchmark-enable", "-p", "no:cacheprovider", "-q",
           "--override-ini", "addopts=", "--override-ini", "testpaths=bench"]
    if save:
        cmd += ["--benchmark-save", save]
    cmd += list(extra or [])
    raise typer.Exit(subprocess.call(cmd))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
