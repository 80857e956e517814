"""``treadle weft ...``: inspect server modules and run the shop environment's tasks."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="WEFT runtime: stateful MCP tool environments, sessions, verification.",
                  no_args_is_help=True, add_completion=False)
console = Console()


@app.command("check")
def check_cmd(path: Path = typer.Argument(..., help="A server module (.py) defining `server = WeftServer(...)`."),
              as_json: bool = typer.Option(False, "--json", help="Print the spec as JSON.")) -> None:
    """Register a server module: content hash, isolation level (static side-effect check), tools."""
    from rich.table import Table

    from treadle.weft.errors import ServerImportError
    from treadle.weft.registry import Registry

    reg = Registry()
    try:
        h = reg.register(path)
    except ServerImportError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    spec = reg.spec(h)
    if as_json:
        console.print_json(spec.model_dump_json(exclude={"source"}))
        return
    console.print(f"server [bold]{spec.name}[/bold] ({spec.backend}) hash {h}")
    console.print(f"isolation: [bold]{spec.isolation}[/bold]")
    for f in spec.report.findings:
        console.print(f"  line {f.line}: {f.kind}: {f.detail}")
    t = Table(title="tools")
    for col in ("tool", "reads", "writes", "returns", "arguments"):
        t.add_column(col)
    for tool in spec.tools:
        c = tool["contract"]
        t.add_row(tool["name"], ",".join(c["reads"]), ",".join(c["writes"]), c["returns"],
                  ",".join(tool["input_schema"].get("properties", {})))
    console.print(t)


@app.command("shop")
def shop_cmd(run_dir: Path = typer.Option(Path("runs/weft-shop"), help="Where JSONL results go."),
             skip_task: str = typer.Option("", help="Task whose turn --skip-turn drops its first gold call."),
             skip_turn: int = typer.Option(-1, help="Turn index for --skip-task.")) -> None:
    """Replay the shop tasks' gold calls through the runtime and verify every checkpoint."""
    from treadle.weft.demo import run_shop_tasks

    skip = (skip_task, skip_turn) if skip_task and skip_turn >= 0 else None
    rows = run_shop_tasks(run_dir, skip=skip, console=console)
    console.print(f"{sum(r['r'] for r in rows)}/{len(rows)} checkpoints pass; results in {run_dir}")
