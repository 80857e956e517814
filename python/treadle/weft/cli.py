"""``treadle weft ...``: inspect server modules and run the shop environment's tasks."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import typer

from treadle.cli_output import make_console
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, pick_out, recorded, usage_error

app = typer.Typer(help="WEFT runtime: stateful MCP tool environments, sessions, verification.",
                  no_args_is_help=True, add_completion=False)
console = make_console()

from treadle.weft.rollouts.cli import sample_cmd  # noqa: E402  (typer + rich only; the work imports lazily)

app.command("sample")(sample_cmd)

from treadle.weft.evolve.cli import evolve_cmd, filter_cmd, judge_cmd, reverify_cmd, synth_cmd  # noqa: E402

app.command("reverify")(reverify_cmd)
app.command("synth")(synth_cmd)
app.command("evolve")(evolve_cmd)
app.command("filter")(filter_cmd)
app.command("judge")(judge_cmd)

from treadle.weft.rl.cli import groups_cmd, train_cmd  # noqa: E402  (typer only; the work imports lazily)

app.command("groups")(groups_cmd)
app.command("train")(train_cmd)


@app.command("check")
def check_cmd(path: Path = typer.Argument(..., help="A server module (.py) defining `server = WeftServer(...)`."),
              as_json: bool = typer.Option(False, "--json", help="Print the spec as JSON."),
              do_import: bool = typer.Option(False, "--import", help="Also import the module (this RUNS its "
                                             "code) for the content hash and the tools' JSON schemas.")) -> None:
    """Check a server module WITHOUT running it: name, backend, tools, isolation level (static side-effect
    check). With --import the module is imported (its code runs) and registered: content hash, schemas."""

    from treadle.weft.runtime.errors import ServerImportError
    from treadle.weft.runtime.static_check import read_server

    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise usage_error(f"PATH {str(path)!r}: cannot read it: {err}") from None
    try:
        static = read_server(source, str(path))
    except ServerImportError as err:
        raise usage_error(f"PATH {str(path)!r}: {err}") from None
    if not do_import:
        if as_json:
            console.print_json(static.model_dump_json())
            return
        console.print(f"server [bold]{static.name}[/bold] ({static.backend}); static check: the file was not run "
                      f"(--import runs it for the content hash and the tools' schemas)")
        console.print(f"isolation: [bold]{static.isolation}[/bold]")
        for f in static.report.findings:
            console.print(f"  line {f.line}: {f.kind}: {f.detail}")
        console.print(_tools_table("tools (as written; ? = not a literal)",
                                   [(tool.name, tool.reads, tool.writes, tool.returns, tool.arguments)
                                    for tool in static.tools]))
        return

    from treadle.weft.runtime.registry import Registry

    reg = Registry()
    try:
        h = reg.register(path)
    except ServerImportError as err:
        raise usage_error(f"PATH {str(path)!r}: {err}") from None
    spec = reg.spec(h)
    if as_json:
        console.print_json(spec.model_dump_json(exclude={"source"}))
        return
    console.print(f"server [bold]{spec.name}[/bold] ({spec.backend}) hash {h} (imported: its code ran)")
    console.print(f"isolation: [bold]{spec.isolation}[/bold]")
    for f in spec.report.findings:
        console.print(f"  line {f.line}: {f.kind}: {f.detail}")
    console.print(_tools_table("tools", [(tool["name"], tool["contract"]["reads"], tool["contract"]["writes"],
                                          tool["contract"]["returns"], tool["input_schema"].get("properties", {}))
                                         for tool in spec.tools]))


def _tools_table(title: str, rows):
    """``weft check``'s table (a rich ``Table``): one row per ``(tool, reads, writes, returns, arguments)``."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("tool", "reads", "writes", "returns", "arguments"):
        t.add_column(col)
    for name, reads, writes, returns, args in rows:
        t.add_row(name, ",".join(reads), ",".join(writes), returns, ",".join(args))
    return t


_OUT_ALIAS = typer.Option(None, "--run-dir", hidden=True, help="Old name of --out.")
_OVERWRITE = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out (deleting it).")


def _check_skip(skip_task: str, skip_turn: int | None) -> tuple[str, int] | None:
    """``--skip-task`` / ``--skip-turn`` as ``(task, turn)``; an unknown task, a turn out of range, a turn
    without gold calls, or one option without the other is a usage error (nothing is ignored)."""
    from treadle.weft.envs import shop_tasks

    if not skip_task and skip_turn is None:
        return None
    if not skip_task:
        raise typer.BadParameter("--skip-turn needs --skip-task (the task whose turn loses its first gold call)",
                                 param_hint="--skip-turn")
    tasks = {t.name: t for t in shop_tasks.tasks()}
    if skip_task not in tasks:
        raise typer.BadParameter(f"no shop task {skip_task!r}; tasks: {', '.join(sorted(tasks))}",
                                 param_hint="--skip-task")
    if skip_turn is None:
        raise typer.BadParameter(f"--skip-task needs --skip-turn (a turn of {skip_task!r}: 0..."
                                 f"{len(tasks[skip_task].turns) - 1})", param_hint="--skip-task")
    n = len(tasks[skip_task].turns)
    if not 0 <= skip_turn < n:
        raise typer.BadParameter(f"task {skip_task!r} has turns 0...{n - 1}, got {skip_turn}", param_hint="--skip-turn")
    if not list(tasks[skip_task].turns[skip_turn].gold):
        raise typer.BadParameter(f"turn {skip_turn} of {skip_task!r} has no gold call to skip",
                                 param_hint="--skip-turn")
    return skip_task, skip_turn


@app.command("shop")
def shop_cmd(out: Path = typer.Option(None, "--out", help="Run folder of the JSONL results (default runs/weft-shop)."
                                                          + OUT_HELP_SUFFIX),
             run_dir: Path = _OUT_ALIAS,
             overwrite: bool = _OVERWRITE,
             skip_task: str = typer.Option("", help="Task whose turn --skip-turn drops its first gold call."),
             skip_turn: int = typer.Option(None, min=0, help="Turn index (from 0) for --skip-task.")) -> None:
    """Replay the shop tasks' gold calls through the runtime and verify every checkpoint."""
    from treadle.weft.demo import run_shop_tasks

    out = pick_out(out, run_dir, "runs/weft-shop")
    skip = _check_skip(skip_task, skip_turn)
    run = open_run(out, command="weft shop", config={"skip": list(skip) if skip else None}, overwrite=overwrite)
    with recorded(run, console, saved=lambda: "nothing (results are written at the end)"):
        rows = run_shop_tasks(out, skip=skip, console=console)
    console.print(f"{sum(r['r'] for r in rows)}/{len(rows)} checkpoints pass; results in {out}", markup=False)


@app.command("bfcl")
def bfcl_cmd(category: Literal["base", "miss_func", "miss_param", "long_context"] = typer.Option(
                 "base", help="BFCL v4 multi-turn category."),
             limit: int = typer.Option(0, min=0, help="Entries to replay (0: all scored entries)."),
             out: Path = typer.Option(None, "--out", help="Run folder of the JSONL verdicts (default "
                                                          "runs/weft-bfcl/<category>)." + OUT_HELP_SUFFIX),
             run_dir: Path = _OUT_ALIAS,
             overwrite: bool = _OVERWRITE) -> None:
    """Replay BFCL v4 multi-turn gold answers through the runtime and verify every turn (needs bfcl-eval)."""
    import json

    import anyio
    from rich.progress import track

    out = pick_out(out, run_dir, f"runs/weft-bfcl/{category}")
    try:
        from treadle.weft.envs import bfcl

        entries, gold = bfcl.load_entries(category)
    except ModuleNotFoundError:
        raise usage_error("bfcl-eval is not installed: pip install --no-deps bfcl-eval") from None
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--category") from None
    from treadle.weft.runtime import Runtime

    scored = [e for e in entries if e["id"] not in bfcl.KNOWN_BAD_GOLD]
    scored = scored[:limit] if limit > 0 else scored
    run = open_run(out, command="weft bfcl", config={"category": category, "limit": limit}, overwrite=overwrite)

    async def main() -> list[dict]:
        rows = []
        async with Runtime(timeout_s=30) as rt:
            for e in track(scored, description=f"BFCL {category}", console=console):
                g = gold[e["id"]]
                res = await bfcl.run_entry(rt, e, g, lambda k, g=g: g[k], category=category)
                rows.append({"id": res.id, "R": res.reward, "r": [r.r for r in res.results],
                             "reasons": [[x.value for x in r.reasons] for r in res.results]})
        return rows

    with recorded(run, console, saved=lambda: "nothing (verdicts are written at the end)"):
        rows = anyio.run(main)
        target = out / f"{category}.jsonl"
        target.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    passed = sum(r["R"] == 1.0 for r in rows)
    console.print(f"{category}: {passed}/{len(rows)} scored entries pass every turn "
                  f"({len(entries) - len([e for e in entries if e['id'] not in bfcl.KNOWN_BAD_GOLD])} excluded as "
                  f"known-bad gold); verdicts in {target}", markup=False)
