"""The composer role: what the certified composed task cannot decide (a cycle among nodes the certified DAG does not
know) goes to an LLM, through recorded answers (``fixtures/composed_revise_recorded.jsonl``) and the real validation
path (only the undecided part may change; the result re-certifies by execution). A malformed answer and one touching
an unblamed part are recorded and fed back, never fatal.
Re-record with ``python tests/weft/evolve/test_composed_llm.py``.
"""
import json
import logging
import sys
from pathlib import Path

import anyio
import pytest
from treadle.llm import LLMClient, LLMConfig, RecordedBackend
from treadle.weft.envs import crm, shop
from treadle.weft.evolve import composed_revise as cr
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.compose import certify_composed, compose, propose_groups
from treadle.weft.evolve.loop import ComposedSlot, EvolvingSystem, run_round
from treadle.weft.evolve.revise import LLMReviser, undecided_parts
from treadle.weft.runtime import Runtime

FIXTURE = Path(__file__).parent / "fixtures" / "composed_revise_recorded.jsonl"
NOTE, ESC, RES, CREDIT, TICKET = "crm:crm-note", "crm:crm-escalate", "crm:crm-resolve", "crm:crm-credit", \
    "shop:shop-open-ticket"
LATE = "crm:crm-credit-late"
FIX = [TICKET, NOTE, ESC, RES]
ANSWERS = ["The credit should not wait for itself.",  # prose: malformed
           json.dumps({"depends_on": {NOTE: []}, "reason": "drop the note's edge"}),  # an unblamed part
           "```json\n" + json.dumps({"depends_on": {LATE: FIX}, "reason": "after the resolution"}) + "\n```"]


def _config():
    return LLMConfig.single("composed-recorded", "http://127.0.0.1:9/v1", roles=("composer",),
                            sampling={"temperature": 0.0, "max_tokens": 512})


def _hashes(rt):
    return {"shop": rt.register(shop), "crm": rt.register(crm)}


async def _certified(rt):
    import conftest

    bundles = await conftest.make_bundles(rt)
    ct = compose(bundles, propose_groups(bundles)["ada@example.com"], name="ada", persona=("Mary Jackson",
                 "mary@example.com"), lookalike=("Mary Jackman", "mary.jackman@example.com"))
    return await certify_composed(rt, ct, _hashes(rt))


def _late_cycle(certified):
    """The credit node renamed (a node the certified DAG does not know) and made to depend on itself: a cycle that
    the certified DAG cannot repair."""
    node = next(n for n in certified.nodes if n.name == CREDIT)
    deps = (*node.depends_on, LATE)
    late = node.model_copy(update={"name": LATE, "depends_on": deps, "atomic": node.atomic.model_copy(
        update={"name": LATE, "depends_on": deps})})
    return certified.model_copy(update={"name": "ada-late", "nodes": tuple(late if n.name == CREDIT else n
                                                                             for n in certified.nodes)})


class _Scripted:
    recorded = False

    def __init__(self, answers):
        self.answers = list(answers)

    async def send(self, cfg, kind, payload, key):
        return {"id": "x", "object": "chat.completion", "model": cfg.model, "usage": {"prompt_tokens": 1,
                "completion_tokens": 1, "total_tokens": 2}, "choices": [{"index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": self.answers.pop(0)}}]}

    async def probe(self, cfg):
        return None

    async def aclose(self):
        return None


def _revise(client, attempts=3):
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

    async def main():
        async with Runtime() as rt, client as llm:
            certified = await _certified(rt)
            bad = _late_cycle(certified)
            verdicts = await cr.attribute_composed(rt, bad, certified, _hashes(rt), None)
            reviser = LLMReviser(llm, attempts=attempts)
            new = await reviser.composed(rt, _hashes(rt), bad, certified, verdicts)
            return certified, bad, verdicts, new, reviser.log
    return anyio.run(main)


@pytest.fixture(scope="module")
def revised():
    sys.path.insert(0, str(Path(__file__).parent))
    return _revise(LLMClient(_config(), backend=RecordedBackend(FIXTURE)))


def test_the_deterministic_path_leaves_the_cycle_undecided(revised):
    certified, bad, verdicts, _, _ = revised
    [v] = verdicts
    assert v.fault is None and v.attribution.blame == Blame.undecided and v.attribution.rule == "composed_cycle"
    assert undecided_parts(bad, certified, verdicts) == [f"edges:{LATE}"]
    assert cr.revise_composed(bad, certified, []) == bad  # nothing the certified task can repair


def test_recorded_answers_malformed_and_unblamed_are_rejected_then_the_repair_is_accepted(revised):
    _, bad, _, new, log = revised
    assert [(a.attempt, a.accepted) for a in log] == [(0, False), (1, False), (2, True)]
    assert all(a.role == "composer" and a.component == "composed:ada-late" for a in log)
    assert log[0].detail.startswith("malformed answer") and log[0].answer == ANSWERS[0]
    assert log[1].detail.startswith(f"the answer changes ['edges:{NOTE}'], which are not blamed")
    assert new is not None and next(n for n in new.nodes if n.name == LATE).depends_on == tuple(FIX)
    before, after = cr.component_digests(bad), cr.component_digests(new)
    assert sorted(k for k in before if before[k] != after[k]) == [f"edges:{LATE}"]  # nothing else changed


def test_a_revision_that_does_not_certify_is_refused_and_nothing_is_lost():
    sys.path.insert(0, str(Path(__file__).parent))
    # still a cycle (the late credit after itself and the resolution)
    answers = [json.dumps({"depends_on": {LATE: [RES, LATE]}})]
    *_, new, log = _revise(LLMClient(_config(), backend=_Scripted(answers)), attempts=1)
    assert new is None and [a.accepted for a in log] == [False]
    assert log[0].detail.startswith("the revised composed task does not certify") and "cycle" in log[0].detail


def test_the_loop_sends_only_the_undecided_part_to_the_composer_and_without_the_role_records_it():
    sys.path.insert(0, str(Path(__file__).parent))
    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)

    def one_round(config, answers):
        async def main():
            async with Runtime() as rt, LLMClient(config, backend=_Scripted(answers)) as llm:
                certified = await _certified(rt)
                src = {"shop": __import__("inspect").getsource(shop), "crm": __import__("inspect").getsource(crm)}
                system = EvolvingSystem(sources=dict(src), certified=dict(src), tasks=[], composed=[
                    ComposedSlot(task=_late_cycle(certified),
                                 certified=certified.model_copy(update={"name": "ada-late"}))])
                first = system.digests()
                r = await run_round(rt, system, 1, rates={}, reviser=LLMReviser(llm, attempts=1))
                return r, first, system.digests(), system
        return anyio.run(main)

    r, first, last, system = one_round(_config(), [ANSWERS[2]])
    assert r.blamed == r.revised == [f"composed:ada-late/edges:{LATE}"] and r.untouched_ok
    assert sorted(k for k in first if first[k] != last[k]) == r.revised
    assert [(a.component, a.accepted) for a in r.revisions] == [("composed:ada-late", True)]
    assert r.revalidated == {"composed:ada-late": True} and system.composed[0].version == 2
    assert r.attributions[0].checkpoint == "ada-late" and r.attributions[0].rule == "composed_cycle"
    # a config without the composer role: the request is recorded as not made, the task left exactly as it was
    r, first, last, system = one_round(LLMConfig.single("m", "http://127.0.0.1:9/v1", roles=("grounder",)), [])
    assert r.revised == [] and first == last and r.revalidated == {"composed:ada-late": False}
    [a] = r.revisions
    assert not a.accepted and a.detail.startswith("not asked: no role 'composer'")


def record():
    """Write FIXTURE from ANSWERS (the scripted composer), through the same requests the tests replay."""
    FIXTURE.unlink(missing_ok=True)
    backend = _Scripted(ANSWERS)
    *_, new, log = _revise(LLMClient(_config(), backend=backend, record_to=FIXTURE))
    assert not backend.answers and new is not None, log


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    record()
