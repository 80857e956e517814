"""Every budget at its boundary: a limit EQUAL to what a turn, a sample or a call spends is within budget;
one less is over. (A budget compared with ``>=`` where ``>`` is meant, or the reverse, fails here.)"""
import asyncio
import importlib.util
from pathlib import Path

import pytest

from treadle.llm import LLMClient, LLMConfig
from treadle.llm.config import UsageLimits
from treadle.llm.fake_endpoint import FAKE_MODEL, FakeEndpoint, chat_reply
from treadle.llm.records import Failure, FailureKind
from treadle.weft.rollouts.tokens import IGNORE, tokenize_conversation

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    from treadle.models import build_tokenizer

    path = Path(__file__).resolve().parents[1] / "weft" / "rollouts" / "qwen3_template.py"
    spec = importlib.util.spec_from_file_location("qwen3_template_for_budgets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = build_tokenizer()
    t.chat_template = mod.QWEN3_STYLE
    t.model_max_length = 100_000
    return t


TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
ONE_TURN = [{"role": "user", "content": "Say something long enough."},
            {"role": "assistant", "content": "Here is a reply of a few tokens."}]
TWO_TURNS = [*ONE_TURN, {"role": "user", "content": "Again."}, {"role": "assistant", "content": "Once more then."}]


def test_a_turn_exactly_at_max_turn_tokens_is_trained(tok):
    (full,) = tokenize_conversation(ONE_TURN, TOOLS, tok)
    n = full.trainable  # the assistant turn's own tokens (all generated: none unwritten)
    assert n > 1
    (at,) = tokenize_conversation(ONE_TURN, TOOLS, tok, max_turn_tokens=n)
    assert at.flags == () and at.labels == full.labels
    (under,) = tokenize_conversation(ONE_TURN, TOOLS, tok, max_turn_tokens=n - 1)
    assert under.flags == ("over_turn_budget:1",) and all(x == IGNORE for x in under.labels)


def test_a_sample_exactly_at_max_tokens_is_kept_whole(tok):
    (full,) = tokenize_conversation(TWO_TURNS, TOOLS, tok)
    n = len(full.input_ids)
    (at,) = tokenize_conversation(TWO_TURNS, TOOLS, tok, max_tokens=n)
    assert at.input_ids == full.input_ids and not any(f.startswith("over_budget") for f in at.flags)
    (under,) = tokenize_conversation(TWO_TURNS, TOOLS, tok, max_tokens=n - 1)
    assert len(under.input_ids) < n and "over_budget:3" in under.flags


def _calls(limits: UsageLimits, n: int) -> tuple[list, dict]:
    ep = FakeEndpoint(responder=lambda req: chat_reply("ok", FAKE_MODEL, prompt_tokens=8))  # 8 + 2 = 10 tokens
    try:
        cfg = LLMConfig.single(FAKE_MODEL, ep.base_url, timeout_s=5.0, max_retries=0,
                               prices={"input_per_million": 1_000_000.0, "output_per_million": 1_000_000.0})

        async def go():
            async with LLMClient(cfg, limits=limits) as llm:
                outs = [(await llm.gather([llm.chat(MSG, sample_index=i)]))[0] for i in range(n)]
                return outs, dict(llm.usage)
        return asyncio.run(go())
    finally:
        ep.close()


def _exhausted(outs) -> list[bool]:
    return [isinstance(o, Failure) and o.kind == FailureKind.budget_exhausted for o in outs]


@pytest.mark.parametrize("field,per_call", [("max_tokens", 10), ("max_cost_usd", 10.0), ("max_calls", 1)])
def test_usage_limits_equal_to_what_calls_spent(field, per_call):
    # a limit equal to two calls' spending allows exactly two calls; one unit more allows a third
    outs, used = _calls(UsageLimits(**{field: 2 * per_call}), 3)
    assert _exhausted(outs) == [False, False, True], (field, used)
    outs, _ = _calls(UsageLimits(**{field: 2 * per_call + (1 if field != "max_cost_usd" else 0.5)}), 3)
    assert _exhausted(outs) == [False, False, False], field
