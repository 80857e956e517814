"""A blamed harness is revised by the evolution loop, end to end through ``run_round``: the faulty harness is
restored to the certified one (or quarantined when there is none), the affected trajectories are re-run under a
healthy harness, and those failures stop counting against the policy."""
import logging

import anyio

from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.drill import drill_system
from treadle.weft.evolve.faults_heldout import ListDroppingHermes, LowercasingReAct
from treadle.weft.evolve.harness_revise import faulty_harnesses
from treadle.weft.evolve.loop import run_round
from treadle.weft.rollouts.harnesses import HermesHarness, NativeHarness, ReActHarness
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.callparse import parse_call

logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)


def _rounds(harnesses, n=2):
    async def main():
        async with Runtime() as rt:
            system = await drill_system(rt)
            system.harnesses = harnesses
            before = system.digests()
            out = [await run_round(rt, system, i + 1, rates={}) for i in range(n)]
            return out, before, system.digests(), system
    return anyio.run(main)


def test_a_faulty_primary_parser_is_restored_and_its_failures_rerun_under_a_healthy_harness():
    (r1, r2), before, after, system = _rounds({"hermes": ListDroppingHermes(), "react": ReActHarness(),
                                               "native": NativeHarness()})
    blamed = {a.checkpoint: (a.blame, a.rule) for a in r1.attributions}
    assert blamed["shop-place-order"] == (Blame.harness, "harness_format")  # its list argument is dropped
    assert "harness:hermes" in r1.blamed and "harness:hermes" in r1.revised and r1.untouched_ok
    assert type(system.harnesses["hermes"]) is HermesHarness and not r1.quarantined
    rerun = {r.checkpoint: r for r in r1.harness_reruns}
    assert rerun["shop-place-order"].r == 1 and rerun["shop-place-order"].harness == "hermes"
    assert "shop-place-order" not in r1.against_policy  # the harness's failure is not the policy's
    assert all(a.blame != Blame.harness for a in r2.attributions) and "harness:hermes" not in r2.revised
    assert sorted(c for c in after if after[c] != before[c] and c.startswith("harness:")) == ["harness:hermes"]


def test_a_faulty_harness_with_no_certified_version_is_quarantined():
    (r1, r2), before, after, system = _rounds({"custom": LowercasingReAct(), "hermes": HermesHarness()})
    assert any(a.blame == Blame.harness for a in r1.attributions)
    assert "harness:custom" in r1.blamed and "harness:custom" in r1.revised
    assert list(system.harnesses) == ["hermes"] and "reads back" in r1.quarantined["custom"]
    assert r1.harness_reruns and all(r.r == 1 and r.harness == "hermes" for r in r1.harness_reruns)
    assert not any(a.blame == Blame.harness for a in r2.attributions) and "harness:custom" not in after


def test_only_harnesses_that_cannot_carry_the_calls_are_faulty():
    gold = [parse_call('place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])')]
    found = faulty_harnesses({"hermes": HermesHarness(), "bad": ListDroppingHermes(), "react": ReActHarness()}, gold,
                             [])
    assert list(found) == ["bad"] and "reads back" in found["bad"][0]


def test_a_harness_blame_no_harness_check_confirms_revises_nothing():
    """An LLM attributor's ``harness`` with every harness carrying the reference calls: reported, nothing changed."""
    from types import SimpleNamespace

    from treadle.weft.envs import shop
    from treadle.weft.evolve.attribute import Attribution
    from treadle.weft.evolve.harness_revise import revise_harnesses
    from treadle.weft.evolve.loop import Round, default_harnesses

    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            gold = [parse_call('place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])')]
            slot = SimpleNamespace(env="shop", evidence=SimpleNamespace(calls=gold), task=SimpleNamespace(name="t"),
                                   spec=SimpleNamespace(name="t"))
            system = SimpleNamespace(harnesses=default_harnesses(), certified_harnesses=default_harnesses())
            rnd = Round(round=1, tool_calls=0, tool_errors=0, error_rate=0.0, passed=0, tasks=1)
            att = Attribution(checkpoint="t", blame=Blame.harness, rule="llm(fails_every_harness)")
            await revise_harnesses(rt, system, [(slot, att, 0)], {"shop": h}, rnd, replay=None, attribute=None)
            return rnd, system
    rnd, system = anyio.run(main)
    assert rnd.blamed == ["harness:hermes"] and not rnd.quarantined and not rnd.harness_reruns
    assert list(system.harnesses) == ["hermes", "react", "native"]
