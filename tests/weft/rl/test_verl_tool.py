"""WEFT on verl: the BaseTool through verl's own ToolAgentLoop (Hermes parser, a generation server as small as
verl's interface allows, serving a HF model or the gold calls), the tool config verl reads, and the flags'
hand-off to treadle_grpo through ray_trainer.compute_advantage."""
import asyncio
import json

import numpy as np
import pytest
import torch

from treadle.testing import require_module


@pytest.fixture(scope="module")
def loop_parts(tmp_path_factory):
    require_module("hydra")
    require_module("verl.experimental.agent_loop.tool_agent_loop")
    from verl.tools.tool_registry import initialize_tools_from_config

    from treadle.weft.rl.trl_env import default_backend
    from treadle.weft.rl.verl_tool import write_tool_config

    path = tmp_path_factory.mktemp("verl") / "weft_tools.yaml"
    names = write_tool_config(path)
    tools = initialize_tools_from_config(str(path))  # verl's own reader of the YAML
    assert [t.name for t in tools] == names and "place_order" in names
    return tools, default_backend()


class _Server:
    """verl's generation interface: ``async generate(request_id, prompt_ids, sampling_params, ...) ->
    TokenOutput``. ``script``: texts to return in turn (the gold calls), else a HF model samples."""

    def __init__(self, tok, model=None, script=None):
        self.tok, self.model, self.script, self.calls = tok, model, list(script or []), []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append(request_id)
        if self.model is None:
            ids = self.tok(self.script.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            return TokenOutput(token_ids=ids, stop_reason="completed")
        torch.manual_seed(0)
        out = self.model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=True,
                                  pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        return TokenOutput(token_ids=out[0, len(prompt_ids):].tolist(), stop_reason="completed")


def _run_loop(tools, server, tok, row):
    """Build verl's ToolAgentLoop inside the running event loop (it binds the loop at construction) and run one
    trajectory of ``row``."""
    async def main():
        loop = _agent_loop(tools, server, tok)
        return await loop.run({"temperature": 1.0}, raw_prompt=row["prompt"],
                              tools_kwargs=row["extra_info"]["tools_kwargs"])
    return asyncio.run(main())


def _agent_loop(tools, server, tok):
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "prompt_length": 2048, "response_length": 512, "full_determinism": False,
        "multi_turn": {"max_user_turns": 4, "max_assistant_turns": 4, "max_parallel_calls": 2,
                       "max_tool_response_length": 2000, "tool_response_truncate_side": "right",
                       "format": "hermes"}}}})
    return ToolAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=server, tokenizer=tok, processor=None,
                         dataset_cls=None, data_config=DictConfigWrap(OmegaConf.create({})),
                         tools=ToolListWrap(tools))


def _row(backend):
    from treadle.weft.rl.verl_tool import verl_rows

    return verl_rows(1, "train", start=3, backend=backend)[0]


def test_tool_agent_loop_plays_the_gold_calls_in_a_fork_and_the_verdict_is_1(loop_parts):
    from treadle.weft.rl.gold import REPLY
    from treadle.weft.rl.verl_tool import trajectories
    from treadle.weft.rl.vocab import build_tool_tokenizer
    from treadle.weft.rollouts.harnesses import HermesHarness

    tools, backend = loop_parts
    tok = build_tool_tokenizer()
    row = _row(backend)
    gold = backend.gold("train", 3).starts[0].atomic.checkpoint.gold_calls
    h = HermesHarness()
    server = _Server(tok, script=[h.render([c]).text for c in gold] + [REPLY])
    out = _run_loop(tools, server, tok, row)
    assert len(server.calls) == len(gold) + 1 and len(set(server.calls)) == 1  # one trajectory, one request id
    key = out.extra_fields["weft_trajectory"]  # the fork's key, written by the trajectory's first tool call
    assert key in trajectories.open and out.extra_fields["weft_flags"] == []
    text = tok.decode(out.response_ids)
    assert "Error" not in text and REPLY in text
    # tool outputs are masked out of the policy tokens
    assert 0 in out.response_mask and 1 in out.response_mask
    assert asyncio.run(tools[0].calc_reward("x", trajectory=key)) == 1.0 and key not in trajectories.open


def test_tool_agent_loop_with_a_hf_model_server(loop_parts, tiny_policy):
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tools, backend = loop_parts
    tok = build_tool_tokenizer()
    row = _row(backend)
    out = _run_loop(tools, _Server(tok, model=tiny_policy), tok, row)
    assert out.response_ids and len(out.response_ids) == len(out.response_mask)


def test_bad_rows_are_typed_errors(loop_parts):
    from treadle.weft.rl.trl_env import WeftRowError

    tools, _ = loop_parts
    with pytest.raises(WeftRowError):
        asyncio.run(tools[0].create(create_kwargs={"weft_split": "train"}))


def test_flags_reach_treadle_grpo_through_compute_advantage():
    trainer = require_module("verl.trainer.ppo.ray_trainer")
    from verl import DataProto
    from verl.trainer.config import AlgoConfig

    import treadle.grpo.verl_adapter  # noqa: F401
    from treadle.weft.rl.verl_tool import tag_uids

    B, T = 6, 4
    rewards = torch.zeros(B, T)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    nt = {"uid": np.array(["a", "a", "a", "b", "b", "b"], dtype=object),
          "weft_flags": np.array([["repetition"], [], [], [], [], []], dtype=object),
          "weft_env_failure": np.array([None, None, None, None, "shop: crash: x", None], dtype=object)}
    tag_uids(nt)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": torch.ones(B, T),
                                        "responses": torch.zeros(B, T, dtype=torch.long)}, non_tensors=nt)
    out = trainer.compute_advantage(data, adv_estimator="treadle_grpo", config=AlgoConfig())
    adv = out.batch["advantages"][:, 0]
    assert adv[0] == 0.0  # flagged success: min(A, 0) = 0 (A > 0 in its group)
    assert adv[4] == 0.0 and adv[3] > 0 and adv[5] < 0  # the crash is left out: b's group is {1, 0}
    assert json.dumps([str(u) for u in out.non_tensor_batch["uid"]])


def test_trajectories_sharing_a_request_id_keep_their_own_forks(loop_parts):
    """verl's ``full_determinism`` gives every trajectory of a priority the request id ``det-0``: the forks are
    keyed by the trajectory key the first tool call writes, not by the request id."""
    from types import SimpleNamespace

    from treadle.weft.rl.verl_tool import finish, trajectories

    tools, backend = loop_parts
    row = _row(backend)
    ck = row["extra_info"]["tools_kwargs"][tools[0].name]["create_kwargs"]
    agents = [SimpleNamespace(request_id="det-0", extra_fields={}) for _ in range(2)]

    async def call(agent):
        iid, _ = await tools[0].create(create_kwargs=ck)
        await tools[0].execute(iid, {}, agent_data=agent)
        await tools[0].release(iid)

    for a in agents:
        asyncio.run(call(a))
    keys = [a.extra_fields["weft_trajectory"] for a in agents]
    assert keys[0] != keys[1] and trajectories.open[keys[0]] is not trajectories.open[keys[1]]
    for k in keys:
        assert finish(k, {})["weft_reward"] in (0.0, 1.0, None) and k not in trajectories.open
