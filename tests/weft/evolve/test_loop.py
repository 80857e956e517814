"""The evolution loop on the offline drill: only blamed components are revised, the error rate falls, then stops."""
import logging

import anyio
import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.drill import ENV_BUG, EVALUATOR_DEFECT, TASK_DEFECT, drill_system
from treadle.weft.evolve.loop import evolve, run_round
from treadle.weft.runtime import Runtime

RATES = {"wrong_argument": 0.15}


@pytest.fixture(scope="module")
def rounds_and_digests():
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

    async def main():
        async with Runtime() as rt:
            system = await drill_system(rt)
            first = system.digests()
            rounds = await evolve(rt, system, rates=RATES, max_rounds=5, k=2)
            return rounds, first, system.digests(), system
    return anyio.run(main)


def test_each_injected_fault_is_blamed_and_only_it_is_revised(rounds_and_digests):
    rounds, first, last, system = rounds_and_digests
    r1 = rounds[0]
    blame = {a.checkpoint: a.blame for a in r1.attributions}
    assert blame[TASK_DEFECT] == Blame.task and blame[EVALUATOR_DEFECT] == Blame.evaluator
    assert blame["shop-ship-order"] == Blame.environment  # get_order crashes under it
    assert r1.blamed == r1.revised == ["backend:shop", f"task:{TASK_DEFECT}", f"verifier:{EVALUATOR_DEFECT}"]
    assert all(r.untouched_ok for r in rounds)
    changed = sorted(c for c in first if first[c] != last[c])
    assert changed == r1.revised  # nothing else changed over all rounds
    assert all(r1.revalidated.values()) and "shop-place-order" in r1.revalidated  # every shop task re-validated
    assert "crm-credit" not in r1.revalidated  # untouched components are not re-validated
    assert ENV_BUG not in system.sources["shop"] and system.sources["shop"] == system.certified["shop"]


def test_error_rate_falls_then_the_loop_stops(rounds_and_digests):
    rounds = rounds_and_digests[0]
    rates = [r.error_rate for r in rounds]
    assert rates[1] < rates[0] and rates[-1] >= rates[-2] and len(rounds) == 3
    later = [a.blame for r in rounds[1:] for a in r.attributions]
    assert later and set(later) == {Blame.policy}  # what remains is the policy's, and it revises nothing
    assert rounds[1].revised == [] and rounds[0].passed < rounds[1].passed == rounds[0].tasks - len(rounds[1].attributions)


def test_a_clean_policy_on_a_repaired_system_fails_nothing():
    async def main():
        async with Runtime() as rt:
            system = await drill_system(rt)
            await run_round(rt, system, 1, rates=RATES)
            return await run_round(rt, system, 2, rates={})
    r = anyio.run(main)
    assert r.error_rate == 0 and r.passed == r.tasks and not r.attributions


def test_cli_bad_rate_and_budget(tmp_path):
    for args in (["--rate", "wrong_argument"], ["--rate", "melt=0.1"], ["--rate", "wrong_argument=1.5"]):
        res = CliRunner().invoke(app, ["weft", "evolve", "--out", str(tmp_path / "o"), *args])
        assert res.exit_code == 2 and "--rate" in res.output, res.output
    with pytest.raises(ValueError, match="max_rounds"):
        anyio.run(lambda: evolve(None, None, rates={}, max_rounds=0))
    assert not (tmp_path / "o").exists()
