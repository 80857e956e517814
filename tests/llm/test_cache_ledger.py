"""Cache keys, the SQLite cache shared by processes, and ledger totals whose sums equal the parts."""
import random
import sqlite3
import subprocess
import sys

import pytest

from treadle.llm import Cache, ChatResult, Ledger, LedgerRecord, read_ledger, request_key, totals

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "seed": 3}


def test_request_key_covers_what_changes_the_output():
    k = request_key(BASE, kind="chat", sample_index=0)
    assert k == request_key(dict(reversed(list(BASE.items()))), kind="chat", sample_index=0)  # canonical order
    variants = [({**BASE, "seed": 4}, "chat", 0), ({**BASE, "temperature": 0.0}, "chat", 0), (BASE, "chat", 1),
                (BASE, "completion", 0), ({**BASE, "messages": [{"role": "user", "content": "hi "}]}, "chat", 0),
                ({**BASE, "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat", 0),
                ({**BASE, "model": "m2"}, "chat", 0)]
    keys = {request_key(p, kind=kd, sample_index=i) for p, kd, i in variants}
    assert len(keys) == len(variants) and k not in keys


def _result(key: str, text: str = "t") -> ChatResult:
    return ChatResult(kind="chat", model="m", text=text, finish_reason="stop", key=key, latency_s=0.5)


def test_cache_roundtrip_is_json(tmp_path):
    c = Cache(tmp_path / "sub" / "c.sqlite")
    assert c.get("k") is None
    c.put(_result("k", "héllo"))
    got = c.get("k")
    assert got.text == "héllo" and got.cached and got.latency_s == 0.0
    raw = sqlite3.connect(tmp_path / "sub" / "c.sqlite").execute("SELECT value FROM entries").fetchone()[0]
    assert ChatResult.model_validate_json(raw).text == "héllo"  # a JSON document, not a pickle
    assert sqlite3.connect(tmp_path / "sub" / "c.sqlite").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with pytest.raises(ValueError, match="cache mode"):
        Cache(tmp_path / "x.sqlite", mode="sometimes")


_WRITER = """
import sys
from treadle.llm import Cache, ChatResult
path, w, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = Cache(path)
for i in range(n):
    c.put(ChatResult(kind="chat", model="m", text=f"w{w}", finish_reason="stop", key=f"{w}-{i}"))
    c.get(f"{(w + 1) % 4}-{i}")
"""


def test_cache_shared_by_processes(tmp_path):
    path = tmp_path / "c.sqlite"
    Cache(path)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(w), "40"]) for w in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    c = Cache(path)
    assert len(c) == 160 and c.check()
    assert c.get("2-39").text == "w2"


def _records(seed=0, n=200):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        hit, ok = rng.random() < 0.2, rng.random() < 0.9
        tin, tout = (0, 0) if hit or not ok else (rng.randint(1, 5000), rng.randint(1, 2000))
        out.append(LedgerRecord(time=0.0, role=rng.choice(["policy", "judge", "user_sim"]),
                                tag=rng.choice(["rollout", "repair", "score", ""]), model="m", kind="chat", key="k",
                                tokens_in=tin, tokens_out=tout, latency_s=rng.random(), cache_hit=hit and ok,
                                cost_usd=(tin * 0.15 + tout * 0.6) / 1e6, ok=ok, failure=None if ok else "timeout"))
    return out


def test_ledger_totals_sum_to_the_whole(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    recs = _records()
    for r in recs:
        led.append(r)
    back = read_ledger(tmp_path / "l.jsonl")
    assert back == recs
    t = led.totals()
    assert t["all"].calls == 200 and t["all"].tokens_in == sum(r.tokens_in for r in recs)
    assert t["all"].cost_usd == pytest.approx(sum(r.cost_usd for r in recs), rel=1e-12)
    for group in ("role", "tag", "role_tag"):
        parts = list(t[group].values())
        for field in ("calls", "cache_hits", "failures", "tokens_in", "tokens_out"):
            assert sum(getattr(p, field) for p in parts) == getattr(t["all"], field), (group, field)
        assert sum(p.cost_usd for p in parts) == pytest.approx(t["all"].cost_usd, rel=1e-12)
    # a role's totals are the sum of its (role, tag) cells
    for role, tr in t["role"].items():
        cells = [v for k, v in t["role_tag"].items() if k.split("/")[0] == role]
        assert sum(c.tokens_out for c in cells) == tr.tokens_out and sum(c.calls for c in cells) == tr.calls
    assert totals([])["all"].calls == 0


def test_ledger_skips_torn_last_line(tmp_path):
    p = tmp_path / "l.jsonl"
    led = Ledger(p)
    for r in _records(n=3):
        led.append(r)
    led.close()
    with open(p, "a") as f:
        f.write('{"schema_version": 1, "time": 0.0, "ro')
    with pytest.warns(UserWarning, match="torn"):
        assert len(read_ledger(p)) == 3
    with open(p, "a") as f:
        f.write("\n" + _records(n=1)[0].model_dump_json() + "\n")
    with pytest.raises(ValueError):  # a damaged line in the middle is an error, not silently dropped
        read_ledger(p)
