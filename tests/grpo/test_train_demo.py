"""The ``grpo-train`` demo section end to end in quick mode, plus its building blocks."""
import json

import pytest
import torch
from rich.console import Console

from treadle.grpo import train_demo


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    return tmp_path / "cache"


def _tiny_policy(cache):
    from treadle.models import TinyTrainConfig, load_default_model

    return load_default_model(config=TinyTrainConfig.quick(steps=2, eval_per_level=1), name="tiny-qwen3-quick",
                              progress=False)


def test_quick_demo_end_to_end(cache, tmp_path):
    console = Console(record=True, width=140)
    summary = train_demo.run(tmp_path / "run", True, console)
    run = tmp_path / "run"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["demo"]["steps"] == 2 and cfg["level"] == summary["level"]
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0 and s["completion_tokens"] > 0 and s["t_advantage_s"] >= 0
    assert (run / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((run / "summary.json").read_text()) == summary
    # the reported change is the paired after - before on the same held-out prompts, inside its interval
    for key, before, after in (("heldout_sampled_reward", "heldout_sampled_reward_before", "heldout_sampled_reward_after"),
                               ("heldout_greedy_acc", "heldout_greedy_acc_before", "heldout_greedy_acc_after")):
        assert summary[f"{key}_change"] == pytest.approx(summary[after] - summary[before], abs=1e-12)
        low, high = summary[f"{key}_change_ci95"]
        assert low <= summary[f"{key}_change"] <= high
    out = console.export_text()
    assert "held-out sampled reward" in out and "grpo_advantages" in out
    assert (cache / "tiny-qwen3-quick").is_dir()  # quick mode never touches the real default model
    assert not (cache / "tiny-qwen3").exists()


def test_group_ids_are_prompt_uids_not_positions(cache, monkeypatch):
    import treadle.ops

    model, tok = _tiny_policy(cache)
    seen = []
    real = treadle.ops.grpo_advantages

    def spy(rewards, group_ids, **kw):
        seen.append(group_ids.clone())
        return real(rewards, group_ids, **kw)

    monkeypatch.setattr(treadle.ops, "grpo_advantages", spy)
    cfg = train_demo.GRPODemoConfig.quick(steps=1, prompts_per_step=3, group_size=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recs = train_demo.train_grpo(model, tok, cfg, level=2, progress=False)
    from treadle.data import ProblemGenerator

    uids = [p.uid for p in ProblemGenerator(cfg.seed).batch(2, 3, split="train")]
    assert seen[0].tolist() == [u for u in uids for _ in range(2)]
    assert len(recs) == 1 and recs[0]["completion_tokens"] > 0
    changed = any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert changed or recs[0]["groups_all_equal"] == 3  # all-equal groups give zero advantages, no update


def test_sequence_logprobs_match_generation_scores(cache):
    from treadle.models.generation import encode_prompts

    model, tok = _tiny_policy(cache)
    ids, mask = encode_prompts(tok, ["What is 3+4?", "Ann has 7 pens. What is 33*(5+6)?"])  # one row left-padded
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0, top_p=1.0,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    comp = out.sequences[:, ids.shape[1]:]
    want = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    got = train_demo.sequence_logprobs(model, ids, mask, comp, torch.ones_like(comp))
    live = torch.isfinite(want)
    torch.testing.assert_close(got[live], want[live], atol=1e-4, rtol=1e-4)


def test_bad_level_is_rejected_before_work(cache):
    model, tok = _tiny_policy(cache)
    with pytest.raises(ValueError, match="difficulty level"):
        train_demo.train_grpo(model, tok, train_demo.GRPODemoConfig.quick(), level=42, progress=False)


def test_paired_change_values():
    before = torch.tensor([0.0, 0.5, 1.0, 0.25])
    after = torch.tensor([0.5, 0.5, 1.0, 1.0])
    mean, low, high = train_demo.paired_change(before, after)
    d = torch.tensor([0.5, 0.0, 0.0, 0.75], dtype=torch.float64)
    half = 1.96 * d.std().item() / 2.0
    assert mean == pytest.approx(0.3125) and low == pytest.approx(0.3125 - half) and high == pytest.approx(0.3125 + half)
    assert train_demo.paired_change(torch.ones(1), torch.zeros(1)) == (-1.0, -1.0, -1.0)
    with pytest.raises(ValueError, match="per-prompt"):
        train_demo.paired_change(torch.ones(3), torch.ones(4))


@pytest.mark.parametrize("bad, field", [(dict(lr=0.0), "lr"), (dict(lr=float("nan")), "lr"), (dict(steps=0), "steps"),
                                        (dict(steps=True), "steps"), (dict(group_size=1), "group_size"),
                                        (dict(level=7), "level"), (dict(level=0), "level"),
                                        (dict(temperature=0.0), "temperature"), (dict(clip_low=1.0), "clip_low"),
                                        (dict(loss_agg_mode="seq-mean-token-sum-norm"), "loss_agg_mode"),
                                        (dict(eval_prompts=0), "eval_prompts"), (dict(typo=1), "typo")])
def test_bad_config_names_the_field(bad, field):
    import pydantic

    with pytest.raises(pydantic.ValidationError, match=field):
        train_demo.GRPODemoConfig(**bad)


def test_config_is_frozen_and_serialisable():
    import dataclasses

    cfg = train_demo.GRPODemoConfig(level=3)
    assert dataclasses.asdict(cfg)["level"] == 3 and json.dumps(dataclasses.asdict(cfg))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0


def test_update_kl_is_k3_kl_between_sampling_and_updated_policy(cache):
    """``update_kl`` (per step) = masked token mean of ``kl_k3(pi_old, pi_new)`` on the step's own batch,
    recomputed here from a copy of the policy before the step and the policy after it."""
    import copy

    from treadle.data import ProblemGenerator
    from treadle.grpo.losses import kl_k3
    from treadle.models.generation import generate

    model, tok = _tiny_policy(cache)
    cfg = train_demo.GRPODemoConfig.quick(steps=1, prompts_per_step=4, group_size=4, lr=1e-2, num_iterations=2)
    old_model = copy.deepcopy(model)
    rec = train_demo.train_grpo(model, tok, cfg, level=1, progress=False)[0]
    problems = ProblemGenerator(cfg.seed).batch(1, cfg.prompts_per_step, split="train")
    g = generate(old_model, tok, [p.prompt for p in problems], n=cfg.group_size, do_sample=True,
                 temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed * 100_003 + 0)
    with torch.no_grad():
        old = train_demo.sequence_logprobs(old_model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
        new = train_demo.sequence_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    m = g.completion_mask
    want = ((kl_k3(old, new) * m).sum() / m.sum()).item()
    assert rec["update_kl"] == pytest.approx(want, rel=1e-4, abs=1e-7)
    changed = any(not torch.equal(a, b) for a, b in zip(old_model.parameters(), model.parameters()))
    assert (want > 0) == changed  # a moved policy has a positive KL; all-equal groups (no update) give 0
