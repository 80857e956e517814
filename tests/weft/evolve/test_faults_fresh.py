"""The fresh held-apart fault set: its shape, its controls, attribution on it as the loop does it, and ``--drill``."""
import json
import logging

import anyio
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.faults_fresh import FRESH, SILENT_KINDS, fresh_suite
from treadle.weft.evolve.faults_heldout import HELDOUT, summary
from treadle.weft.runtime import Runtime

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def _suite(cases=FRESH):
    async def main():
        async with Runtime() as rt:
            return await fresh_suite(rt, cases)
    return anyio.run(main)


def test_the_set_covers_every_component_with_its_own_ids():
    assert len(FRESH) >= 40 and len({c.id for c in FRESH}) == len(FRESH)
    per = {b: sum(c.label == b for c in FRESH) for b in Blame if b != Blame.undecided}
    assert min(per.values()) >= 8, per
    assert {"off_path", "doc_behaviour", "born_broken", "underivable_gold", "inconsistent_request", "over_strict",
            "lenient", "harness_parser", "harness_prompt", "forbidden_action", "looks_nondeterministic"} <= {
        c.kind for c in FRESH}
    assert not {c.id.split("/", 1)[1] for c in FRESH} & {f.id for f in HELDOUT}


def test_every_case_is_observed_and_its_control_behaves():
    """A case whose control misbehaves (or whose fault does not show) comes back unobserved: none does."""
    cases = _suite()
    assert [c.id for c in cases if not c.observed] == []
    s = summary(cases)
    assert s["accuracy"] >= 0.9 and s["blamed_on_policy"] == [] and s["policy_blamed_elsewhere"] == [], s["wrong"]


def test_a_silent_fault_nothing_flags_counts_against_the_policy():
    lenient = [c for c in FRESH if c.kind in SILENT_KINDS]
    assert lenient
    s = summary(_suite(lenient))
    assert s["observed"] == len(lenient)
    assert set(s["blamed_on_policy"]) == {c for c, b in s["wrong"].items() if b in ("passed", "policy")}


def test_cli_drill_reports_the_fresh_set_apart(tmp_path):
    out = tmp_path / "drill"
    res = CliRunner().invoke(app, ["weft", "evolve", "--drill", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "fresh held-apart fault set" in res.output
    doc = json.loads((out / "attribution_drill.json").read_text())
    assert doc["fresh"]["cases"] == len(FRESH) == len(doc["cases"]["fresh"])
    assert {"held_apart", "catalogue"} <= set(doc)
    assert doc["fresh"]["accuracy"] >= 0.9 and doc["fresh"]["blamed_on_policy"] == []
