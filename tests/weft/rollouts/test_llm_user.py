"""The LLM-persona user simulator (``simuser-llm``) against a fake OpenAI-compatible endpoint (a real HTTP
server on 127.0.0.1, treadle.llm's test fixture): it sees only disclosed details, never decides completion,
and an endpoint failure is a recorded rollout failure, never a crashed batch."""
import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from treadle.llm import LLMClient, LLMConfig
from treadle.weft.rollouts.batch import Component, SampleConfig, sample_async
from treadle.weft.rollouts.policies import ReplayPolicy
from treadle.weft.rollouts.registry import POLICIES
from treadle.weft.rollouts.tasks import from_shop
from treadle.weft.rollouts.views import LLMUserView

_spec = importlib.util.spec_from_file_location("_treadle_llm_conftest",
                                               Path(__file__).parents[2] / "llm" / "conftest.py")
_llm_fixtures = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(_llm_fixtures)
FakeEndpoint, Step, FAKE_MODEL = _llm_fixtures.FakeEndpoint, _llm_fixtures.Step, _llm_fixtures.FAKE_MODEL


def _user_says(req):
    """The fake user LLM: a message numbered by how many it has written (tells requests apart)."""
    n = _user_says.n = getattr(_user_says, "n", 0) + 1
    return {"model": req["model"], "choices": [{"index": 0, "finish_reason": "stop",
                                                "message": {"role": "assistant", "content": f'"user message {n}"'}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@pytest.fixture
def fake():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def _cfg(fake, **kw):
    kw.setdefault("max_retries", 0)
    return LLMConfig.single(FAKE_MODEL, fake.base_url, roles=("user",), backoff_s=0.01, timeout_s=5.0, **kw)


def _run(fake, run_dir, tasks, cfg, llm_cfg=None):
    async def go():
        async with LLMClient(llm_cfg or _cfg(fake)) as client:
            return await sample_async(run_dir, tasks, cfg, client=client)
    return asyncio.run(go())


def test_llm_user_writes_the_requests_and_sees_only_disclosed_details(fake, tmp_path):
    fake.script = [Step(body=_user_says) for _ in range(20)]
    cfg = SampleConfig(view=Component(name="simuser-llm", args={"persona": "A retired sailor."}))
    trs = _run(fake, tmp_path, from_shop("vague"), cfg)
    assert len(trs) == 2 and all(t.accepted and t.failure is None for t in trs)  # the checkpoints decide
    users = [m["content"] for t in trs for m in t.messages if m["role"] == "user"]
    assert len(users) == 6 and all(u.startswith("user message ") for u in users)  # quotes stripped
    assert len(fake.requests) == 6  # one message per atomic turn: done turns ask the simulator nothing
    for _, _, req in fake.requests:
        system, situation = req["messages"][0]["content"], req["messages"][1]["content"]
        assert system.startswith("A retired sailor.") and "USER" in system
        assert "ada@example.com" not in situation and "alan@example.com" not in situation  # vague: withheld
    assert trs[0].view == {"name": "simuser-llm", "args": {
        "max_exchanges": 3, "role": "user", "model": FAKE_MODEL, "persona": "A retired sailor.",
        "sampling": trs[0].view["args"]["sampling"]}}


@POLICIES.register("test-asks-first")
class AsksFirst(ReplayPolicy):
    """Asks the user a question before acting on the first atomic task, then plays the gold calls."""

    async def act(self, messages, tools, harness, ctx):
        if ctx.index == 0 and ctx.step == 0:
            return harness.render([], "Which email address is yours?")
        return await super().act(messages, tools, harness, ctx.__class__(**{**ctx.__dict__,
                                                                          "step": ctx.step - (ctx.index == 0)}))


def test_a_question_reveals_the_next_detail_to_the_llm(fake, tmp_path):
    fake.script = [Step(body=_user_says) for _ in range(20)]
    cfg = SampleConfig(view=Component(name="simuser-llm"), policy=Component(name="test-asks-first"))
    (t,) = _run(fake, tmp_path, from_shop("vague")[:1], cfg)
    assert t.accepted and t.attempts[0].policy_calls == 3  # the question, the gold calls, the reply
    first, second = fake.requests[0][2]["messages"][1]["content"], fake.requests[1][2]["messages"][1]["content"]
    assert "[ask me]" in first and "ada@example.com" not in first
    assert "ada@example.com" in second and "Which email address is yours?" in second


@pytest.mark.parametrize("step", [Step(status=500), Step(body="not json at all"),
                                  Step(body={"choices": [{"message": {"role": "assistant", "content": "  "},
                                                          "finish_reason": "stop"}]})])
def test_endpoint_failure_is_a_recorded_rollout_failure(fake, tmp_path, step):
    fake.script = [step] + [Step(body=_user_says) for _ in range(20)]
    cfg = SampleConfig(view=Component(name="simuser-llm"), concurrency=1)
    trs = _run(fake, tmp_path, from_shop(), cfg)
    assert len(trs) == 2  # the batch finished
    failed = [t for t in trs if t.failure]
    assert len(failed) == 1 and failed[0].failure.startswith("UserSimulatorError: user simulator (user)")
    assert not failed[0].accepted
    assert [t.accepted for t in trs if not t.failure] == [True]
    again = _run(fake, tmp_path, from_shop(), cfg)  # a rerun redoes the failed rollout only
    assert len(again) == 2 and all(t.accepted and t.failure is None for t in again)
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 3 and sorted(t.key for t in again) == sorted(t.key for t in trs)


def test_bad_configuration_fails_before_the_batch(fake, tmp_path):
    client = LLMClient(_cfg(fake))
    with pytest.raises(ValueError, match="role 'judge'"):
        LLMUserView(client, role="judge")
    with pytest.raises(ValueError, match="persona"):
        LLMUserView(client, persona=" ")
    with pytest.raises(TypeError, match="LLMClient"):
        LLMUserView(object())

    async def no_client():
        return await sample_async(tmp_path / "run", from_shop(), SampleConfig(view=Component(name="simuser-llm")))
    with pytest.raises(ValueError, match="needs an LLMClient"):
        asyncio.run(no_client())
    assert not (tmp_path / "run").exists()


def test_cli_flags_of_the_llm_user(fake, tmp_path):
    from typer.testing import CliRunner

    from treadle.weft.rollouts.cli import app

    def err(args):
        r = CliRunner().invoke(app, ["sample", str(tmp_path / "run"), "--view", "simuser-llm", *map(str, args)])
        assert r.exit_code == 2, r.output
        return r.output.strip()
    assert err([]).startswith("Error: --llm-config: the simuser-llm view needs")
    cfg = tmp_path / "m.toml"
    cfg.write_text(f'[roles.policy]\nmodel = "{FAKE_MODEL}"\nbase_url = "{fake.base_url}"\n')
    assert err(["--llm-config", cfg]).startswith("Error: --user-role: unknown role 'user'")
    fake.script = [Step(body=_user_says) for _ in range(20)]
    r = CliRunner().invoke(app, ["sample", str(tmp_path / "run"), "--view", "simuser-llm", "--llm-config", str(cfg),
                                 "--user-role", "policy", "--k", "1", "--method", "prefix"])
    assert r.exit_code == 0, r.output
    assert "2 accepted trajectories" in r.output
