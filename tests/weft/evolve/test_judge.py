"""Per-task rubrics and the rubric-guided LLM judge against a fake OpenAI-compatible endpoint (a real HTTP server on
127.0.0.1, treadle.llm's test fixture), feeding RL task filtering; malformed answers and endpoint failures are
recorded, never fatal."""
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from treadle.llm import LLMClient, LLMConfig
from treadle.weft.callparse import ToolCall
from treadle.weft.evolve.filtering import FilterConfig, filter_tasks
from treadle.weft.evolve.judge import Pilot, Rubric, judge, pilot_scores, pilots_of, rubric_of
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.verify import CheckpointSpec

_spec = importlib.util.spec_from_file_location("_treadle_llm_conftest",
                                               Path(__file__).parents[2] / "llm" / "conftest.py")
_llm_fixtures = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_llm_fixtures)
FakeEndpoint, Step, FAKE_MODEL = _llm_fixtures.FakeEndpoint, _llm_fixtures.Step, _llm_fixtures.FAKE_MODEL


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def _answer(text):
    return Step(body={"model": FAKE_MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                                        "message": {"role": "assistant", "content": text}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def _run(fake, fn):
    cfg = LLMConfig.single(FAKE_MODEL, fake.base_url, roles=("judge",), max_retries=0, backoff_s=0.01, timeout_s=5.0)

    async def go():
        async with LLMClient(cfg) as client:
            return await fn(client)
    return asyncio.run(go())


SHIP = AtomicTask(name="ship-2", request="Ship order 2.", checkpoint=CheckpointSpec(
    name="ship-2", gold_calls=[ToolCall(name="ship_order", arguments={"order_id": 2})]))
DECLINE = AtomicTask(name="sort-later", request="Sort the report.", checkpoint=CheckpointSpec(name="sort-later",
                                                                                              gold_calls=[]))
TRANSCRIPT = ({"role": "system", "content": "secret instructions"}, {"role": "user", "content": "Ship order 2."},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "a", "type": "function", "function": {"name": "ship_order", "arguments": '{"order_id": 2}'}}]},
              {"role": "tool", "tool_call_id": "a", "content": '{"status": "shipped"}'},
              {"role": "assistant", "content": "Order 2 is shipped."})


def test_rubrics_come_from_the_task():
    r = rubric_of(SHIP)
    assert [c.text for c in r.criteria] == [
        "The agent does what the user asked, exactly as asked: 'Ship order 2.'",
        "The agent calls ship_order(order_id=2), or a call with the same effect, and it succeeds.",
        "The reply to the user reports what was done truthfully: no claimed action that the tool results do not "
        "show, no invented values."]
    assert [c.weight for c in r.criteria] == [2.0, 1.0, 1.0]
    assert "makes no tool call that changes anything" in rubric_of(DECLINE).criteria[1].text
    with pytest.raises(TypeError, match="AtomicTask"):
        rubric_of("ship-2")


def test_judge_grades_against_the_rubric_without_the_verdict(fake):
    fake.script = [_answer('```json\n{"scores": [1, 0.5, 1], "reason": "shipped"}\n```')]
    js = _run(fake, lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT))
    assert js.error is None and js.scores == (1.0, 0.5, 1.0) and js.reason == "shipped"
    assert js.score == pytest.approx((2 * 1 + 0.5 + 1) / 4)
    (_, _, req), = fake.requests
    body = json.loads(req["messages"][1]["content"])
    assert body["rubric"] == [c.text for c in rubric_of(SHIP).criteria] and body["request"] == "Ship order 2."
    assert body["transcript"][1]["tool_calls"] == [{"name": "ship_order", "arguments": '{"order_id": 2}'}]
    assert "secret instructions" not in req["messages"][1]["content"]  # system text is not the agent's doing
    assert '"r"' not in req["messages"][1]["content"] and "checkpoint" not in req["messages"][1]["content"]


@pytest.mark.parametrize("step, error", [
    (_answer("Looks good to me!"), "malformed judge answer"),
    (_answer('{"scores": [1, 1]}'), "2 scores for 3 criteria"),
    (_answer('{"scores": [1, 2, 1]}'), "score #1 is 2"),
    (_answer('{"scores": [1, "yes", 1]}'), "score #1 is 'yes'"),
    (_answer('[1, 1, 1]'), 'a "scores" list'),
    (Step(status=500), "judge call failed"),
])
def test_a_malformed_answer_or_failed_call_is_recorded(fake, step, error):
    fake.script = [step]
    js = _run(fake, lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT))
    assert js.score is None and error in js.error


def test_judge_refuses_a_role_that_is_not_configured(fake):
    with pytest.raises(ValueError, match="role 'grader'"):
        _run(fake, lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT, role="grader"))
    assert fake.requests == []


def _pilots():
    """Eight pilots each of three tasks, executable r alternating 1, 0; the transcript says which."""
    out = []
    for task in ("agree", "disagree", "malformed"):
        for i in range(8):
            r = i % 2
            out.append(Pilot(task=task, r=r, messages=({"role": "user", "content": f"{task} pilot {i}"},
                                                       {"role": "assistant", "content": "done" if r else "failed"})))
    return out


def _fake_judge(req):
    """Agrees with the transcript on 'agree', inverts it on 'disagree', answers prose on 'malformed' pilot 3."""
    body = json.loads(req["messages"][1]["content"])
    said = body["transcript"][-1]["content"]
    who = body["transcript"][0]["content"]
    good = said == "done"
    if who.startswith("disagree"):
        good = not good
    if who == "malformed pilot 3":
        text = "I think it went fine."
    else:
        text = json.dumps({"scores": [1.0 if good else 0.0] * len(body["rubric"]), "reason": "."})
    return {"model": FAKE_MODEL, "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}], "usage": {}}


def test_pilot_scores_feed_the_filter(fake):
    fake.script = [Step(body=_fake_judge) for _ in range(24)]
    rubrics = [Rubric(task=t, request="x", criteria=rubric_of(SHIP).criteria)
               for t in ("agree", "disagree", "malformed")]
    scores, graded = _run(fake, lambda c: pilot_scores(c, rubrics, _pilots()))
    assert len(graded) == 24 and sum(g.score is None for g in graded) == 1
    assert scores["agree"] == ([0.0, 1.0] * 4, [0.0, 1.0] * 4) and scores["disagree"][0] == [1.0, 0.0] * 4
    d = {x.task: x for x in filter_tasks(scores, FilterConfig(n_resamples=99))}
    assert d["agree"].kept and d["agree"].pearson == pytest.approx(1.0)
    assert not d["disagree"].kept and d["disagree"].to_attribution and d["disagree"].pearson == pytest.approx(-1.0)
    assert not d["malformed"].kept and d["malformed"].reasons[0].startswith("malformed scores: judge score #3 is None")
    with pytest.raises(ValueError, match=r"no rubric for task\(s\) \['agree'\]"):
        _run(fake, lambda c: pilot_scores(c, rubrics[1:], _pilots()))


def test_pilots_come_from_rollout_attempts(tmp_path):
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.tasks import from_shop

    trs = sample(tmp_path, from_shop()[:1], SampleConfig(policy=Component(
        name="replay", args={"rates": {"wrong_argument": 0.3}, "seed": 0}), ks=(3,)))
    pilots = pilots_of(trs)
    attempts = [a for t in trs for a in t.attempts]
    assert [(p.task, p.r, p.messages) for p in pilots] == [(a.atomic, a.r, a.messages) for a in attempts]
    assert {p.r for p in pilots} == {0, 1}  # failed attempts are pilots too: the filter needs both
