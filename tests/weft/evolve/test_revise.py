"""Revision of the blamed component by LLM roles: a deliberately broken
synthesised backend repaired by the (scripted) LLM through the real sandboxed validation path; malformed
answers, failed calls and proposals that fail validation are recorded, never fatal, and never touch an
unblamed component."""
import json

import anyio
import pytest

from treadle.llm import LLMClient
from treadle.llm.fake_endpoint import FAKE_MODEL, Step, chat_reply
from treadle.weft.evolve.attribute import Blame, generate_verifier
from treadle.weft.evolve.loop import run_round
from treadle.weft.evolve.revise import REVISE_ROLES, LLMReviser, read_only_sql
from treadle.weft.evolve.synth_serve import server_source
from treadle.weft.runtime import Runtime

pytestmark = pytest.mark.usefixtures("sandbox")


def _rounds(fake_config, S, attempts, n=1):
    return S.revise_rounds(LLMClient(fake_config(*REVISE_ROLES.values())), attempts=attempts, n=n)


def _said(text):
    return Step(body=chat_reply(text, FAKE_MODEL))


def test_recorded_llm_repairs_the_broken_backend(S):
    """The recorded reviser answers (``fixtures/revise_recorded.jsonl``) replayed through the real loop and the
    sandboxed synthesis validation: the malformed and the still-broken answer are rejected, the fix accepted."""
    from treadle.llm import RecordedBackend

    [r], first, system = S.revise_rounds(LLMClient(S.revise_config(), backend=RecordedBackend(S.REVISE_FIXTURE)))
    assert r.blamed == r.revised == ["backend:library"] and r.untouched_ok
    assert [a.accepted for a in r.revisions] == [False, False, True]
    assert "SELECT status FROM books WHERE id = 1 gave [['in']], expected [['out']]" in r.revisions[1].detail
    assert system.synth["library"].result.backend.source == S.FIXED and r.revalidated == {"lend-emma": True,
                                                                                        "add-dune": True}
    assert sorted(c for c, d in system.digests().items() if first[c] != d) == ["backend:library"]


def test_a_broken_backend_is_repaired_by_the_llm_through_sandboxed_validation(fake, fake_config, S):
    fake.script = [_said("I would mark the book out in lend_book."),  # malformed: recorded, re-asked
                   _said(json.dumps({"source": S.BROKEN + "\n# looked at it\n"})),  # fails validation: re-asked
                   _said("```json\n" + json.dumps({"source": S.FIXED}) + "\n```")]
    (r1, r2), first, system = _rounds(fake_config, S, attempts=3, n=2)
    [att] = r1.attributions
    assert (att.checkpoint, att.blame, att.rule) == ("lend-emma", Blame.environment, "reference_differs")
    assert r1.blamed == r1.revised == ["backend:library"] and r1.untouched_ok
    assert [(a.component, a.role, a.accepted) for a in r1.revisions] == [("backend:library", "backend", False)] * 2 \
        + [("backend:library", "backend", True)]
    assert r1.revisions[0].detail.startswith("malformed answer")
    assert "validation failed: [backend]" in r1.revisions[1].detail
    assert "SELECT status FROM books WHERE id = 1 gave [['in']], expected [['out']]" in r1.revisions[1].detail
    asked = [json.loads(b["messages"][1]["content"]) for b in fake.bodies]
    assert asked[0]["current"]["source"] == S.BROKEN and asked[0]["evidence"][0]["checkpoint"] == "lend-emma"
    assert asked[0]["evidence"][0]["reference_diff"] and "previous_attempts_failed" not in asked[0]
    assert len(asked[2]["previous_attempts_failed"]) == 2  # each failure is fed back
    assert system.synth["library"].result.backend.source == S.FIXED
    assert system.sources["library"] == system.certified["library"]  # the same artefacts serve the same module
    assert r1.revalidated == {"lend-emma": True, "add-dune": True}  # what depends on the backend, re-validated
    changed = sorted(c for c, d in system.digests().items() if first[c] != d)
    assert changed == ["backend:library"]  # tasks and verifiers untouched
    assert r2.passed == r2.tasks == 2 and not r2.attributions and not r2.revisions and len(fake.requests) == 3


def test_failed_calls_and_malformed_answers_leave_the_component_as_it_was(fake, fake_config, S):
    fake.script = [Step(status=500), _said('{"code": "not the field asked for"}')]
    [r], first, system = _rounds(fake_config, S, attempts=2)
    assert r.blamed == ["backend:library"] and r.revised == [] and r.revalidated == {}
    assert [a.accepted for a in r.revisions] == [False, False]
    assert "backend call failed" in r.revisions[0].detail and r.revisions[1].detail.startswith("malformed answer")
    assert system.digests() == first and system.synth["library"].result.backend.source == S.BROKEN


def test_assertion_sql_must_be_read_only(S):
    from treadle.weft.evolve.synth_serve import initial_snapshot

    snap = initial_snapshot(server_source(S.result(), "library", limits=S.limits()))
    assert read_only_sql("SELECT status FROM books WHERE id = 1", snap) == ""
    for sql in ("DELETE FROM books", "ATTACH DATABASE '/tmp/x.db' AS x", "SELECT 1; DROP TABLE books",
                "PRAGMA writable_schema = 1", "SELECT * FROM nowhere"):
        assert read_only_sql(sql, snap), sql


def test_reviser_budget_is_checked():
    with pytest.raises(ValueError, match="attempts must be an int >= 1"):
        LLMReviser(None, attempts=0)


def _missing_rows(slot):
    """Rows of the certified start that the slot's (defective) start lacks: what a good grounder answers."""
    from treadle.weft.evolve.grounding import open_copy

    a, b = open_copy(slot.certified_start), open_copy(slot.start)
    try:
        tables = [t for (t,) in a.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                          "AND name NOT LIKE 'sqlite_%'")]
        out = {}
        for t in tables:
            rows = [list(r) for r in a.execute(f"SELECT * FROM {t} ORDER BY 1")]
            have = [list(r) for r in b.execute(f"SELECT * FROM {t} ORDER BY 1")]
            if [r for r in rows if r not in have]:
                out[t] = [r for r in rows if r not in have]
        return out
    finally:
        a.close()
        b.close()


def test_drill_task_and_verifier_revised_by_the_llm_native_backend_restored(fake, fake_config):
    """The offline drill with an LLM reviser: the task's missing entity and the verifier's wrong expected value are
    proposed by the (fake) LLM, each first answer fails its validation and is recorded; the native shop's
    trusted source is restored, never sent to an LLM."""
    import logging

    from treadle.weft.evolve.drill import EVALUATOR_DEFECT, TASK_DEFECT, drill_system

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)
    answers = {}

    def grounder_and_verifier(req):
        body = json.loads(req["messages"][1]["content"])
        first, second = answers[body["component"]]
        return second if "previous_attempts_failed" in body else first

    fake.responder = grounder_and_verifier

    async def main():
        async with Runtime() as rt, LLMClient(fake_config(*REVISE_ROLES.values())) as llm:
            system = await drill_system(rt)
            slots = {s.task.name: s for s in system.tasks}
            task, ver = slots[TASK_DEFECT], slots[EVALUATOR_DEFECT]
            answers[f"task:{TASK_DEFECT}"] = (json.dumps({"insert": {"nowhere": [[1]]}}),
                                              json.dumps({"insert": _missing_rows(task), "reason": "restored"}))
            right = generate_verifier(ver.task.checkpoint, ver.start, ver.evidence).expected_returns
            answers[f"verifier:{EVALUATOR_DEFECT}"] = (
                json.dumps({"assertions": [{"sql": "DELETE FROM contacts", "expected": []}]}),
                json.dumps({"expected_returns": right, "reason": "the reference's return"}))
            first = system.digests()
            reviser = LLMReviser(llm, attempts=2)
            r1 = await run_round(rt, system, 1, rates={"wrong_argument": 0.15}, k=2, reviser=reviser)
            r2 = await run_round(rt, system, 2, rates={}, reviser=reviser)
            return r1, r2, first, system, _missing_rows(task)
    r1, r2, first, system, still_missing = anyio.run(main)
    # the drill's composed faults are repaired from the certified composed task: no LLM asked for them
    composed = ["composed:ada-cycle/edges:crm:crm-resolve", "composed:ada-unbound-text/calls:crm:crm-credit"]
    assert r1.blamed == r1.revised == ["backend:shop", *composed, f"task:{TASK_DEFECT}",
                                       f"verifier:{EVALUATOR_DEFECT}"]
    assert sorted(c for c, d in system.digests().items() if first[c] != d) == r1.revised
    assert system.sources["shop"] == system.certified["shop"]
    components = [json.loads(b["messages"][1]["content"])["component"] for b in fake.bodies]
    assert sorted(components) == [f"task:{TASK_DEFECT}"] * 2 + [f"verifier:{EVALUATOR_DEFECT}"] * 2
    log = {(a.component, a.attempt): a for a in r1.revisions}
    assert "no table(s) ['nowhere']" in log[(f"task:{TASK_DEFECT}", 0)].detail
    assert "not a read-only query" in log[(f"verifier:{EVALUATOR_DEFECT}", 0)].detail
    assert log[(f"task:{TASK_DEFECT}", 1)].accepted and log[(f"verifier:{EVALUATOR_DEFECT}", 1)].accepted
    assert still_missing == {} and all(r1.revalidated.values())
    assert r2.error_rate == 0 and r2.passed == r2.tasks and not r2.revisions


def test_a_validation_that_raises_rejects_the_proposal_and_goes_on():
    from types import SimpleNamespace

    from treadle.weft.evolve.revise import StateRevision

    class Client:
        async def chat(self, messages, **kw):
            return SimpleNamespace(text='{"insert": {"t": [[1]]}}')

    async def check(value):
        raise RuntimeError("session creation failed")

    reviser = LLMReviser(Client(), attempts=2)
    got = anyio.run(lambda: reviser._propose("task:x", "task", "ask", {}, StateRevision, check))
    assert got is None and [a.detail for a in reviser.log] == ["validation raised RuntimeError: session creation "
                                                               "failed"] * 2
    assert [a.role for a in reviser.log] == ["grounder", "grounder"]
