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


@app.command("bfcl")
def bfcl_cmd(category: str = typer.Option("base", help="base | miss_func | miss_param | long_context."),
             limit: int = typer.Option(0, help="Entries to replay (0: all scored entries)."),
             run_dir: Path = typer.Option(Path("runs/weft-bfcl"), help="Where the JSONL verdicts go.")) -> None:
    """Replay BFCL v4 multi-turn gold answers through the runtime and verify every turn (needs bfcl-eval)."""
    import json

    import anyio
    from rich.progress import track

    try:
        from treadle.weft.envs import bfcl

        entries, gold = bfcl.load_entries(category)
    except ModuleNotFoundError:
        console.print("[red]bfcl-eval is not installed: pip install --no-deps bfcl-eval[/red]")
        raise typer.Exit(2)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    from treadle.weft.runtime import Runtime

    scored = [e for e in entries if e["id"] not in bfcl.KNOWN_BAD_GOLD]
    scored = scored[:limit] if limit > 0 else scored

    async def main() -> list[dict]:
        rows = []
        async with Runtime(timeout_s=30) as rt:
            for e in track(scored, description=f"BFCL {category}", console=console):
                g = gold[e["id"]]
                res = await bfcl.run_entry(rt, e, g, lambda k, g=g: g[k], category=category)
                rows.append({"id": res.id, "R": res.reward, "r": [r.r for r in res.results],
                             "reasons": [[x.value for x in r.reasons] for r in res.results]})
        return rows

    rows = anyio.run(main)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"{category}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    passed = sum(r["R"] == 1.0 for r in rows)
    console.print(f"{category}: {passed}/{len(rows)} scored entries pass every turn "
                  f"({len(entries) - len([e for e in entries if e['id'] not in bfcl.KNOWN_BAD_GOLD])} excluded as "
                  f"known-bad gold); verdicts in {out}")
