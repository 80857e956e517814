"""Bad cache / ledger / config paths and values: a named one-line error (exit 2) before any call, and the
user's files left untouched."""
import pytest

from treadle.llm import CacheError, ConfigError, LedgerError, LLMClient, LLMConfig, read_ledger
from treadle.llm.cache import Cache
from treadle.llm.ledger import Ledger

from treadle.testing import assert_usage_error

from .test_cli import invoke

DEAD = "http://127.0.0.1:9/v1"  # nothing listens on port 9 (discard); never reached by these tests


def test_cache_path_kinds(tmp_path):
    with pytest.raises(CacheError, match="is a folder"):
        Cache(tmp_path)
    junk = tmp_path / "c.sqlite"
    junk.write_bytes(b"not a database at all")
    with pytest.raises(CacheError, match="not a SQLite database"):
        Cache(junk)
    assert junk.read_bytes() == b"not a database at all"  # left untouched
    (tmp_path / "f").write_text("x")
    with pytest.raises(CacheError, match="cannot create its folder"):
        Cache(tmp_path / "f" / "c.sqlite")
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    assert len(Cache(empty)) == 0  # an empty file is a new database


def test_ledger_path_kinds(tmp_path):
    with pytest.raises(LedgerError, match="is a folder"):
        Ledger(tmp_path)
    with pytest.raises(LedgerError, match="is a folder"):
        read_ledger(tmp_path)
    bad = tmp_path / "l.jsonl"
    bad.write_text('{bad\n{"also": "bad"}\n')
    with pytest.raises(LedgerError, match=r"l\.jsonl:1: not a ledger record"):
        read_ledger(bad)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(LedgerError, match="not UTF-8"):
        read_ledger(bad)


def test_client_bad_ledger_makes_no_cache(tmp_path):
    with pytest.raises(LedgerError):
        LLMClient(LLMConfig.single("m", DEAD), cache=tmp_path / "c.sqlite", ledger=tmp_path)
    assert not (tmp_path / "c.sqlite").exists()


def test_config_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="base_url must start with http"):
        LLMConfig.single("m", "notaurl")
    with pytest.raises(ConfigError, match=r"roles\.default\.temperature: unknown field \(got -1\)"):
        LLMConfig.single("m", DEAD).with_overrides(["default.temperature=-1"])
    with pytest.raises(ConfigError, match=r"roles\.default\.sampling\.temperature: .*greater than or equal to 0"):
        LLMConfig.single("m", DEAD).with_overrides(["default.sampling.temperature=-1"])
    b = tmp_path / "m.toml"
    b.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="cannot read"):
        LLMConfig.load(b)


def test_cli_bad_paths_and_values(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    assert_usage_error(invoke("ask", "hi", "--model", "m", "--base-url", "notaurl"), "--base-url:")
    assert_usage_error(invoke("ask", "hi", "--model", "m", "--base-url", DEAD, "--cache", d), "--cache:")
    assert_usage_error(invoke("ask", "hi", "--model", "m", "--base-url", DEAD, "--ledger", d), "--ledger:")
    junk = tmp_path / "c.sqlite"
    junk.write_text("garbage")
    assert_usage_error(invoke("ask", "hi", "--model", "m", "--base-url", DEAD, "--cache", junk), "--cache:")
    assert junk.read_text() == "garbage"
    assert_usage_error(invoke("ask", "hi", "--model", "m", "--set", "default.sampling.max_tokens=abc"), "--set:")
    e = tmp_path / "e.json"
    e.write_text("{}")
    r = invoke("probe", "--config", e)
    assert_usage_error(r, "--config:")
    assert "roles: Field required" in r.output
    led = tmp_path / "l.jsonl"
    led.write_text("{bad\n")
    r = invoke("ledger", led)
    assert_usage_error(r, "PATH:")
    assert "l.jsonl:1" in r.output
