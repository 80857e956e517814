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
    excluded = set(by_id[multi.name].get("excluded_function") or [])
    assert all(names - excluded <= offered for names in owners(multi).values())  # the union of both classes' tools
    assert not excluded & offered  # less the entry's excluded functions
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
        assert r.exit_code == 2 and r.output.startswith(f"Error: {flag}:"), r.output
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "x"), "--bfcl-limit", "2"])
    assert r.exit_code == 2 and "only with --env bfcl" in r.output
    assert not (tmp_path / "x").exists()


class EarlyCaller:
    """Replay, but on attempt 0 of turn ``early`` play the gold calls of turn ``early + 1`` (a tool not yet
    handed over); records the tool names it was offered per (turn, attempt)."""

    name = "early-caller"

    def __init__(self, early):
        from treadle.weft.rollouts.policies import ReplayPolicy

        self.early, self.replay, self.offered = early, ReplayPolicy(), {}

    def args(self):
        return {"early": self.early}

    async def act(self, messages, tools, harness, ctx):
        self.offered[ctx.index, ctx.attempt] = {t["function"]["name"] for t in tools}
        if ctx.index == self.early and ctx.attempt == 0:
            nxt = ctx.task.ordered()[ctx.index + 1]
            return harness.render(list(nxt.checkpoint.gold_calls)) if ctx.step == 0 else harness.render([], "done")
        return await self.replay.act(messages, tools, harness, ctx)


def test_missed_and_excluded_functions_are_offered_per_turn(tmp_path):
    import anyio

    from treadle.data.bfcl import missed_function_names
    from treadle.weft.rollouts.batch import env_builder
    from treadle.weft.rollouts.bfcl_tasks import _entries
    from treadle.weft.rollouts.harnesses import NativeHarness
    from treadle.weft.rollouts.rollout import Setup, prefix_rollout
    from treadle.weft.rollouts.views import AgenticView
    from treadle.weft.runtime import Runtime

    assert all(r.startswith("known bad gold") for r in skipped("miss_func").values())  # nothing else is skipped
    by_id, _ = _entries("miss_func")
    task = next(t for t in from_bfcl("miss_func") if by_id[t.name].get("excluded_function"))
    entry = by_id[task.name]
    (handover, (late, *_)), = missed_function_names(entry).items()
    (excluded, *_) = entry["excluded_function"]
    turns = task.ordered()
    assert turns[handover].request == "I have updated some more functions you can choose from. What about now?"
    assert all((late in a.tools) == (k >= handover) and excluded not in a.tools for k, a in enumerate(turns))
    assert turns[handover - 1].gold == [] and late in {g.name for g in turns[handover].checkpoint.gold_calls}

    policy = EarlyCaller(handover - 1)

    async def main():
        async with Runtime() as rt:
            env = await env_builder(task.env)(rt)
            return await prefix_rollout(rt, env, task, 2, Setup(AgenticView(), NativeHarness(), policy))
    tr = anyio.run(main)
    assert tr.accepted and tr.reward == 1.0
    early = [a for a in tr.attempts if a.atomic == turns[handover - 1].name]
    assert [a.r for a in early] == [0, 1]  # the early call failed its turn; the retry (no call) passed
    calls = [c for st in early[0].steps for c in st.calls]
    assert calls and calls[0].name == late and calls[0].error_kind == "unknown_tool"  # refused by the runtime
    assert all((late in names) == (k >= handover) and excluded not in names for (k, _), names in policy.offered.items())
    assert all((late in a.tools) == (a.atomic in {t.name for t in turns[handover:]}) for a in tr.attempts)
    offered = {t["function"]["name"] for t in tr.tools}
    assert late in offered and excluded not in offered  # the SFT row: every tool offered on some turn
    (e2e,) = sample(tmp_path, [task], SampleConfig(methods=("end_to_end",), harness=Component(name="native")))
    assert e2e.accepted and e2e.reward == 1.0
