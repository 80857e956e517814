"""`treadle llm probe | ask | ledger | serve` flag errors and runs against a real local endpoint."""
import json
import socket

from typer.testing import CliRunner

from treadle.cli import app
from treadle.testing import assert_usage_error

from .conftest import FAKE_MODEL


def invoke(*args):
    return CliRunner().invoke(app, ["llm", *map(str, args)])


def test_probe_and_ask(fake, tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[roles.policy]\nmodel = "{FAKE_MODEL}"\nbase_url = "{fake.base_url}"\n'
                   f'[roles.judge]\nmodel = "other"\nbase_url = "{fake.base_url}"\n')
    r = invoke("probe", "--config", cfg)
    assert r.exit_code == 1 and "ok    policy" in r.output and "FAIL  judge" in r.output and "'other'" in r.output
    assert invoke("probe", "--config", cfg, "--role", "policy").exit_code == 0
    r = invoke("ask", "2+2=", "--config", cfg, "--role", "policy", "--set", "policy.sampling.seed=9",
               "--ledger", tmp_path / "l.jsonl", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["text"] == "echo:2+2=|seed=9|T=None" and out["finish_reason"] == "stop"
    r = invoke("ledger", tmp_path / "l.jsonl", "--by", "tag")
    assert r.exit_code == 0 and "cli" in r.output
    r = invoke("ask", "hi", "--model", FAKE_MODEL, "--base-url", fake.base_url)
    assert r.exit_code == 0 and r.output.startswith("echo:hi")


def test_flag_errors(tmp_path, fake):
    assert_usage_error(invoke("probe"), "--config")
    assert_usage_error(invoke("probe", "--config", tmp_path / "missing.toml"), "--config")
    bad = tmp_path / "bad.toml"
    bad.write_text("[roles.p]\nmodel = 'm'\nbase_url = 'localhost'\n")
    assert_usage_error(invoke("probe", "--config", bad), "--config")
    assert_usage_error(invoke("ask", "x", "--model", "m", "--set", "nonsense"), "--set")
    assert_usage_error(invoke("ask", "x", "--model", "m", "--role", "judge"), "--role")
    assert_usage_error(invoke("probe", "--model", "m", "--role", "judge"), "--role")
    assert_usage_error(invoke("ledger", tmp_path / "none.jsonl"), "PATH")
    (tmp_path / "l.jsonl").write_text("")
    assert_usage_error(invoke("ledger", tmp_path / "l.jsonl", "--by", "day"), "--by")


def test_serve_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_usage_error(invoke("serve", "--port", port), "--port")


def test_ask_failure_exit_1(fake):
    from .conftest import Step

    fake.script = [Step(400, {"error": {"message": "nope"}})]
    r = invoke("ask", "x", "--model", FAKE_MODEL, "--base-url", fake.base_url)
    assert r.exit_code == 1 and "bad_request" in r.output


def test_a_failed_call_is_one_unwrapped_line_on_stderr():
    """An endpoint that cannot be reached: exit 1 (a failure, not bad input), one line on stderr, not cut at
    80 columns and not on stdout (where a redirect would hide it)."""
    import subprocess
    import sys

    url = "http://127.0.0.1:9/v1/a/long/path/so/that/the/message/is/well/over/eighty/columns"  # nothing on 9
    res = subprocess.run([sys.executable, "-m", "treadle", "llm", "ask", "hi", "--model", "m", "--base-url", url],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and res.stdout == "", (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "Connection error" in lines[0], res.stderr
