"""The ledger counts what the caller got: a structured call that never validated (``Failure(kind=invalid_output)``)
is one failure in the ledger (its final reply's line), not ``failures 0``."""
import asyncio

from pydantic import BaseModel
from typer.testing import CliRunner

from treadle.llm import Failure, FailureKind, LLMClient, read_ledger, totals

from .conftest import Step

MSG = [{"role": "user", "content": "hi"}]


class Verdict(BaseModel):
    score: int


def _reply(text):
    return Step(200, {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                                                  "content": text}}],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 2}})


def test_invalid_structured_output_is_a_ledger_failure(fake, make_config, tmp_path):
    fake.script = [_reply("no json"), _reply('{"score": "x"}'), _reply("[1]"),  # 3 attempts, none valid
                   _reply('{"score": "y"}'), _reply('{"score": 4}')]  # then a repaired success

    async def go():
        async with LLMClient(make_config(roles=("judge",)), ledger=tmp_path / "l.jsonl") as llm:
            bad = await llm.structured(MSG, Verdict, role="judge", tag="score", max_repairs=2)
            good = await llm.structured([{"role": "user", "content": "again"}], Verdict, role="judge", tag="score")
            return bad, good

    bad, good = asyncio.run(go())
    assert isinstance(bad, Failure) and bad.kind == FailureKind.invalid_output and bad.attempts == 3
    assert good.value.score == 4 and good.attempts == 2
    recs = read_ledger(tmp_path / "l.jsonl")
    assert len(recs) == 5  # one line per call sent
    assert [r.ok for r in recs] == [True, True, False, True, True]
    assert recs[2].failure == "invalid_output"
    assert recs[2].tokens_in == 3  # the failed reply was still paid for
    t = totals(recs)
    assert t["role_tag"]["judge/score"].failures == t["all"].failures == 1 and t["all"].calls == 5

    from treadle.llm.cli import app

    r = CliRunner().invoke(app, ["ledger", str(tmp_path / "l.jsonl"), "--by", "role_tag"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    row = next(ln for ln in r.output.splitlines() if "judge/score" in ln)
    assert [c.strip() for c in row.split("│")[1:5]] == ["judge/score", "5", "0", "1"], row  # calls, hits, failures
