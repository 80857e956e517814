"""The fault-injection suite over BFCL classes (skipped without bfcl-eval)."""
import logging

import anyio
import pytest

pytest.importorskip("bfcl_eval")

from treadle.weft.evolve.attribute import Blame  # noqa: E402
from treadle.weft.evolve.faults import report  # noqa: E402
from treadle.weft.evolve.faults_bfcl import bug_source, bfcl_suite  # noqa: E402
from treadle.weft.runtime import Runtime  # noqa: E402


def test_bfcl_suite_attributes_every_observed_fault_kind():
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)  # injected crashes log tracebacks

    async def main():
        async with Runtime() as rt:
            return report(await bfcl_suite(rt, limit=3, per_class=1))
    r = anyio.run(main)
    assert len({c.env for c in r.cases}) == 3  # three classes
    assert {c.label for c in r.observed} == {Blame.policy, Blame.environment, Blame.task, Blame.evaluator}
    assert r.accuracy >= 0.95
    crash = [c for c in r.observed if c.fault.endswith(":crash")]
    assert crash and all(c.attribution.rule == "reference_fails" for c in crash)
    task = [c for c in r.observed if c.label == Blame.task]  # a referenced entity deleted from the initial state
    assert task and all((c.attribution.blame, c.attribution.rule) == (Blame.task, "precondition_state") for c in task)
    assert any(c.fault == "deleted VehicleControlAPI.doorStatus['driver']" for c in task)


def test_delete_referenced_finds_keys_in_nested_public_state():
    from treadle.weft.runtime.callparse import ToolCall
    from treadle.weft.envs import bfcl
    from treadle.weft.evolve.faults_bfcl import delete_referenced
    from treadle.weft.runtime.object_state import ObjectState
    from treadle.weft.runtime.registry import release_module

    async def main():
        async with Runtime() as rt:
            h = bfcl.register_class(rt, "GorillaFileSystem")
            cfg = {"root": {"alex": {"type": "directory", "contents": {
                "docs": {"type": "directory", "contents": {"a.txt": {"type": "file", "content": "x"}}}}}}}
            snap, what = delete_referenced(rt, h, cfg, [ToolCall(name="cd", arguments={"folder": "docs"}),
                                                        ToolCall(name="cat", arguments={"file_name": "a.txt"})])
            assert delete_referenced(rt, h, cfg, [ToolCall(name="ls", arguments={"a": True})]) is None
            module, weft = rt.registry.load(h)
            state = ObjectState(snap, weft.state_class)
            try:
                assert "docs" not in state.handle.root.contents  # the folder the reference enters is gone
            finally:
                state.close()
                release_module(module)
            return what
    assert anyio.run(main) == "deleted GorillaFileSystem.root.contents['docs']"


def test_unknown_bug_kind_is_refused():
    with pytest.raises(ValueError, match="unknown bug kind"):
        bug_source("", "C", "m", "melt")


def test_every_eligible_entry_or_a_bound_per_class():
    from treadle.weft.evolve.faults_bfcl import bfcl_tasks

    async def main():
        async with Runtime() as rt:
            every = bfcl_tasks(rt, None, None)
            one = bfcl_tasks(rt, None, 1)
            with pytest.raises(ValueError, match="per_class must be >= 1"):
                bfcl_tasks(rt, None, 0)
            return every, one
    every, one = anyio.run(main)
    classes = {cls for cls, _, _ in every}
    assert sorted(cls for cls, _, _ in one) == sorted(classes)  # one per class
    assert len(every) > 4 * len(classes) and len({t.name for _, _, t in every}) == len(every)


def test_entries_beyond_one_per_class_are_attributed_by_kind():
    """BFCL entries the one-per-class drill leaves out: the gold values a competent policy derives (``tmp`` for "the
    temporary directory", each file of a folder, a result rounded to two decimals, ``START`` for startEngine,
    ``AAPL`` for Apple, the last day of a month) are not the task's, ``cd("..")`` is undecided, and a stock deleted
    from the initial state that the reference finds already watched is the task's (the verifier fails the reference
    only from that start)."""
    from treadle.weft.envs import bfcl
    from treadle.weft.evolve import task_checks
    from treadle.weft.evolve.derivable import known_world
    from treadle.weft.evolve.faults import run_case
    from treadle.weft.evolve.faults_bfcl import bfcl_tasks, delete_referenced
    from treadle.weft.evolve.attribute import generate_verifier, record_evidence

    undecided = {"multi_turn_base_26": [], "multi_turn_base_37": [], "multi_turn_base_83": [],
                 "multi_turn_base_96": [], "multi_turn_base_194": [], "multi_turn_base_38": ["cd.folder='..'"],
                 "multi_turn_base_120": ["place_order.order_type='Buy'"]}

    async def main():
        async with Runtime() as rt:
            tasks = {t.name.split("/")[0]: (cls, cfg, t) for cls, cfg, t in bfcl_tasks(rt, None, None)}
            got, blames = {}, []
            for entry in [*undecided, "multi_turn_base_135"]:
                cls, cfg, task = tasks[entry]
                h = bfcl.register_class(rt, cls)
                start = bfcl.initial_snapshot(rt, h, cls, cfg)
                gold = list(task.checkpoint.gold_calls)
                ev = await record_evidence(rt, h, start, task.name, gold)
                if entry in undecided:
                    tools = {t["name"]: t for t in rt.registry.spec(h).tools}
                    world = await known_world(rt, h, start, tools, request=task.request)
                    d = task_checks.derive_values(task.request, gold, ev.results, tools, world=world)
                    got[entry] = (d.missing, d.undecided)
                    continue
                snap, what = delete_referenced(rt, h, cfg, gold)
                case = await run_case(rt, case_id="zeta", env=cls, task=task, label=Blame.task, fault=what,
                                      server_hash=h, start=snap, spec=generate_verifier(task.checkpoint, start, ev),
                                      calls=gold, evidence=ev, as_loop=True)
                blames.append((what, case.attribution.blame, case.attribution.rule))
            return got, blames
    got, blames = anyio.run(main)
    assert got == {e: ([], u) for e, u in undecided.items()}
    assert blames == [("deleted TradingBot.stocks['ZETA']", Blame.task, "precondition_state")]
