"""WEFT's verdict through verl's own reward path, on CPU: the configs treadle writes, composed by Hydra on top of
verl's ``ppo_trainer``; verl's ``RLHFDataset`` reads the parquet; verl's ``AgentLoopWorker`` runs
:class:`WeftToolAgentLoop` (registered from the agent-loop config) against a scripted generation server, and
sends each trajectory to verl's ``RewardLoopWorker`` (the ``naive`` reward manager calling treadle's
``compute_score``); the batch's ``rm_scores`` (``extract_reward``) are the verdicts."""
import asyncio

import numpy as np
import pytest

from treadle.testing import require_module


@pytest.fixture(scope="module")
def verl_setup(tmp_path_factory):
    """The written configs (one train episode: two atomic turns), composed with a tiny model folder."""
    require_module("hydra")
    require_module("aiohttp")
    require_module("verl.experimental.agent_loop.tool_agent_loop")
    from hydra import compose, initialize_config_dir

    from treadle.models.builders import build_tiny_model
    from treadle.weft.rl.trl_env import default_backend
    from treadle.weft.rl.verl_reward import write_verl_configs
    from treadle.weft.rl.vocab import build_tool_tokenizer

    root = tmp_path_factory.mktemp("verl_reward")
    tok = build_tool_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    paths = write_verl_configs(root / "cfg", episodes=1, heldout=1, n=2)
    with initialize_config_dir(config_dir=str(root / "cfg"), version_base=None):
        cfg = compose(config_name="weft_grpo", overrides=[
            f"actor_rollout_ref.model.path={root / 'model'}", "actor_rollout_ref.rollout.prompt_length=2048",
            "actor_rollout_ref.rollout.response_length=512"])
    return cfg, tok, paths, default_backend()


class _Server:
    """verl's generation client (``async generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput``),
    scripted per trajectory: the first trajectory of a turn start plays the turn's gold calls and the reply,
    the second replies at once (no tool call)."""

    def __init__(self, tok, rows, backend):
        from treadle.weft.rl.gold import REPLY
        from treadle.weft.rollouts.harnesses import HermesHarness

        h = HermesHarness()
        self.tok, self.plans, self.seen, self.runs = tok, [], {}, {}
        for r in rows:
            ex = r["extra_info"]
            calls = backend.gold(ex["weft_split"], ex["weft_episode"]).starts[ex["weft_turn"]].atomic.checkpoint.gold_calls
            last_user = [m["content"] for m in r["prompt"] if m["role"] == "user"][-1]
            self.plans.append((len(r["prompt"]), last_user, [h.render([c]).text for c in calls] + [REPLY]))
        self.reply = REPLY

    def _plan(self, prompt_ids):
        text = self.tok.decode(prompt_ids)
        k = max((i for i, (_, u, _) in enumerate(self.plans) if u in text), key=lambda i: self.plans[i][0])
        n = self.seen.get(k, 0)
        self.seen[k] = n + 1
        return list(self.plans[k][2]) if n == 0 else [self.reply]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if request_id not in self.runs:
            self.runs[request_id] = self._plan(prompt_ids)
        text = self.runs[request_id].pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return TokenOutput(token_ids=ids, stop_reason="completed")


class _Handle:
    """A Ray actor handle's ``.compute_score.remote(data)`` served by a local ``RewardLoopWorker``."""

    def __init__(self, worker):
        self.compute_score = type("M", (), {"remote": staticmethod(worker.compute_score)})


def _batch(cfg, tok, paths, n):
    """The trainer's rollout batch: verl's dataset and collate, a uid per row, ``n`` copies each."""
    import uuid

    from verl import DataProto
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    ds = RLHFDataset(data_files=[paths["train"]], tokenizer=tok, config=cfg.data, processor=None)
    batch = DataProto.from_single_dict(collate_fn([ds[i] for i in range(len(ds))]))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    return batch.repeat(repeat_times=n, interleave=True)


def test_verdicts_reach_verls_reward_tensor(verl_setup):
    import pandas as pd
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.trainer.ppo.reward import extract_reward

    from treadle.weft.rl.verl_tool import trajectories

    cfg, tok, paths, backend = verl_setup
    rows = pd.read_parquet(paths["train"]).to_dict("records")
    assert len(rows) == 2 and {r["agent_name"] for r in rows} == {"weft_tool_agent"}
    server = _Server(tok, rows, backend)
    open_before = len(trajectories.open)

    async def main():  # verl's workers bind the running event loop when they are built
        reward = RewardLoopWorker(cfg)
        worker = AgentLoopWorker(cfg, llm_client=server, reward_loop_worker_handles=[_Handle(reward)])
        return await worker.generate_sequences(_batch(cfg, tok, paths, cfg.actor_rollout_ref.rollout.n))

    out = asyncio.run(main())
    reward_tensor, extra = extract_reward(out)
    scores = reward_tensor.sum(-1).tolist()
    texts = [tok.decode(r) for r in out.batch["responses"]]
    played = ["<tool_call>" in t for t in texts]
    assert sorted(played) == [False, False, True, True]  # each turn start: one gold trajectory, one bare reply
    assert scores == [1.0 if p else 0.0 for p in played]
    # the score sits on the last response token, as verl's own reward managers put it
    last = out.batch["attention_mask"][:, out.batch["prompts"].shape[1]:].sum(-1) - 1
    assert all(reward_tensor[i, last[i]] == scores[i] for i in range(len(scores)))
    assert list(extra["weft_env_failed"]) == [0.0] * 4 and list(extra["weft_flagged"]) == [0.0] * 4
    assert list(out.non_tensor_batch["weft_reward"]) == scores
    assert len(trajectories.open) == open_before  # every trajectory's fork is closed


def test_a_weft_row_without_a_verdict_is_a_typed_error():
    require_module("verl.experimental.agent_loop.tool_agent_loop")
    from treadle.weft.rl.verl_reward import WeftRewardError, compute_score

    with pytest.raises(WeftRewardError, match="weft_tool_agent"):
        compute_score("treadle-weft-shop", "Done.", "{}", {"weft_split": "train"})
    env = compute_score("treadle-weft-shop", "", "{}", {"weft_reward": None, "weft_env_failure": "shop: crash"})
    assert env == {"score": 0.0, "weft_env_failed": 1.0, "weft_flagged": 0.0}
    flagged = compute_score("treadle-weft-shop", "", "{}", {"weft_reward": 1.0, "weft_flags": ["repetition"]})
    assert flagged == {"score": 1.0, "weft_env_failed": 0.0, "weft_flagged": 1.0}


def test_config_writer_refuses_bad_sizes_before_writing(tmp_path):
    require_module("verl.experimental.agent_loop.tool_agent_loop")
    from treadle.weft.rl.verl_reward import write_verl_configs

    for bad in ({"episodes": 0}, {"n": 1}, {"heldout": True}):
        with pytest.raises(ValueError):
            write_verl_configs(tmp_path / "cfg", **bad)
    assert not (tmp_path / "cfg").exists()


def test_cli_refuses_bad_sizes_in_one_line_before_writing(tmp_path, capsys):
    require_module("verl.experimental.agent_loop.tool_agent_loop")
    from treadle.weft.rl.verl_reward import _main

    with pytest.raises(SystemExit) as e:
        _main(["--out", str(tmp_path / "cfg"), "--n", "1"])
    assert e.value.code == 2 and "n must be an int >= 2" in capsys.readouterr().err
    assert not (tmp_path / "cfg").exists()
