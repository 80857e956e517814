"""verl and TRL adapters: the same numbers as the frameworks when configured like them."""
import numpy as np
import pytest
import torch

from treadle.grpo.trl_adapter import trl_advantages
from treadle.testing import require_module


def _verl():
    # skip (locally; fail under CI, where the Makefile installs verl) only when the `verl` package
    # itself is missing; an installed verl whose own imports break is an error, never a skip
    core_algos = require_module("verl.trainer.ppo.core_algos")
    import treadle.grpo.verl_adapter  # noqa: F401 - registers on import

    return core_algos


def _verl_batch(seed=0, n_prompts=7):
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 8, 4][:n_prompts]
    index = np.array([f"uid-{i}" for i, s in enumerate(sizes) for _ in range(s)], dtype=object)
    perm = torch.randperm(len(index), generator=gen).numpy()
    index = index[perm]
    B, T = len(index), 6
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B, 1), generator=gen)).float()
    rewards = torch.zeros(B, T)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(B), last] = torch.randint(0, 3, (B,), generator=gen).float() + torch.rand(B, generator=gen)
    return rewards, mask, index


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name,verl_name", [("treadle_grpo", "grpo"), ("treadle_rloo", "rloo")])
def test_verl_registry_gives_verl_numbers(name, verl_name, norm):
    core = _verl()
    assert name in core.ADV_ESTIMATOR_REGISTRY
    rewards, mask, index = _verl_batch()
    ours, ret = core.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=index,
                                                norm_adv_by_std_in_grpo=norm)
    theirs, _ = core.get_adv_estimator_fn(verl_name)(token_level_rewards=rewards.clone(), response_mask=mask,
                                                     index=index, norm_adv_by_std_in_grpo=norm)
    assert ours.shape == theirs.shape == (len(index), 6)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)
    assert torch.equal(ours, ret)


def test_verl_vectorized_matches_too():
    core = _verl()
    rewards, mask, index = _verl_batch(seed=3)
    ours, _ = core.get_adv_estimator_fn("treadle_grpo")(rewards, mask, index)
    theirs, _ = core.get_adv_estimator_fn("grpo_vectorized")(rewards.clone(), mask, index)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def _trl_reference(rewards, g, scale_rewards):
    """TRL 1.x GRPOTrainer's sum_then_normalize computation, with TRL's own nanstd."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_trl_numbers(scale_rewards):
    require_module("trl")
    gen = torch.Generator().manual_seed(0)
    g = 4
    rewards = torch.randint(0, 4, (8 * g,), generator=gen).float() / 3 + torch.rand(8 * g, generator=gen) * 0.1
    rewards[5] = float("nan")  # an unscorable completion: left out of its group's statistics, advantage 0
    ours = trl_advantages(rewards, g, scale_rewards)
    theirs = _trl_reference(rewards, g, scale_rewards)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours[5].item() == 0.0


def test_trl_trainer_subclass_is_a_grpo_trainer():
    trl = require_module("trl")
    from treadle.grpo.trl_trainer import TreadleGRPOTrainer

    assert issubclass(TreadleGRPOTrainer, trl.GRPOTrainer)
    with pytest.raises(ValueError, match="not a multiple of num_generations"):
        trl_advantages(torch.zeros(5), 2)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", False])
def test_trl_grpo_trainer_step_uses_treadle_advantages(tmp_path, scale_rewards):
    """One real GRPOTrainer step on a tiny Qwen3 built from a config (no download), for every scale_rewards."""
    require_module("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from trl import GRPOConfig

    from treadle.grpo.trl_trainer import TreadleGRPOTrainer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>"] + list("0123456789+= "))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0, eos_token_id=1,
                      bos_token_id=1)
    calls = {"n": 0}

    def reward(completions, **kw):  # varied, deterministic rewards, one unscorable completion
        calls["n"] += 1
        return [None if i == 5 else float((i * 7) % 3) for i in range(len(completions))]

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=3, max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                      scale_rewards=scale_rewards)
    trainer = TreadleGRPOTrainer(model=Qwen3ForCausalLM(cfg), processing_class=hf_tok, reward_funcs=reward, args=args,
                                 train_dataset=Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="] * 2}))
    seen = {}
    original = trainer._generate_and_score_completions

    def spy(inputs):
        out = original(inputs)
        seen["adv"], seen["rewards"] = out["advantages"].clone(), trainer._treadle_rewards_per_func[:, 0].clone()
        return out

    trainer._generate_and_score_completions = spy
    trainer.train()
    assert calls["n"] >= 1
    expected = _trl_reference(seen["rewards"], 4, "none" if scale_rewards is False else scale_rewards)
    torch.testing.assert_close(seen["adv"], expected, atol=1e-5, rtol=1e-5)
    assert seen["adv"][5].item() == 0.0 and seen["adv"].abs().sum() > 0


@pytest.mark.parametrize("options,err,match", [({"scale_rewards": "batch"}, ValueError, "GRPOConfig"),
                                               ({"estimatr": "rloo"}, ValueError, "unknown treadle_options"),
                                               ("rloo", TypeError, "dict")])
def test_trl_trainer_refuses_bad_treadle_options_and_normalize_then_sum(tmp_path, options, err, match):
    require_module("trl")
    from trl import GRPOConfig

    from treadle.grpo.trl_trainer import TreadleGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                      report_to=[])
    with pytest.raises(err, match=match):
        TreadleGRPOTrainer(model=None, reward_funcs=None, args=args, treadle_options=options)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                      report_to=[], multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="sum_then_normalize"):
        TreadleGRPOTrainer(model=None, reward_funcs=None, args=args)
