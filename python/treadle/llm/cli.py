"""``treadle llm ...``: the local endpoint and the call ledger."""
from __future__ import annotations

import time
from pathlib import Path

import typer
from treadle.cli_output import make_console
from treadle.cli_runs import usage_exit
from rich.table import Table

app = typer.Typer(help="Model endpoints: a local OpenAI-compatible server, probes, one-off calls, the call ledger.",
                  no_args_is_help=True, add_completion=False)
console = make_console()


@app.command("serve")
def serve_cmd(
    model: Path = typer.Option(None, "--model", help="Local HF checkpoint folder (default: the embedded tiny model)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port on 127.0.0.1."),
    device: str = typer.Option("cpu", "--device", help="Torch device of the server (cpu, cuda:0, auto)."),
    startup_timeout: float = typer.Option(180.0, "--startup-timeout", min=1, help="Seconds to wait for /health."),
    continuous_batching: bool = typer.Option(False, "--continuous-batching",
                                             help="Decode concurrent requests together (paged attention)."),
) -> None:
    """Start `transformers serve` on 127.0.0.1 over a local checkpoint; print the base URL; Ctrl-C stops it."""
    from treadle.llm.server import ServerStartError, free_port, local_server
    from treadle.models.tiny import CheckpointError

    if model is not None and not model.exists():
        usage_exit(f"--model: no checkpoint folder at {model}")
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            usage_exit(f"--port: 127.0.0.1:{port} is already in use (free now: --port {free_port()})")
    try:
        with local_server(model, port=port, device=device, startup_timeout_s=startup_timeout,
                          continuous_batching=continuous_batching) as srv:
            try:  # from here on an interrupt (also one right after the URL is printed) is a normal stop: exit 0
                console.print(f"base URL: {srv.base_url}", markup=False)
                console.print(f"model:    {srv.model}", markup=False)
                console.print("Ctrl-C to stop", style="dim")
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                console.print("stopping", style="dim")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the server was starting: local_server stopped it
        from treadle.cli_runs import resume_hint

        console.print(f"Interrupted while the server was starting; it was stopped. Saved: nothing (serving keeps no "
                      f"state); rerun {resume_hint()} to start it again.", markup=False)
        raise typer.Exit(130) from None
    except (CheckpointError, FileNotFoundError) as err:
        usage_exit(f"--model: {err}")
    except ServerStartError as err:
        typer.echo(" ".join(str(err).split()), err=True)  # a failure, not bad input: one line on stderr, exit 1
        raise typer.Exit(1)


@app.command("ledger")
def ledger_cmd(path: Path = typer.Argument(..., help="A ledger JSONL file written by LLMClient(ledger=...)."),
               by: str = typer.Option("role", "--by", help="Group by: role, tag or role_tag.")) -> None:
    """Totals of a call ledger (calls, cache hits, failures, tokens, cost) per role, tag or both."""
    from treadle.llm.ledger import read_ledger, totals

    if by not in ("role", "tag", "role_tag"):
        usage_exit(f"--by must be role, tag or role_tag, got {by!r}")
    if not path.is_file():
        usage_exit(f"PATH: no ledger file at {path}")
    from treadle.llm.ledger import LedgerError

    try:
        t = totals(read_ledger(path))
    except LedgerError as err:
        usage_exit(f"PATH: {err}")
    table = Table(title=f"{path} by {by}")
    for col in (by, "calls", "cache hits", "failures", "tokens in", "tokens out", "cost USD"):
        table.add_column(col, justify="right" if col != by else "left")
    for name, s in [*t[by].items(), ("all", t["all"])]:
        table.add_row(name, str(s.calls), str(s.cache_hits), str(s.failures), str(s.tokens_in), str(s.tokens_out),
                      f"{s.cost_usd:.6f}")
    console.print(table)


def _config(config: Path | None, model: str | None, base_url: str | None, overrides: list[str] | None):
    from treadle.llm.config import ConfigError, LLMConfig

    try:
        if config is not None:
            cfg = LLMConfig.load(config)
        elif model is not None:
            cfg = LLMConfig.single(model, base_url or "http://127.0.0.1:8000/v1")
        else:
            usage_exit("--config: give a model config file, or --model (and --base-url)")
        return cfg.with_overrides(overrides or [])
    except ConfigError as err:
        msg = str(err)
        flag = ("--set" if msg.startswith("override") else "--config" if config is not None
                else "--base-url" if "base_url" in msg else "--model")
        usage_exit(f"{flag}: " + "; ".join(ln.strip() for ln in str(err).splitlines() if ln.strip()))


_CONFIG = typer.Option(None, "--config",
                       help="Model config file (.toml, .yaml, .json) with a [roles.*] table per role.")
_MODEL = typer.Option(None, "--model", help="Without --config: the model name of a single 'default' role.")
_BASE_URL = typer.Option(None, "--base-url", help="Without --config: the endpoint (default http://127.0.0.1:8000/v1).")
_SET = typer.Option(None, "--set", help="Override a field: role.field=value (repeatable; '*.' for every role).")


@app.command("probe")
def probe_cmd(config: Path = _CONFIG, model: str = _MODEL, base_url: str = _BASE_URL, overrides: list[str] = _SET,
              role: list[str] = typer.Option(None, "--role", help="Roles to probe (default: all).")) -> None:
    """Check that each role's endpoint is reachable and serves its model (one cheap request each)."""
    import asyncio

    from treadle.llm.backends import EndpointError
    from treadle.llm.client import LLMClient
    from treadle.llm.config import ConfigError

    cfg = _config(config, model, base_url, overrides)
    roles = role or list(cfg.roles)
    unknown = [r for r in roles if r not in cfg.roles]
    if unknown:
        usage_exit(f"--role: unknown role(s) {unknown}; the config defines {sorted(cfg.roles)}")

    async def go():
        bad = 0
        async with LLMClient(cfg) as llm:
            for r in roles:
                rc = cfg.role(r)
                try:
                    await llm.probe(r)
                    console.print(f"ok    {r}: {rc.model} at {rc.base_url}", markup=False)
                except (EndpointError, ConfigError) as err:
                    bad += 1
                    console.print(f"FAIL  {r}: {err}", style="red", markup=False)
        return bad

    raise typer.Exit(1 if asyncio.run(go()) else 0)


@app.command("ask")
def ask_cmd(prompt: str = typer.Argument(..., help="User message."),
            config: Path = _CONFIG, model: str = _MODEL, base_url: str = _BASE_URL, overrides: list[str] = _SET,
            role: str = typer.Option("default", "--role", help="Role to use."),
            cache: Path = typer.Option(None, "--cache", help="SQLite cache file (default: no cache)."),
            ledger: Path = typer.Option(None, "--ledger", help="Append a ledger line to this JSONL file."),
            as_json: bool = typer.Option(False, "--json", help="Print the whole ChatResult as JSON.")) -> None:
    """One chat call through the client (smoke test of an endpoint and a config)."""
    import asyncio

    from treadle.llm.client import LLMClient
    from treadle.llm.records import LLMCallError

    cfg = _config(config, model, base_url, overrides)
    if role not in cfg.roles:
        usage_exit(f"--role: unknown role {role!r}; the config defines {sorted(cfg.roles)}")

    async def go():
        async with LLMClient(cfg, cache=cache, ledger=ledger) as llm:
            return await llm.chat([{"role": "user", "content": prompt}], role=role, tag="cli")

    from treadle.llm.cache import CacheError
    from treadle.llm.ledger import LedgerError

    try:
        r = asyncio.run(go())
    except (CacheError, LedgerError) as err:  # raised by LLMClient(...) before any call
        flag = "--cache" if isinstance(err, CacheError) else "--ledger"
        usage_exit(f"{flag}: {err}")
    except LLMCallError as err:
        typer.echo(" ".join(str(err).split()), err=True)  # a failure, not bad input: one line on stderr, exit 1
        raise typer.Exit(1) from None
    if as_json:
        print(r.model_dump_json(indent=1))
    else:
        print(r.text)
        console.print(f"[finish_reason={r.finish_reason} tokens in/out={r.usage.prompt_tokens}/"
                      f"{r.usage.completion_tokens} cached={r.cached}]", style="dim", markup=False)
