import pytest
from pydantic import ValidationError
from treadle.rsi.harness import Harness, Provenance, Skill, Workflow, diff


def _skill(name, method=("add_term",), effect=-0.1):
    return Skill(name=name, intent="i", method=method, difficulty_effect=effect, tool_hint="sympy",
                 provenance=Provenance(source="online_failure", failure_task="abc", round=2, evidence={"x": 1.0}))


def test_json_round_trip_keeps_every_field():
    h = Harness(skills=(_skill("a"), _skill("b", ("multiply", "add_term"))), workflow=Workflow(max_extends=3))
    back = Harness.from_json(h.to_json())
    assert back == h
    assert back.skills[0].provenance.failure_task == "abc"
    assert back.digest == h.digest


def test_records_are_frozen_and_strict():
    h = Harness()
    with pytest.raises(ValidationError):
        h.version = 3
    with pytest.raises(ValidationError):
        Skill(name="a", intent="i", method=("x",), bogus=1)
    with pytest.raises(ValidationError, match="at least one step"):
        Skill(name="a", intent="i", method=())
    with pytest.raises(ValidationError, match="duplicated"):
        Harness(skills=(_skill("a"), _skill("a")))


def test_evolve_bumps_version_and_parent_digest_ignores_version():
    h = Harness(skills=(_skill("a"),))
    h2 = h.with_skill(_skill("b"))
    assert (h2.version, h2.parent) == (1, 0)
    assert h2.digest != h.digest
    assert h.evolve().digest == h.digest
    with pytest.raises(ValueError, match="already in harness"):
        h2.with_skill(_skill("b"))


def test_diff_lists_added_removed_and_modified():
    h = Harness(skills=(_skill("a"), _skill("b")))
    h2 = h.evolve(skills=(_skill("a", effect=-0.4), _skill("c", ("multiply",))),
                  workflow=h.workflow.model_copy(update={"verify_every": 2}))
    lines = diff(h, h2)
    assert "- skill b" in lines
    assert "+ skill c: multiply (effect -0.100)" in lines
    assert "~ skill a.difficulty_effect: -0.1 -> -0.4" in lines
    assert "~ workflow.verify_every: 1 -> 2" in lines
    assert len(lines) == 4
    assert diff(h, h) == []
