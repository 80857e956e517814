import asyncio
import json

from treadle.llm import Failure, LLMClient, LLMConfig
from treadle.rsi.agents import DirectorDecision, llm_director_decide, llm_solve
from treadle.rsi.harness import Harness, Skill


class Scripted:
    """Strict scripted model: answers in order; an unexpected extra call fails the test."""

    recorded = False

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests = []

    async def send(self, cfg, kind, payload, key):
        self.requests.append(payload)
        assert self.replies, f"unexpected call: {payload}"
        r = self.replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return {"id": "x", "object": "chat.completion", "model": payload.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": r}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}

    async def probe(self, cfg):
        return None

    async def aclose(self):
        return None


H = Harness(skills=(Skill(name="add_term", intent="one more operation", method=("add_term",), difficulty_effect=-0.2),))


def _client(backend, tmp_path):
    cfg = LLMConfig.single("m", roles=("director", "solver"), max_retries=0)
    return LLMClient(cfg, backend=backend, ledger=tmp_path / "ledger.jsonl", cache_mode="off")


def _run(coro):
    return asyncio.run(coro)


def test_director_decision_sees_the_current_library(tmp_path):
    b = Scripted([json.dumps({"step": "extend", "skill": "add_term", "reason": "hardest"})])

    async def go():
        async with _client(b, tmp_path) as c:
            return await llm_director_decide(c, H, {"steps": 0}, max_repairs=0)

    d = _run(go())
    assert d == DirectorDecision(step="extend", skill="add_term", reason="hardest")
    assert "add_term" in b.requests[0]["messages"][-1]["content"] and not b.replies


def test_malformed_and_unknown_skill_outputs_are_recorded_failures(tmp_path):
    b = Scripted(["not json at all", json.dumps({"step": "extend", "skill": "nope"})])

    async def go():
        async with _client(b, tmp_path) as c:
            return (await llm_director_decide(c, H, {}, max_repairs=0),
                    await llm_director_decide(c, H, {}, max_repairs=0))

    bad_json, unknown = _run(go())
    assert isinstance(bad_json, Failure) and bad_json.kind.value == "invalid_output" and bad_json.blame == "model"
    assert isinstance(unknown, Failure) and "unknown skill 'nope'" in unknown.message
    assert not b.replies


def test_solver_samples_n_and_keeps_failures_per_task(tmp_path):
    from treadle.llm import BadResponseError

    b = Scripted(["7", "x=7", "6", "7", "3", BadResponseError("empty choices"), "3", "3"])

    async def go():
        async with _client(b, tmp_path) as c:
            return await llm_solve(c, H, ["Compute 3+4.", "Compute 1+2."], 4)

    r1, r2 = _run(go())
    assert r1.answers == ["7", "x=7", "6", "7"] and not r1.failures
    assert r2.answers == ["3", "3", "3"] and len(r2.failures) == 1
    assert r2.failures[0].kind.value == "bad_response" and r2.failures[0].blame == "provider"
    ledger = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert sum(1 for x in ledger if x.get("role") == "solver") >= 7
