"""The attribution drill's report: BFCL fault cases in their own table, attributed as the loop does, and the
per-component cross-blame columns of every table."""
import json
import logging

import anyio
import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve import drill_report
from treadle.weft.evolve.attribute import Attribution, Blame
from treadle.weft.evolve.drill_report import COLUMNS, by_component, rows
from treadle.weft.evolve.faults import CaseResult
from treadle.weft.evolve.faults_heldout import summary

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def _case(i, label, blame, observed=True):
    att = None if blame is None else Attribution(checkpoint=f"c{i}", blame=blame, rule="r")
    return CaseResult(id=f"case-{i}", env="e", task="t", label=label, fault="f", observed=observed, attribution=att)


CASES = [_case(0, Blame.environment, Blame.environment), _case(1, Blame.environment, Blame.policy),
         _case(2, Blame.task, None), _case(3, Blame.policy, Blame.policy), _case(4, Blame.policy, Blame.task),
         _case(5, Blame.policy, Blame.undecided), _case(6, Blame.evaluator, None, observed=False)]


def test_rows_carry_the_cross_blames_per_component():
    s = summary(CASES)
    s["by_component"] = by_component(CASES)
    got = {r[0]: r for r in rows(s)}
    assert list(got) == ["environment", "task", "policy", "all"] and all(len(r) == len(COLUMNS) for r in got.values())
    assert got["environment"][1:] == ["1/2", "50%", "1", "-", "0"]
    assert got["task"][3] == "1"  # a silent (unattributed) task fault is left on the policy
    assert got["policy"][1:] == ["1/3", "33%", "-", "1", "1"]
    assert got["all"][3:] == ["2", "1", "1"]
    assert rows({"skipped": "bfcl-eval is not installed"})[0][:2] == ["skipped", "bfcl-eval is not installed"]


def test_bfcl_cases_are_attributed_as_the_loop_does():
    pytest.importorskip("bfcl_eval")
    from treadle.weft.runtime import Runtime

    async def main():
        async with Runtime() as rt:
            return await drill_report.bfcl_cases(rt, limit=2)
    cases, why = anyio.run(main)
    assert not why and {c.env for c in cases} and all(c.id.startswith("bfcl:") for c in cases)
    per = by_component(cases)
    assert {"environment", "evaluator", "policy"} <= set(per)
    # a policy error whose gold a competent policy can derive (documented options, start state, lookup
    # tools, dates written out) is the policy's, never the task's
    assert not summary(cases)["policy_blamed_elsewhere"]
    assert not summary(cases)["blamed_on_policy"]


def test_cli_prints_the_bfcl_table_or_why_it_is_skipped(tmp_path, monkeypatch):
    base = summary(CASES)
    base["by_component"] = by_component(CASES)

    async def canned(rt, **_):
        return {"held_apart": base, "catalogue": base, "bfcl": {"skipped": "bfcl-eval is not installed (x)"},
                "cases": {}}
    monkeypatch.setattr(drill_report, "attribution_drill", canned)
    res = CliRunner().invoke(app, ["weft", "evolve", "--drill", "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert "BFCL fault catalogue" in res.output and "bfcl-eval is not installed" in res.output
    assert "blamed on policy" in res.output
    assert json.loads((tmp_path / "d" / "attribution_drill.json").read_text())["bfcl"]["skipped"]

    async def with_bfcl(rt, **_):
        return {"held_apart": base, "catalogue": base, "bfcl": base, "cases": {}}
    monkeypatch.setattr(drill_report, "attribution_drill", with_bfcl)
    res = CliRunner().invoke(app, ["weft", "evolve", "--drill", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0 and "attribution on the BFCL fault catalogue (6 observed of 7 faults)" in res.output
