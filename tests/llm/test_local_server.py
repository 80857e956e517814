"""The real client against a real local `transformers serve` over HTTP on 127.0.0.1 (one server per session)."""
import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from treadle.llm import ChatResult, EndpointError, FailureKind, LLMCallError, LLMClient, LLMConfig, local_server
from treadle.llm.server import free_port

MSG = [{"role": "user", "content": "12+30="}]


def run(coro):
    return asyncio.run(coro)


def _cfg(srv, **kw):
    kw.setdefault("sampling", {"max_tokens": 6, "temperature": 0.0})
    return LLMConfig.single(srv.model, srv.base_url, roles=("policy", "judge"), timeout_s=120, **kw)


def test_chat_completion_and_cache_against_real_server(tiny_server, tmp_path):
    srv, tok = tiny_server

    async def go():
        async with LLMClient(_cfg(srv), cache=tmp_path / "c.sqlite", ledger=tmp_path / "l.jsonl") as llm:
            await llm.probe("policy")
            a = await llm.chat(MSG, role="policy", tag="t")
            b = await llm.chat(MSG, role="policy", tag="t")
            c = await llm.complete("12+30=", role="judge", tag="c")
            return a, b, c, llm.ledger.totals()

    a, b, c, t = run(go())
    assert isinstance(a, ChatResult) and not a.cached and b.cached and b.text == a.text
    assert a.finish_reason in ("length", "stop") and a.text != ""
    assert 1 <= a.usage.completion_tokens <= 6
    ids = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert a.usage.prompt_tokens == len(ids)  # the server used the checkpoint's ChatML template
    assert c.kind == "completion" and c.usage.prompt_tokens == len("12+30=") and c.finish_reason in ("length", "stop")
    assert t["all"].calls == 3 and t["all"].cache_hits == 1
    assert t["role"]["policy"].tokens_in == a.usage.prompt_tokens


def test_max_tokens_cut_is_visible(tiny_server):
    srv, _ = tiny_server

    async def go():
        async with LLMClient(_cfg(srv, sampling={"max_tokens": 3, "temperature": 0.0})) as llm:
            return await llm.chat([{"role": "user", "content": "tell me a long story"}], role="policy")

    r = run(go())
    if r.finish_reason == "length":
        assert r.usage.completion_tokens == 3
    else:  # the untrained model may emit <|im_end|> early; then it must say stop
        assert r.finish_reason == "stop" and r.usage.completion_tokens <= 3


def test_concurrent_batch_and_samples(tiny_server, tmp_path):
    srv, _ = tiny_server

    async def go():
        cfg = _cfg(srv, sampling={"max_tokens": 4, "temperature": 1.0, "seed": 5}, max_concurrency=4)
        async with LLMClient(cfg, cache=tmp_path / "c.sqlite") as llm:
            singles = [llm.chat([{"role": "user", "content": f"{i}+1="}], role="policy") for i in range(4)]
            return await llm.gather(singles + [llm.sample(MSG, 3, role="policy")])

    *singles, group = run(go())
    assert all(isinstance(r, ChatResult) and r.finish_reason in ("length", "stop") for r in singles + group)
    assert len({r.key for r in group}) == 3 and [r.sample_index for r in group] == [0, 1, 2]


def test_wrong_model_name_is_a_clear_error_before_the_batch(tiny_server):
    srv, _ = tiny_server
    cfg = LLMConfig.single("Qwen/Qwen3-8B", srv.base_url)

    async def go():
        async with LLMClient(cfg) as llm:
            with pytest.raises(EndpointError, match=r"'Qwen/Qwen3-8B' is not served at .*tiny-llm"):
                await llm.gather([llm.chat(MSG)], probe=["default"])
            with pytest.raises(LLMCallError) as ei:  # without the probe: a 4xx, not retried
                await llm.chat(MSG)
            return ei.value.failure

    f = run(go())
    assert f.kind == FailureKind.bad_request and f.attempts == 1 and "pinned" in f.message


def test_local_server_bad_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model checkpoint"):
        with local_server(tmp_path / "missing"):
            pass


def test_cli_serve_bad_flags(tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    r = CliRunner().invoke(app, ["llm", "serve", "--model", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "--model" in r.output and len(r.output.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(app, ["llm", "serve", "--model", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "--model" in r.output


@pytest.mark.slow
def test_cli_serve_prints_url_and_stops_on_ctrl_c(tmp_path):
    from .conftest import default_sigint, save_tiny_checkpoint

    path, _ = save_tiny_checkpoint(tmp_path / "ckpt")
    port = free_port()
    exe = [sys.executable, "-c", "from treadle.cli import main; main()"]
    proc = subprocess.Popen([*exe, "llm", "serve", "--model", str(path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "400"}, preexec_fn=default_sigint)
    try:
        line = ""
        deadline = time.monotonic() + 300
        while "base URL" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "serve exited early"
        assert line.split()[-1] == f"http://127.0.0.1:{port}/v1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.slow
def test_server_that_cannot_start_is_a_clear_error(tiny_server):
    import socket

    from treadle.llm import ServerStartError

    srv, _ = tiny_server
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match="exited with code") as ei:
            with local_server(srv.model, port=port, startup_timeout_s=300):
                pass
    assert "log " in str(ei.value)


def test_resolve_model_path(tmp_path, monkeypatch, tiny_server):
    from treadle.llm.server import resolve_model_path

    srv, _ = tiny_server
    monkeypatch.setenv("TREADLE_MODEL", srv.model)
    assert str(resolve_model_path(None)) == srv.model
    assert str(resolve_model_path(srv.model)) == srv.model
    monkeypatch.setenv("TREADLE_MODEL", str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="gone"):
        resolve_model_path(None)
