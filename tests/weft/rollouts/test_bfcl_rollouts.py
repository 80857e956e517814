"""Rollouts over BFCL v4 multi-turn environments (skipped unless ``bfcl-eval`` is installed): tasks from
entries, prefix-preserving and end-to-end sampling with the replay policy, views, and the CLI."""
import json

import pytest
from typer.testing import CliRunner

from treadle.testing import require_module

require_module("bfcl_eval")

from treadle.weft.rollouts.batch import Component, SampleConfig, sample  # noqa: E402
from treadle.weft.rollouts.bfcl_tasks import eligible, from_bfcl, skipped  # noqa: E402
from treadle.weft.rollouts.cli import app  # noqa: E402
from treadle.weft.rollouts.metrics import summarize  # noqa: E402


def test_entries_become_atomic_turn_tasks():
    tasks = from_bfcl("base", limit=3)
    assert len(tasks) == 3
    t = tasks[0]
    assert t.env == f"bfcl:base:{t.name}" and [a.name for a in t.ordered()] == [f"{t.name}/turn{k}"
                                                                               for k in range(len(t.atomic))]
    assert all(a.depends_on == (f"{t.name}/turn{k - 1}",) for k, a in enumerate(t.atomic) if k)
    assert all(a.checkpoint.compare_private is False and a.gold for a in t.atomic)
    skip = skipped("base")
    assert len(skip) + len(from_bfcl("base")) == 200
    assert any("known bad gold" in r for r in skip.values())
    bad = next(i for i, r in skip.items() if "known bad gold" in r)
    with pytest.raises(ValueError, match="cannot be a rollout task: known bad gold"):
        from_bfcl("base", ids=[bad])
    with pytest.raises(ValueError, match="limit"):
        from_bfcl("base", limit=0)
    with pytest.raises(ValueError, match="unknown BFCL base entry"):
        from_bfcl("base", ids=["multi_turn_base_99999"])
    assert eligible({"id": "x", "involved_classes": ["A"], "question": [[]]}) == "a turn without a user message"


def test_replay_rollouts_on_bfcl(tmp_path):
    tasks = from_bfcl("base", limit=2)
    gold = sample(tmp_path / "gold", tasks, SampleConfig(methods=("prefix", "end_to_end"), ks=(1,)))
    assert len(gold) == 4 and all(t.accepted and t.reward == 1.0 for t in gold)  # gold calls pass every turn
    assert all(t.env.startswith("bfcl:base:") and t.tools for t in gold)
    bad = sample(tmp_path / "bad", tasks[:1], SampleConfig(policy=Component(
        name="replay", args={"rates": {"wrong_argument": 1.0}})))
    (t,) = bad
    assert not t.accepted and t.rewards == (0,) and t.attempts[0].r == 0 and t.attempts[0].reasons  # turn 0 fails


def test_multi_class_entry_routes_calls_and_judges_per_class(tmp_path):
    from treadle.data.bfcl import function_docs
    from treadle.weft.rollouts.bfcl_tasks import _entries

    by_id, _ = _entries("base")

    def owners(task):
        return {c: {d["name"] for d in function_docs([c])} for c in by_id[task.name]["involved_classes"]}

    def gold_names(task):
        return {g.name for a in task.atomic for g in a.checkpoint.gold_calls}

    multi = next(t for t in from_bfcl("base") if len(owners(t)) == 2
                 and all(gold_names(t) & names for names in owners(t).values()))
    (t,) = sample(tmp_path / "ok", [multi], SampleConfig(harness=Component(name="native")))
    assert t.accepted
    offered = {tl["function"]["name"] for tl in t.tools}
    assert all(names <= offered for names in owners(multi).values())  # the union of both classes' tools
    calls = [c for a in t.attempts for st in a.steps for c in st.calls]
    assert all(c.ok for c in calls)  # each call reached the session of the class that owns the tool
    assert all({c.name for c in calls} & names for names in owners(multi).values())  # both classes used
    (bad,) = sample(tmp_path / "bad", [multi], SampleConfig(policy=Component(
        name="replay", args={"rates": {"wrong_argument": 1.0}})))
    assert not bad.accepted and bad.attempts[0].r == 0


@pytest.mark.slow
def test_bfcl_acceptance_table_is_deterministic(tmp_path):
    tasks = from_bfcl("base", limit=3)
    rates = {"wrong_argument": 0.15, "skipped_call": 0.15}
    cfg = SampleConfig(policy=Component(name="replay", args={"rates": rates, "seed": 1}),
                       methods=("prefix", "end_to_end"), ks=(1, 3))
    rows = {(r["method"], r["k"]): r for r in summarize(sample(tmp_path / "mixed", tasks, cfg))}
    again = {(r["method"], r["k"]): r for r in summarize(sample(tmp_path / "mixed2", tasks, cfg))}
    assert rows == again  # deterministic
    assert rows["prefix", 1]["accepted"] == rows["end_to_end", 1]["accepted"]
    assert rows["prefix", 3]["accepted"] >= rows["end_to_end", 3]["accepted"]


def test_simuser_view_withholds_bfcl_details(tmp_path):
    (task,) = from_bfcl("base", limit=1, disclosure="vague")
    withheld = [a for a in task.atomic if a.details]
    assert withheld  # BFCL requests name literal argument values (file names, ids, ...)
    (t,) = sample(tmp_path, [task], SampleConfig(view=Component(name="simuser"), harness=Component(name="react")))
    users = [m["content"] for m in t.messages if m["role"] == "user" and not m["content"].startswith("Observation")]
    assert any("[ask me]" in u for u in users) and t.accepted


def test_cli_bfcl(tmp_path):
    r = CliRunner().invoke(app, ["sample", str(tmp_path), "--env", "bfcl", "--bfcl-limit", "2", "--k", "1",
                                 "--method", "prefix", "--harness", "native"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and all(x["accepted"] and x["env"].startswith("bfcl:base:") for x in lines)
    assert "2 accepted trajectories" in r.output
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(x["env"], x["accepted"], x["trajectories"]) for x in rows] == [("bfcl:base", 2, 2)]  # one row per category
    for args, flag in ((["--bfcl-limit", "0"], "--bfcl-limit"), (["--bfcl-category", "nope"], "--bfcl-category")):
        r = CliRunner().invoke(app, ["sample", str(tmp_path / "x"), "--env", "bfcl", *args])
        assert r.exit_code == 2 and r.output.startswith(f"error: {flag}:"), r.output
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "x"), "--bfcl-limit", "2"])
    assert r.exit_code == 2 and "only with --env bfcl" in r.output
    assert not (tmp_path / "x").exists()
