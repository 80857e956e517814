"""Shared fixtures of the WEFT RL tests: the shop in a runtime, gold turn starts, the tool tokenizer."""
import anyio
import pytest

from treadle.weft.rl.gold import play_gold, shop_server
from treadle.weft.rl.vocab import build_tool_tokenizer
from treadle.weft.rl.worlds import episodes
from treadle.weft.rollouts.harnesses import HermesHarness
from treadle.weft.runtime import Runtime


@pytest.fixture(scope="session")
def tok():
    return build_tool_tokenizer()


@pytest.fixture
def harness():
    return HermesHarness()


@pytest.fixture
def in_shop():
    """``in_shop(fn, n=3, split="heldout")``: ``await fn(rt, server_hash, golds)`` in a fresh runtime, with
    ``n`` episodes played (and verified) with their gold calls."""
    def run(fn, n=3, split="heldout"):
        async def main():
            async with Runtime() as rt:
                h = await shop_server(rt)
                golds = [await play_gold(rt, h, e, HermesHarness()) for e in episodes(n, split)]
                return await fn(rt, h, golds)
        return anyio.run(main)
    return run


@pytest.fixture(scope="session")
def tiny_policy(tok):
    """An untrained tiny Qwen3 with the tool tokenizer (samples are noise: mostly malformed or no calls)."""
    from treadle.models.builders import build_tiny_model

    return build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
