"""Deterministic attribution: each rule on hand-built cases, and the native fault-injection suite."""
import inspect
import json

import anyio
import pytest

from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
from treadle.weft.evolve.attribute import Blame, attribute, generate_verifier, record_evidence
from treadle.weft.evolve.certify import certify_server
from treadle.weft.evolve.faults import (
    SHOP_BUGS,
    corrupt_verifier,
    delete_entity,
    native_suite,
    patch_source,
    perturbed_calls,
    report,
)
from treadle.weft.runtime import Runtime


def _task(name):
    return {t.name: t for t in shop_atomic.candidates()}[name]


async def _judge(rt, h, start, spec, calls):
    sid = await rt.create_session(h, start)
    try:
        outs = [await rt.call_tool(sid, c.name, c.arguments) for c in calls]
        return outs, await rt.verify_turn(sid, start, spec, outs)
    finally:
        await rt.close(sid)


def _attribute_one(task_name, *, bug=None, defect=False, corrupt=None, calls=None, **kw):
    task = _task(task_name)

    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            start = shop.initial_snapshot()
            gold = list(task.checkpoint.gold_calls)
            ev = await record_evidence(rt, h, start, task.name, gold)
            spec = generate_verifier(task.checkpoint, start, ev)
            run_h, run_start, run_spec = h, start, spec
            if bug is not None:
                run_h = rt.register(patch_source(inspect.getsource(shop), bug))
            if defect:
                tools = {t["name"]: t for t in rt.registry.spec(h).tools}
                run_start = delete_entity(start, "shop", tools, gold)[0]
            if corrupt:
                run_spec = corrupt_verifier(spec, corrupt)
            outs, verdict = await _judge(rt, run_h, run_start, run_spec, calls if calls is not None else gold)
            assert verdict.r == 0, verdict
            return await attribute(rt, run_h, run_start, run_spec, ev, outs, verdict, **kw)
    return anyio.run(main)


def test_environment_bug_that_does_not_persist():
    a = _attribute_one("shop-ship-order", bug=SHOP_BUGS[0])
    assert (a.blame, a.rule) == (Blame.environment, "reference_differs")
    assert a.reference_diff == {"orders": {"added": 0, "removed": 0, "changed": 1}}
    assert a.span == ["get_order(order_id=2)", "ship_order(order_id=2)"] and a.check


def test_environment_wrong_return_and_crash():
    assert _attribute_one("shop-place-order", bug=SHOP_BUGS[1]).rule == "reference_differs"
    a = _attribute_one("shop-ship-order", bug=SHOP_BUGS[4])
    assert (a.blame, a.rule) == (Blame.environment, "reference_fails") and "get_order" in a.detail


def test_task_defect_missing_entity():
    a = _attribute_one("shop-cancel-order", defect=True)
    assert (a.blame, a.rule) == (Blame.task, "precondition") and "alan@example.com" in a.detail


@pytest.mark.parametrize("how", ["wrong_expected_value", "wrong_expected_return", "wrong_gold_argument"])
def test_evaluator_defects(how):
    a = _attribute_one("shop-cancel-order", corrupt=how)
    assert (a.blame, a.rule) == (Blame.evaluator, "reference_rejected")


def test_policy_mistake_and_the_cross_signals():
    calls = perturbed_calls(_task("shop-cancel-order"), "wrong_argument", seed=0)
    assert calls != list(_task("shop-cancel-order").checkpoint.gold_calls)
    a = _attribute_one("shop-cancel-order", calls=calls)
    assert (a.blame, a.rule) == (Blame.policy, "reference_passes")
    a = _attribute_one("shop-cancel-order", calls=calls, rubric_pass=True)
    assert (a.blame, a.rule) == (Blame.evaluator, "rubric_disagrees")
    a = _attribute_one("shop-cancel-order", calls=calls, harness_verdicts={"hermes": 0, "react": 0, "native": 0})
    assert (a.blame, a.rule) == (Blame.undecided, "fails_every_harness")
    a = _attribute_one("shop-cancel-order", calls=calls, harness_verdicts={"hermes": 0, "react": 1, "native": 1})
    assert (a.blame, a.rule) == (Blame.policy, "interaction_adaptation")


def test_a_flaky_verifier_that_fails_the_reference_behaviour_is_the_evaluators():
    seen = []

    def flaky(db):
        seen.append(1)
        return len(seen) > 1  # fails only its first use

    task = _task("shop-ship-order")

    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            start = shop.initial_snapshot()
            gold = list(task.checkpoint.gold_calls)
            ev = await record_evidence(rt, h, start, task.name, gold)
            spec = task.checkpoint.model_copy(update={"predicates": [flaky]})
            outs, verdict = await _judge(rt, h, start, spec, gold)
            return await attribute(rt, h, start, spec, ev, outs, verdict)
    a = anyio.run(main)
    assert (a.blame, a.rule) == (Blame.evaluator, "reproduces_reference")


def test_passed_checkpoint_is_refused():
    task = _task("shop-ship-order")

    async def main():
        async with Runtime() as rt:
            h = rt.register(shop)
            start = shop.initial_snapshot()
            gold = list(task.checkpoint.gold_calls)
            ev = await record_evidence(rt, h, start, task.name, gold)
            outs, verdict = await _judge(rt, h, start, task.checkpoint, gold)
            with pytest.raises(ValueError, match="only failed checkpoints"):
                await attribute(rt, h, start, task.checkpoint, ev, outs, verdict)
    anyio.run(main)


def test_patch_target_must_occur_once():
    with pytest.raises(ValueError, match="occurs 0 times"):
        patch_source("x = 1\n", SHOP_BUGS[0])


def test_native_fault_suite_meets_the_target():
    async def main():
        async with Runtime() as rt:
            envs = []
            for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
                rep = await certify_server(rt, rt.register(mod), mod.initial_snapshot(), cands)
                envs.append((mod, rep.kept))
            return report(await native_suite(rt, envs))
    r = anyio.run(main)
    assert {c.label.value for c in r.observed} == {"policy", "environment", "task", "evaluator"}
    assert sum(sum(v.values()) for v in r.confusion.values()) == len(r.observed) >= 60
    assert r.accuracy >= 0.95
    assert [c.id for c in r.observed if not c.correct] == []
    [nested] = [c for c in r.observed if c.id == "shop/shop-place-order/task:missing-nested"]
    assert nested.attribution.rule == "precondition" and "products" in nested.attribution.detail


def test_llm_attributor_decides_only_what_the_deterministic_path_left(tmp_path):
    """A strict scripted model (fails on an unexpected call): one good answer, one malformed, one refused call."""
    from treadle.llm import LLMClient, LLMConfig
    from treadle.weft.evolve.attribute import Attribution, llm_attribute

    answers = ['{"blame": "task", "reason": "the request never names the order"}', "I think the task", "FAIL"]

    class Scripted:
        recorded = False

        async def send(self, cfg, kind, payload, key):
            text = answers.pop(0)
            if text == "FAIL":
                from treadle.llm import BadResponseError
                raise BadResponseError("response has no choices")
            body = json.loads(payload["messages"][1]["content"])
            assert body["evidence"]["rule"] == "fails_every_harness" and body["evidence"]["span"]
            return {"id": "x", "object": "chat.completion", "model": cfg.model, "usage": {},
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}]}

        async def probe(self, cfg):
            return None

        async def aclose(self):
            return None

    undecided = Attribution(checkpoint="c", blame=Blame.undecided, rule="fails_every_harness", span=["f(x=1)"])
    decided = undecided.model_copy(update={"blame": Blame.policy, "rule": "reference_passes"})

    async def main():
        cfg = LLMConfig.single("scripted", "http://127.0.0.1:9/v1", roles=("attributor",), max_retries=0)
        async with LLMClient(cfg, backend=Scripted()) as llm:
            same = await llm_attribute(llm, decided)  # never asks
            return same, [await llm_attribute(llm, undecided) for _ in range(3)]
    same, (good, malformed, failed) = anyio.run(main)
    assert same == decided
    assert (good.blame, good.rule, good.detail) == (Blame.task, "llm(fails_every_harness)",
                                                    "the request never names the order")
    assert good.llm["answer"].startswith('{"blame"')
    assert malformed.blame == Blame.undecided and malformed.llm["error"].startswith("malformed")
    assert failed.blame == Blame.undecided and "error" in failed.llm and not answers
