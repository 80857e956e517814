"""Trajectory grouping on TRL: whole-task rollouts (R = mean_k r_k) chained turn after turn in one forked session."""
import pytest
import torch

from treadle.testing import require_module


@pytest.fixture(scope="module")
def backend():
    from treadle.weft.rl.trl_env import WeftBackend

    be = WeftBackend()
    yield be
    be.close()


def _play(env, calls):
    for call in calls:
        out = getattr(env, call.name)(**call.arguments)
        assert not out.startswith("Error"), out


def test_a_task_row_plays_every_turn_in_one_fork_and_scores_mean_r(backend):
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset

    ds = weft_turn_dataset(2, "train", start=3, backend=backend, whole_tasks=True)
    assert len(ds) == 2 and all(r["weft_turn"] == 0 for r in ds)
    Env = weft_environment(backend, grouping="trajectory")
    gold = backend.gold("train", 3)
    order = gold.episode.task.ordered()
    assert len(order) == 2
    a = Env()
    a.reset(**ds[0])
    _play(a, order[0].checkpoint.gold_calls)
    assert a._end_turn() == order[1].request  # the next user request; the session goes on
    _play(a, order[1].checkpoint.gold_calls)
    assert a._end_turn() is None and a.get_reward() == 1.0 and a.turn_rewards == [1, 1]
    # turn 1 passes, turn 2 does nothing: R = 1/2
    a.reset(**ds[0])
    _play(a, order[0].checkpoint.gold_calls)
    a._end_turn()
    assert a.get_reward() == 0.5
    # a cut turn scores 0 even when its calls pass
    a.reset(**ds[0])
    _play(a, order[0].checkpoint.gold_calls)
    a._end_turn(truncated=True)
    _play(a, order[1].checkpoint.gold_calls)
    assert a.get_reward() == 0.5 and a.turn_rewards == [0, 1]
    # nothing at all: 0 (a turn never reached counts 0), not an environment failure
    a.reset(**ds[0])
    assert a.get_reward() == 0.0 and a.env_failure is None


def test_an_environment_failure_leaves_the_trajectory_unscored(backend):
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset

    ds = weft_turn_dataset(1, "train", start=4, backend=backend, whole_tasks=True)
    env = weft_environment(backend, grouping="trajectory")()
    env.reset(**ds[0])
    env.env_failure = "shop: crash: injected"
    assert env._end_turn() is None and env.get_reward() is None


def test_unknown_grouping_is_refused(backend):
    from treadle.weft.rl.trl_env import weft_environment

    with pytest.raises(ValueError, match="grouping must be one of"):
        weft_environment(backend, grouping="episode")


def test_two_trajectory_grpo_steps_chain_the_turns(tmp_path, backend):
    require_module("trl")
    from trl import GRPOConfig

    from treadle.models.builders import build_tiny_model
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tok = build_tool_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=24, max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                      remove_unused_columns=False, max_tool_calling_iterations=1, learning_rate=1e-3,
                      logging_steps=1)
    trainer = WeftGRPOTrainer(model=model, args=args, processing_class=tok,
                              train_dataset=weft_turn_dataset(4, "train", backend=backend, whole_tasks=True),
                              environment_factory=weft_environment(backend, grouping="trajectory"))
    seen = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        out = original(inputs)
        envs = list(trainer.environments)
        seen.append((out, trainer._treadle_rewards_per_func[:, -1].clone(), [list(e.turn_rewards) for e in envs],
                     [e.env_failure for e in envs], [e._order[-1].request for e in envs]))
        return out

    trainer._generate_and_score_completions = spy
    trainer.train()
    assert trainer.state.global_step == 2 and seen
    for out, rewards, turns, failures, requests in seen:
        for k, (r, t, f, q) in enumerate(zip(rewards.tolist(), turns, failures, requests)):
            if f is None:
                assert r == pytest.approx(sum(t) / 2) and len(t) >= 1
            ids = out["completion_ids"][k][out["completion_mask"][k].bool()].tolist()
            tm = out["tool_mask"][k][out["completion_mask"][k].bool()].tolist()
            # a second turn was played: the user's request sits in the completion, masked out of the loss
            if f is None and len(t) == 2:
                masked = tok.decode([x for x, m in zip(ids, tm) if m == 0])
                assert "user" in masked and q in masked, masked
    assert any(len(t) == 2 for _, _, turns, _, _ in seen for t in turns)
    assert all(not torch.isnan(out["advantages"]).any() for out, *_ in seen)
