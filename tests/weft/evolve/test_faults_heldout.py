"""The held-apart fault set: its shape, and attribution on it as the evolution loop does it."""
import logging

import anyio

from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.faults_heldout import HELDOUT, heldout_suite, summary
from treadle.weft.runtime import Runtime

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def test_the_set_covers_every_component_and_kind():
    assert len(HELDOUT) >= 40 and len({f.id for f in HELDOUT}) == len(HELDOUT)
    assert {f.label for f in HELDOUT} == {Blame.policy, Blame.environment, Blame.task, Blame.evaluator, Blame.harness}
    kinds = {f.kind for f in HELDOUT}
    assert {"harness_parser", "harness_prompt", "off_path", "doc_behaviour", "born_broken", "task_semantics",
            "inconsistent_request", "other_customer", "over_strict", "lenient", "forbidden_action"} <= kinds


def test_every_case_certifies_and_is_observed():
    async def main():
        async with Runtime() as rt:
            return await heldout_suite(rt)
    cases = anyio.run(main)
    s = summary(cases)
    assert s["observed"] == len(HELDOUT), [c.id for c in cases if not c.observed]
