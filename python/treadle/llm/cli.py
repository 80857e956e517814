"""``treadle llm ...``: the local endpoint and the call ledger."""
from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Model endpoints: a local OpenAI-compatible server, the call ledger.",
                  no_args_is_help=True, add_completion=False)
console = Console()


@app.command("serve")
def serve_cmd(
    model: Path = typer.Option(None, "--model", help="Local HF checkpoint folder (default: the embedded tiny model)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port on 127.0.0.1."),
    device: str = typer.Option("cpu", "--device", help="Torch device of the server (cpu, cuda:0, auto)."),
    startup_timeout: float = typer.Option(180.0, "--startup-timeout", min=1, help="Seconds to wait for /health."),
) -> None:
    """Start `transformers serve` on 127.0.0.1 over a local checkpoint; print the base URL; Ctrl-C stops it."""
    from treadle.llm.server import ServerStartError, free_port, local_server
    from treadle.models.tiny import CheckpointError

    if model is not None and not model.exists():
        console.print(f"--model: no checkpoint folder at {model}", style="red", markup=False)
        raise typer.Exit(2)
    try:
        free_port_ok = True
        import socket

        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                free_port_ok = False
        if not free_port_ok:
            console.print(f"--port: 127.0.0.1:{port} is already in use (e.g. --port {free_port()})", style="red", markup=False)
            raise typer.Exit(2)
        with local_server(model, port=port, device=device, startup_timeout_s=startup_timeout) as srv:
            console.print(f"base URL: {srv.base_url}", markup=False)
            console.print(f"model:    {srv.model}", markup=False)
            console.print("Ctrl-C to stop", style="dim")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                console.print("stopping", style="dim")
    except (CheckpointError, FileNotFoundError) as err:
        console.print(f"--model: {err}", style="red", markup=False)
        raise typer.Exit(2)
    except ServerStartError as err:
        console.print(str(err), style="red", markup=False)
        raise typer.Exit(1)


@app.command("ledger")
def ledger_cmd(path: Path = typer.Argument(..., help="A ledger JSONL file written by LLMClient(ledger=...)."),
               by: str = typer.Option("role", "--by", help="Group by: role, tag or role_tag.")) -> None:
    """Totals of a call ledger (calls, cache hits, failures, tokens, cost) per role, tag or both."""
    from treadle.llm.ledger import read_ledger, totals

    if by not in ("role", "tag", "role_tag"):
        console.print(f"--by must be role, tag or role_tag, got {by!r}", style="red", markup=False)
        raise typer.Exit(2)
    if not path.is_file():
        console.print(f"PATH: no ledger file at {path}", style="red", markup=False)
        raise typer.Exit(2)
    t = totals(read_ledger(path))
    table = Table(title=f"{path} by {by}")
    for col in (by, "calls", "cache hits", "failures", "tokens in", "tokens out", "cost USD"):
        table.add_column(col, justify="right" if col != by else "left")
    for name, s in [*t[by].items(), ("all", t["all"])]:
        table.add_row(name, str(s.calls), str(s.cache_hits), str(s.failures), str(s.tokens_in), str(s.tokens_out),
                      f"{s.cost_usd:.6f}")
    console.print(table)
