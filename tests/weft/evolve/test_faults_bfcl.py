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
