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
    assert {c.label for c in r.observed} == {Blame.policy, Blame.environment, Blame.evaluator}
    assert r.accuracy >= 0.95
    crash = [c for c in r.observed if c.fault.endswith(":crash")]
    assert crash and all(c.attribution.rule == "reference_fails" for c in crash)


def test_unknown_bug_kind_is_refused():
    with pytest.raises(ValueError, match="unknown bug kind"):
        bug_source("", "C", "m", "melt")
