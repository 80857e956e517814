"""The WEFT evolution commands against a REAL OpenAI-compatible endpoint: ``transformers serve`` of the tiny
untrained checkpoint on 127.0.0.1 (``treadle.llm.local_server``; no network, no download). The model writes junk;
what is tested is that every call goes over HTTP (ledger: not recorded, not cached), each junk answer is recorded
and attributed to its stage or component, no command crashes, and nothing accepted earlier is lost.
Marked slow: ~35 s on an idle 2-core machine (the server starts in ~8 s), over 2 min when the cores are shared;
``real_llm_run.py`` runs the same commands by hand and prints what happened."""
import json
import logging
import sys
from pathlib import Path

import anyio
import pytest
from treadle.cli import app
from typer.testing import CliRunner

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
ROLES = ("designer", "schema", "backend", "checker", "grounder", "verifier", "composer")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(LocalServer, llm.toml with every role on it)``."""
    import torch
    from treadle.llm import local_server
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("real-llm")
    path, _ = save_untrained_checkpoint(d / "ckpt")
    with local_server(path, startup_timeout_s=300, log=d / "server.log") as srv:
        cfg = d / "llm.toml"
        cfg.write_text("".join(f'[roles.{r}]\nmodel = "{srv.model}"\nbase_url = "{srv.base_url}"\nmax_retries = 0\n'
                               f'timeout_s = 120\nsampling = {{ temperature = 0.0, max_tokens = 24 }}\n'
                               for r in ROLES))
        yield srv, cfg


def _ledger(path):
    rows = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert rows and all(r["ok"] and not r["recorded"] and not r["cache_hit"] for r in rows)  # live HTTP calls
    return rows


def test_synth_over_http_records_the_junk_at_its_stage(served, tmp_path, S):
    _, cfg = served
    docs = tmp_path / "docs.txt"
    docs.write_text(S.DOCS)
    out = tmp_path / "synth"
    res = CliRunner().invoke(app, ["weft", "synth", "--docs", str(docs), "--requirement", S.REQUIREMENT,
                                   "--llm-config", str(cfg), "--out", str(out), "--max-rounds", "1"])
    assert res.exit_code == 1, res.output  # not accepted: said, artefacts written, no traceback
    assert "role answer rejected [design]: designer answer is not the JSON asked for" in res.output
    assert "not accepted" in res.output and (res.exception is None or isinstance(res.exception, SystemExit))
    assert json.loads((out / "result.json").read_text())["accepted"] is False
    assert {r["role"] for r in _ledger(out / "llm_ledger.jsonl")} == {"designer"}


def test_evolve_drill_over_http_keeps_the_deterministic_repairs(served, tmp_path):
    """grounder / verifier answers are junk: recorded as malformed, their components left as they were; the
    native backend and the composed faults are still repaired deterministically, and stay repaired."""
    _, cfg = served
    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["weft", "evolve", "--llm-config", str(cfg), "--out", str(out), "--max-rounds", "2",
                                   "--revise-attempts", "1"])
    assert res.exit_code == 0, res.output
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    r1, r2 = rounds
    assert r1["revised"] == ["backend:shop", "composed:ada-cycle/edges:crm:crm-resolve",
                             "composed:ada-unbound-text/calls:crm:crm-credit"]
    assert r1["revalidated"]["composed:ada-cycle"] and r1["revalidated"]["composed:ada-unbound-text"]
    revs = [a for r in rounds for a in r["revisions"]]
    assert {a["component"] for a in revs} == {"task:shop-cancel-order", "verifier:crm-vip"}
    assert all(not a["accepted"] and a["detail"].startswith("malformed answer") and a["answer"] for a in revs)
    assert r2["revised"] == [] and "backend:shop" not in r2["blamed"]  # nothing accepted earlier is lost
    assert not any(b.startswith("composed:") for b in r2["blamed"])
    assert {r["role"] for r in _ledger(out / "llm_ledger.jsonl")} == {"grounder", "verifier"}


def test_the_composer_role_over_http_leaves_the_task_as_it_was(served, tmp_path):
    from treadle.llm import LLMClient, LLMConfig
    from treadle.weft.envs import crm, shop
    from treadle.weft.evolve import composed_revise as cr
    from treadle.weft.evolve.revise import LLMReviser
    from treadle.weft.runtime import Runtime

    sys.path.insert(0, str(HERE))
    import test_composed_llm as T

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)
    _, cfg = served

    async def main():
        async with Runtime() as rt, LLMClient(LLMConfig.load(cfg), ledger=tmp_path / "ledger.jsonl") as llm:
            h = {"shop": rt.register(shop), "crm": rt.register(crm)}
            bad = T._late_cycle(await T._certified(rt))
            verdicts = await cr.attribute_composed(rt, bad, bad, h, None)
            reviser = LLMReviser(llm, attempts=1)
            return await reviser.composed(rt, h, bad, bad, verdicts), reviser.log
    new, log = anyio.run(main)
    assert new is None and [(a.component, a.role, a.accepted) for a in log] == [("composed:ada-late", "composer",
                                                                                   False)]
    assert all(a.detail.startswith("malformed answer") for a in log)
    assert {r["role"] for r in _ledger(tmp_path / "ledger.jsonl")} == {"composer"}


def test_evolve_synth_over_http_keeps_the_served_backend(served, tmp_path, S, sandbox):
    _, cfg = served
    synth = tmp_path / "library"
    synth.mkdir()
    (synth / "result.json").write_text(S.result().model_dump_json(by_alias=True), encoding="utf-8")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"name": t.name, "request": t.request, "gold": [
        {"name": c.name, "arguments": c.arguments} for c in t.checkpoint.gold_calls]}) + "\n" for t in (S.LEND, S.ADD)))
    broken = tmp_path / "broken.py"
    broken.write_text(S.BROKEN, encoding="utf-8")
    out = tmp_path / "o"
    res = CliRunner().invoke(app, ["weft", "evolve", "--synth", str(synth), "--tasks", str(tasks), "--backend",
                                   str(broken), "--llm-config", str(cfg), "--out", str(out), "--rate",
                                   "wrong_argument=0", "--k", "1", "--max-rounds", "2", "--revise-attempts", "1"])
    assert res.exit_code == 0, res.output
    assert "round 1: backend:library (backend, answer 1): rejected: malformed answer" in res.output
    assert "backend unchanged" in res.output and (out / "backend.py").read_text() == S.BROKEN
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["revised"] for r in rounds] == [[], []] and [r["passed"] for r in rounds] == [1, 1]
    [att, _] = [json.loads(x) for x in (out / "attributions.jsonl").read_text().splitlines()]
    assert (att["checkpoint"], att["blame"]) == ("lend-emma", "environment")
    assert {r["role"] for r in _ledger(out / "llm_ledger.jsonl")} == {"backend"}
