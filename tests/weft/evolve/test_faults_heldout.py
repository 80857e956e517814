"""The held-apart fault set: its shape, attribution on it as the evolution loop does it, and ``--drill``."""
import json
import logging

import anyio
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.faults_heldout import HELDOUT, attribute_only, heldout_suite, summary
from treadle.weft.runtime import Runtime

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def test_the_set_covers_every_component_and_kind():
    assert len(HELDOUT) >= 40 and len({f.id for f in HELDOUT}) == len(HELDOUT)
    assert {f.label for f in HELDOUT} == {Blame.policy, Blame.environment, Blame.task, Blame.evaluator, Blame.harness}
    kinds = {f.kind for f in HELDOUT}
    assert {"harness_parser", "harness_prompt", "off_path", "doc_behaviour", "born_broken", "task_semantics",
            "inconsistent_request", "other_customer", "over_strict", "lenient", "forbidden_action"} <= kinds


def _suite(attributor=None):
    async def main():
        async with Runtime() as rt:
            return await heldout_suite(rt, attributor=attributor)
    return anyio.run(main)


def test_the_loop_meets_the_targets_on_the_held_apart_set():
    s = summary(_suite())
    assert s["observed"] == len(HELDOUT)
    assert s["accuracy"] >= 0.9, s["wrong"]
    assert s["blamed_on_policy"] == [] and s["policy_blamed_elsewhere"] == []
    assert {k: v["n"] for k, v in s["per_component"].items()} == {"environment": 12, "task": 8, "evaluator": 7,
                                                                  "harness": 6, "policy": 12}


def test_the_reference_replay_rules_alone_miss_what_is_off_their_path():
    """The reference-replay rules by themselves (no request, harness or audit): the measurement before the checks."""
    s = summary(_suite(attribute_only))
    assert s["per_component"]["harness"]["correct"] == 0 and s["accuracy"] < 0.5


def test_cli_drill_reports_both_sets_apart(tmp_path):
    out = tmp_path / "drill"
    res = CliRunner().invoke(app, ["weft", "evolve", "--drill", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "held-apart fault set" in res.output and "fault catalogue" in res.output
    doc = json.loads((out / "attribution_drill.json").read_text())
    assert doc["held_apart"]["accuracy"] >= 0.9 and doc["catalogue"]["accuracy"] >= 0.95
    assert doc["held_apart"]["blamed_on_policy"] == doc["catalogue"]["blamed_on_policy"] == []
    assert doc["catalogue"]["policy_blamed_elsewhere"] == []
    bad = CliRunner().invoke(app, ["weft", "evolve", "--drill", "--synth", str(tmp_path), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--synth" in bad.output
