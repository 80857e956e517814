"""A policy-endpoint failure in a batch against a fake OpenAI-compatible endpoint (a real
HTTP server on 127.0.0.1, treadle.llm's test fixture): the rollout stops at the failure, is recorded as failed
(no retry of the turn is spent on it), and a rerun redoes it while keeping every successful rollout as it was."""
import asyncio
import json

import pytest

from treadle.llm import LLMClient
from treadle.llm.fake_endpoint import Step
from treadle.weft.rollouts.batch import TRAJECTORIES, Component, SampleConfig, read_trajectories, sample_async
from treadle.weft.rollouts.tasks import AtomicTask, RolloutTask
from treadle.weft.runtime.verify import CheckpointSpec


def _tasks():
    """Two one-turn shop tasks whose checkpoint passes a reply without tool calls (the fake's echo answer)."""
    out = []
    for name in ("greet-a", "greet-b"):
        turn = AtomicTask(name=f"{name}/hello", request=f"Just say hello ({name}).",
                          checkpoint=CheckpointSpec(name=f"{name}/hello", gold_calls=[]))
        out.append(RolloutTask(name=name, env="shop", atomic=(turn,)))
    return out


@pytest.fixture
def run(fake_config):
    """``run(run_dir, method, k)``: sample the two tasks with the llm policy on the shared fake endpoint."""
    def go(run_dir, method, k):
        cfg = SampleConfig(policy=Component(name="llm"), methods=(method,), ks=(k,), concurrency=1)

        async def main():
            async with LLMClient(fake_config("policy")) as client:
                return await sample_async(run_dir, _tasks(), cfg, client=client)
        return asyncio.run(main())
    return go


@pytest.mark.parametrize("method", ["prefix", "end_to_end"])
@pytest.mark.parametrize("step", [Step(status=500), Step(body="not json at all")])
def test_rerun_redoes_endpoint_failures_and_keeps_the_rest(fake, run, tmp_path, method, step):
    fake.script = [step]  # the first policy call fails; every later one is the echo answer (no calls: passes)
    trs = {t.task: t for t in run(tmp_path, method, 3)}
    failed, ok = trs["greet-a"], trs["greet-b"]
    assert failed.failure.startswith("policy endpoint failed on greet-a/hello (attempt 0): ")
    assert not failed.accepted and failed.rewards == (0,) and len(failed.attempts) == 1  # no retry spent on it
    assert "policy_endpoint_error" in failed.attempts[0].reasons
    assert ok.accepted and ok.failure is None and ok.policy_calls == 1
    assert len(fake.requests) == 2
    first_lines = (tmp_path / TRAJECTORIES).read_text().splitlines()

    again = {t.task: t for t in run(tmp_path, method, 3)}  # the endpoint works now
    assert len(fake.requests) == 3  # only the failed rollout was redone
    assert again["greet-a"].accepted and again["greet-a"].failure is None and again["greet-a"].key == failed.key
    assert again["greet-b"] == ok  # the successful rollout is kept as it was
    lines = (tmp_path / TRAJECTORIES).read_text().splitlines()
    assert lines[:2] == first_lines and len(lines) == 3
    assert {json.loads(x)["task"] for x in lines[2:]} == {"greet-a"}
    run(tmp_path, method, 3)  # nothing left to do
    assert len(fake.requests) == 3 and len((tmp_path / TRAJECTORIES).read_text().splitlines()) == 3


def test_records_written_before_the_fix_are_redone_too(fake, run, tmp_path):
    """A run folder whose endpoint-failed trajectory was written with ``failure`` unset (the old behaviour)."""
    fake.script = [Step(status=500)]
    trs = {t.task: t for t in run(tmp_path, "prefix", 1)}
    old = trs["greet-a"].model_copy(update={"failure": None})
    path = tmp_path / TRAJECTORIES
    path.write_text(old.model_dump_json() + "\n" + trs["greet-b"].model_dump_json() + "\n")
    assert read_trajectories(path)[0].failure is None
    again = {t.task: t for t in run(tmp_path, "prefix", 1)}
    assert len(fake.requests) == 3 and again["greet-a"].accepted and again["greet-b"] == trs["greet-b"]
