"""Per-task rubrics and the rubric-guided LLM judge against a fake OpenAI-compatible endpoint (a real HTTP server on
127.0.0.1, treadle.llm's test fixture), feeding RL task filtering; malformed answers and endpoint failures are
recorded, never fatal."""
import asyncio
import json

import pytest

from treadle.llm import LLMClient
from treadle.llm.fake_endpoint import FAKE_MODEL, Step, chat_reply
from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.evolve.filtering import FilterConfig, filter_tasks
from treadle.weft.evolve.judge import Pilot, Rubric, judge, pilot_scores, pilots_of, rubric_of
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.verify import CheckpointSpec


def _answer(text):
    return Step(body=chat_reply(text, FAKE_MODEL))


@pytest.fixture
def run(fake_config):
    """``run(fn)``: ``await fn(client)`` with a client whose role 'judge' is the shared fake endpoint."""
    def go(fn):
        async def main():
            async with LLMClient(fake_config("judge")) as client:
                return await fn(client)
        return asyncio.run(main())
    return go


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


def test_judge_grades_against_the_rubric_without_the_verdict(fake, run):
    fake.script = [_answer('```json\n{"scores": [1, 0.5, 1], "reason": "shipped"}\n```')]
    js = run(lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT))
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
def test_a_malformed_answer_or_failed_call_is_recorded(fake, run, step, error):
    fake.script = [step]
    js = run(lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT))
    assert js.score is None and error in js.error


def test_judge_refuses_a_role_that_is_not_configured(fake, run):
    with pytest.raises(ValueError, match="role 'grader'"):
        run(lambda c: judge(c, rubric_of(SHIP), TRANSCRIPT, role="grader"))
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


def test_pilot_scores_feed_the_filter(fake, run):
    fake.script = [Step(body=_fake_judge) for _ in range(24)]
    rubrics = [Rubric(task=t, request="x", criteria=rubric_of(SHIP).criteria)
               for t in ("agree", "disagree", "malformed")]
    scores, graded = run(lambda c: pilot_scores(c, rubrics, _pilots()))
    assert len(graded) == 24 and sum(g.score is None for g in graded) == 1
    assert scores["agree"] == ([0.0, 1.0] * 4, [0.0, 1.0] * 4) and scores["disagree"][0] == [1.0, 0.0] * 4
    d = {x.task: x for x in filter_tasks(scores, FilterConfig(n_resamples=99))}
    assert d["agree"].kept and d["agree"].pearson == pytest.approx(1.0)
    assert not d["disagree"].kept and d["disagree"].to_attribution and d["disagree"].pearson == pytest.approx(-1.0)
    assert not d["malformed"].kept and d["malformed"].reasons[0].startswith("malformed scores: judge score #3 is None")
    with pytest.raises(ValueError, match=r"no rubric for task\(s\) \['agree'\]"):
        run(lambda c: pilot_scores(c, rubrics[1:], _pilots()))


def test_pilots_come_from_rollout_attempts(tmp_path):
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.tasks import from_shop

    trs = sample(tmp_path, from_shop()[:1], SampleConfig(policy=Component(
        name="replay", args={"rates": {"wrong_argument": 0.3}, "seed": 0}), ks=(3,)))
    pilots = pilots_of(trs)
    attempts = [a for t in trs for a in t.attempts]
    assert [(p.task, p.r, p.messages) for p in pilots] == [(a.atomic, a.r, a.messages) for a in attempts]
    assert {p.r for p in pilots} == {0, 1}  # failed attempts are pilots too: the filter needs both


@pytest.fixture(scope="module")
def pilot_run(tmp_path_factory):
    """A `treadle weft sample` run of the shop tasks by the replay policy (wrong arguments at rate 0.5)."""
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.tasks import from_shop

    d = tmp_path_factory.mktemp("pilots")
    trs = sample(d, from_shop(), SampleConfig(policy=Component(name="replay", args={
        "rates": {"wrong_argument": 0.5}, "seed": 0}), ks=(3, 4, 5, 6), methods=("prefix", "end_to_end")))
    return d, pilots_of(trs)


def _cli_judge(pilots):
    """A fake judge that knows each transcript's executable verdict: agrees on every task, but inverts it on
    ada-2-order and answers prose to the first alan-1-cancel pilot."""
    from treadle.weft.evolve.judge import _transcript
    from treadle.weft.rollouts.tasks import from_shop

    truth = {json.dumps(_transcript(p.messages), sort_keys=True, default=str): p.r for p in pilots}
    task_of = {a.request: a.name for t in from_shop() for a in t.atomic}
    seen = set()

    def answer(req):
        body = json.loads(req["messages"][1]["content"])
        task = task_of[body["request"]]
        good = truth[json.dumps(body["transcript"], sort_keys=True)] == 1
        if task == "alan-1-cancel" and task not in seen:
            seen.add(task)
            return "The agent seems to have done fine."
        if task == "ada-2-order":
            good = not good
        return json.dumps({"scores": [1.0 if good else 0.0] * len(body["rubric"]), "reason": "."})
    return answer


def test_cli_judges_pilots_and_filters(fake, pilot_run, tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    run_dir, pilots = pilot_run
    fake.responder = _cli_judge(pilots)
    cfg = tmp_path / "llm.toml"
    cfg.write_text(f'[roles.judge]\nmodel = "{FAKE_MODEL}"\nbase_url = "{fake.base_url}"\nmax_retries = 0\n')
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["weft", "judge", "--run", str(run_dir), "--llm-config", str(cfg), "--out", str(out),
                                 "--min-rollouts", "8"])
    assert r.exit_code == 0, r.output
    assert len(fake.requests) == len(pilots)  # one judge call per pilot rollout
    d = {x["task"]: x for x in map(json.loads, (out / "filter.jsonl").read_text().splitlines())}
    assert d["ada-1-lookup"]["kept"] and d["alan-2-ticket"]["kept"] and d["ada-1-lookup"]["pearson"] == pytest.approx(1)
    assert not d["ada-2-order"]["kept"] and d["ada-2-order"]["to_attribution"]
    assert d["ada-2-order"]["pearson"] == pytest.approx(-1) and d["ada-2-order"]["spearman"] == pytest.approx(-1)
    assert d["alan-1-cancel"]["reasons"][0].startswith("malformed scores: judge score #0 is None")
    assert d["ada-4-bye"]["reasons"] == ["constant executable scores: correlation undefined"]
    lo, hi = d["alan-2-ticket"]["pearson_ci"]
    assert lo <= d["alan-2-ticket"]["pearson"] <= hi
    rows = [json.loads(x) for x in (out / "judge-scores.jsonl").read_text().splitlines()]
    assert len(rows) == len(pilots) and sum(x["error"] is not None for x in rows) == 1
    assert "kept 2 of 6 tasks" in r.output and "1 malformed or failed judge answers" in r.output
    # the recorded scores filter again offline, to the same decisions
    r2 = CliRunner().invoke(app, ["weft", "filter", "--scores", str(out / "judge-scores.jsonl"),
                                  "--out", str(tmp_path / "again")])
    assert r2.exit_code == 0, r2.output
    again = (tmp_path / "again" / "filter.jsonl").read_text().splitlines()  # --out is a run folder
    again = {x["task"]: x["kept"] for x in map(json.loads, again)}
    assert again == {t: x["kept"] for t, x in d.items()}


def test_cli_without_an_endpoint_says_so_and_exits_2(pilot_run, tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    run_dir, _ = pilot_run
    r = CliRunner().invoke(app, ["weft", "judge", "--run", str(run_dir), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert r.output.startswith("Error: --llm-config:") and "needs an OpenAI-compatible endpoint" in r.output
    r = CliRunner().invoke(app, ["weft", "judge", "--run", str(tmp_path), "--llm-config", str(tmp_path / "x.toml")])
    assert r.exit_code == 2 and r.output.startswith("Error: --run:")
    cfg = tmp_path / "llm.toml"
    cfg.write_text('[roles.policy]\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')
    r = CliRunner().invoke(app, ["weft", "judge", "--run", str(run_dir), "--llm-config", str(cfg),
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.startswith("Error: --role: no role 'judge'")
    other = tmp_path / "other-run"  # a run of tasks this command has no rubric for
    other.mkdir()
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    (other / "trajectories.jsonl").write_text("".join(json.dumps({**json.loads(x), "env": "composed:x"}) + "\n"
                                                      for x in lines))
    cfg.write_text('[roles.judge]\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')
    r = CliRunner().invoke(app, ["weft", "judge", "--run", str(other), "--llm-config", str(cfg),
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.output.startswith("Error: --run: no task of this run is known here")
    assert not (tmp_path / "o").exists()
