"""Prefix-preserving vs end-to-end rejection sampling, the resumable batch, and bad input."""
import asyncio
import json

import pytest

from treadle.llm import LLMClient, LLMConfig
from treadle.weft.rollouts.batch import Component, ConfigMismatchError, SampleConfig, sample
from treadle.weft.rollouts.harnesses import HermesHarness
from treadle.weft.rollouts.metrics import selected_call_errors, summarize
from treadle.weft.rollouts.policies import ReplayPolicy
from treadle.weft.rollouts.registry import UnknownComponentError
from treadle.weft.rollouts.rollout import Setup, prefix_rollout
from treadle.weft.rollouts.tasks import AtomicTask, DependencyCycleError, RolloutTask, from_shop, replicate
from treadle.weft.rollouts.views import AgenticView
from treadle.weft.runtime.verify import CheckpointSpec, StateAssertion

RATES = {"wrong_argument": 0.06, "skipped_call": 0.06, "extra_call": 0.06, "malformed_call": 0.06,
         "made_up_tool": 0.06}


class FailFirst:
    """Replay with an extra (repeated) call on attempt 0 of ``atomic``: two orders instead of one."""

    name = "fail-first"

    def __init__(self, atomic):
        self.atomic, self.bad, self.good = atomic, ReplayPolicy({"extra_call": 1.0}), ReplayPolicy()

    def args(self):
        return {}

    async def act(self, messages, tools, harness, ctx):
        p = self.bad if (ctx.atomic.name == self.atomic and ctx.attempt == 0) else self.good
        return await p.act(messages, tools, harness, ctx)


def test_failed_attempt_state_is_discarded_not_replayed(with_shop):
    base = from_shop()[0]
    count = AtomicTask(name="count-orders", request="How many orders are there?", depends_on=("ada-2-order",),
                       checkpoint=CheckpointSpec(name="count-orders", gold_calls=[], assertions=[
                           StateAssertion(sql="SELECT COUNT(*) FROM orders", expected=[[3]])]))
    task = base.model_copy(update={"atomic": base.atomic[:2] + (count,)})

    async def go(rt, env):
        return await prefix_rollout(rt, env, task, 2, Setup(AgenticView(), HermesHarness(), FailFirst("ada-2-order")))
    tr = with_shop(go)
    assert [(a.atomic, a.attempt, a.r) for a in tr.attempts] == [
        ("ada-1-lookup", 0, 1), ("ada-2-order", 0, 0), ("ada-2-order", 1, 1), ("count-orders", 0, 1)]
    assert tr.accepted and tr.rewards == (1, 1, 1) and tr.selected == (0, 2, 3)
    # the accepted conversation holds exactly one place_order (the discarded attempt's messages are gone)
    assert sum(m["content"].count('"place_order"') for m in tr.messages if m["role"] == "assistant") == 1
    assert tr.policy_calls == 2 + 2 + 2 + 1


def _table(tmp_path):
    cfg = SampleConfig(policy=Component(name="replay", args={"rates": RATES, "seed": 0}),
                       methods=("prefix", "end_to_end"), ks=(1, 3, 5), concurrency=3)
    trs = sample(tmp_path / "run", replicate(from_shop(), 4), cfg)
    return {(r["method"], r["k"]): r for r in summarize(trs)}, trs


def test_acceptance_table_is_deterministic_and_favours_prefix(tmp_path):
    rows, trs = _table(tmp_path)
    again, _ = _table(tmp_path / "again")
    assert rows == again                                    # deterministic at a fixed perturbation rate
    assert len(trs) == 8 * 3 * 2
    # k = 1: both methods draw attempt 0 of every turn, so they accept the same trajectories
    assert rows["prefix", 1]["accepted"] == rows["end_to_end", 1]["accepted"]
    for k in (3, 5):
        assert rows["prefix", k]["accepted"] >= rows["end_to_end", k]["accepted"]
        assert rows["prefix", k]["accepted_per_call"] > rows["end_to_end", k]["accepted_per_call"]
    assert rows["prefix", 1]["accepted"] <= rows["prefix", 3]["accepted"] <= rows["prefix", 5]["accepted"]
    for t in trs:  # labels in every output
        assert t.policy == {"name": "replay", "args": {"rates": RATES, "seed": 0}}
        assert t.harness["parser"] == "hermes-json-v1" and t.harness["tolerance"]
        assert t.accepted == (t.reward == 1.0)
        if t.accepted:
            assert [t.attempts[i].r for i in t.selected] == [1] * len(t.rewards)


def test_tool_error_rate_counts_recovered_errors(tmp_path):
    cfg = SampleConfig(policy=Component(name="replay", args={"rates": {"made_up_tool": 1.0}}))
    trs = sample(tmp_path, from_shop()[1:], cfg)
    (t,) = trs
    assert t.accepted  # every made-up call was followed by the right one
    bad, n = selected_call_errors(t)
    assert (bad, n) == (4, 8)  # 4 gold calls, each preceded by one unknown_tool call
    errs = [c.error_kind for i in t.selected for st in t.attempts[i].steps for c in st.calls if not c.ok]
    assert errs == ["unknown_tool"] * 4
    assert summarize(trs)[0]["tool_error_rate_selected"] == 0.5


def test_rerun_resumes_and_config_change_refuses(tmp_path):
    cfg = SampleConfig(ks=(1, 2))
    first = sample(tmp_path, from_shop(), cfg)
    lines = (tmp_path / "trajectories.jsonl").read_text().splitlines()
    assert len(first) == len(lines) == 4
    with (tmp_path / "trajectories.jsonl").open("a") as fh:
        fh.write('{"torn": ')  # a killed run's last line
    again = sample(tmp_path, from_shop(), cfg)
    assert [t.key for t in again] == [t.key for t in first]
    with pytest.raises(ConfigMismatchError, match="ks"):
        sample(tmp_path, from_shop(), SampleConfig(ks=(1, 3)))


@pytest.mark.parametrize("make, err, match", [
    (lambda: SampleConfig(ks=(0,)), ValueError, "k .* >= 1"),
    (lambda: SampleConfig(methods=("best",)), ValueError, "methods"),
    (lambda: sample("unused", from_shop(), SampleConfig(harness=Component(name="xml"))), UnknownComponentError,
     "unknown harness 'xml'"),
    (lambda: sample("unused", [RolloutTask(name="c", env="shop", atomic=(
        AtomicTask(name="a", request="x", depends_on=("a",), checkpoint=CheckpointSpec(name="a")),))],
        SampleConfig()), DependencyCycleError, "cycle"),
    (lambda: sample("unused", from_shop(), SampleConfig(policy=Component(name="replay", args={"rates": {"typo": .1}}))),
     ValueError, "unknown perturbation"),
])
def test_bad_input_fails_before_the_batch(tmp_path, monkeypatch, make, err, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(err, match=match):
        make()
    assert not (tmp_path / "unused").exists()


class Backend:
    """A scripted endpoint: garbage, a timeout, or one Hermes call then a reply."""

    recorded = False

    def __init__(self, mode):
        self.mode = mode

    async def aclose(self):
        pass

    async def send(self, cfg, kind, payload, key):
        if self.mode == "garbage":
            return {"not": "a completion"}
        if self.mode == "timeout":
            raise asyncio.TimeoutError()
        last = payload["messages"][-1]
        text = ("All done." if last["role"] == "tool" else
                '<tool_call>{"name": "find_customer", "arguments": {"email": "ada@example.com"}}</tool_call>')
        return {"model": cfg.model, "choices": [{"message": {"role": "assistant", "content": text},
                                                 "finish_reason": "stop"}], "usage": {}}


@pytest.mark.parametrize("mode", ["garbage", "timeout", "ok"])
def test_llm_policy_failures_are_records(tmp_path, mode):
    cfg_llm = LLMConfig.single("m", roles=("policy",), max_retries=0)

    async def go():
        from treadle.weft.rollouts.batch import sample_async

        async with LLMClient(cfg_llm, backend=Backend(mode)) as client:
            return await sample_async(tmp_path, from_shop(), SampleConfig(policy=Component(name="llm")), client=client)
    trs = asyncio.run(go())
    assert len(trs) == 2  # the batch finished: no crashed rollout
    first = trs[0].attempts[0]
    if mode == "ok":
        assert all(t.failure is None for t in trs)  # recorded policy failures
        assert first.steps[0].calls[0].name == "find_customer" and first.steps[0].calls[0].ok
        assert first.r == 0  # list_orders is missing: a policy failure, judged by the checkpoint
    else:  # an endpoint failure is no policy sample: a failed rollout (redone by a rerun)
        assert all(t.failure.startswith("policy endpoint failed on ") and not t.accepted for t in trs)
        assert first.r == 0 and "policy_endpoint_error" in first.reasons
        assert first.steps[-1].output.error.startswith("bad_response" if mode == "garbage" else "timeout")
    assert json.loads((tmp_path / "config.json").read_text())["policy"]["name"] == "llm"
    assert trs[0].policy["args"]["model"] == "m" and summarize(trs)[0]["policy"] == "llm:m"


def test_llm_policy_needs_a_client_role():
    from treadle.weft.rollouts.policies import LLMPolicy

    with pytest.raises(TypeError, match="LLMClient"):
        LLMPolicy(object())
    client = LLMClient(LLMConfig.single("m", roles=("policy",)), backend=Backend("ok"))
    with pytest.raises(ValueError, match="role 'judge'"):
        LLMPolicy(client, role="judge")


@pytest.mark.slow
def test_hf_policy_in_process_tiny_model(with_shop):
    """An untrained tiny model mostly fails: its turns are recorded (cut by max_new_tokens), never a crash."""
    import torch

    from treadle.models import build_tiny_model, build_tokenizer
    from treadle.weft.rollouts.policies import HFPolicy

    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None)
    task = from_shop()[1]

    async def go(rt, env):
        pol = HFPolicy(model, tok, max_new_tokens=6)
        return await prefix_rollout(rt, env, task, 2, Setup(AgenticView(), HermesHarness(), pol, max_steps=2))
    tr = with_shop(go)
    assert not tr.accepted and tr.policy_calls >= 1
    for a in tr.attempts:
        for st in a.steps:
            assert st.output.token_ids is not None and 1 <= len(st.output.token_ids) <= 6
            if st.output.finish_reason == "length":
                assert a.truncated and "finish_reason_length" in a.reasons and a.r == 0
    with pytest.raises(ValueError, match="max_new_tokens"):
        HFPolicy(model, tok, max_new_tokens=0)

    # its token ids reach the training sample as generated (end-to-end keeps the failed run's messages)
    from treadle.weft.rollouts.rollout import end_to_end_rollout
    from treadle.weft.rollouts.tokens import policy_turns, tokenize_trajectory

    async def e2e(rt, env):
        pol = HFPolicy(model, tok, max_new_tokens=6)
        return await end_to_end_rollout(rt, env, task, 1, Setup(AgenticView(), HermesHarness(), pol, max_steps=1))
    tr = with_shop(e2e)
    ids, cut = policy_turns(tr)
    assert ids and set(cut) <= set(ids)
    samples = tokenize_trajectory(tr, tok)
    for j, g in ids.items():
        assert any(tuple(g) == s.input_ids[i:i + len(g)] for s in samples for i in range(len(s.input_ids)))
    flags = {x for s in samples for x in s.flags}
    assert all(f"truncated_turn:{j}" in flags for j in cut)


def test_a_crashing_rollout_is_recorded_and_siblings_finish(tmp_path):
    from treadle.weft.rollouts.registry import POLICIES

    @POLICIES.register("test-boom")
    class Boom(ReplayPolicy):
        async def act(self, messages, tools, harness, ctx):
            if ctx.task.name == "alan-cancel":
                raise RuntimeError("policy bug")
            return await super().act(messages, tools, harness, ctx)

    trs = sample(tmp_path, from_shop(), SampleConfig(policy=Component(name="test-boom"), concurrency=2))
    by_task = {t.task: t for t in trs}
    assert by_task["alan-cancel"].failure == "RuntimeError: policy bug" and not by_task["alan-cancel"].accepted
    assert by_task["ada-replacement"].accepted and by_task["ada-replacement"].failure is None
