"""SCALE Stage I on TRL's SFTTrainer: same LoRA defaults and targets, prompt tokens
masked, the same token sequences as treadle's own batches, SFTConfig validated by pydantic."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

from treadle.data.arithmetic import ProblemGenerator  # noqa: E402
from treadle.models.builders import build_tiny_model  # noqa: E402
from treadle.models.tiny import build_tokenizer  # noqa: E402
from treadle.scale.batches import problem_pairs  # noqa: E402
from treadle.scale.sft import SFTConfig, linear_targets, sft, stage_one_trainer  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def tiny(tok, seed=0):
    return build_tiny_model("qwen3", seed=seed, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **SMALL)


def test_trainer_sees_treadle_sequences_with_the_prompt_masked(tmp_path):
    tok = build_tokenizer()
    model = tiny(tok)
    cfg = SFTConfig.quick(steps=2, batch_size=5, levels=(1, 2, 6))
    trainer = stage_one_trainer(model, tok, cfg, tmp_path / "trainer")
    assert isinstance(trainer, trl.SFTTrainer)
    problems = ProblemGenerator(cfg.seed).mixture(10, {1: 1.0, 2: 1.0, 6: 1.0}, split="train")
    want = problem_pairs(tok, problems)  # (prompt ids, answer ids + EOS), as treadle's own batches
    ds = trainer.train_dataset
    assert len(ds) == cfg.steps * cfg.batch_size
    for row, (prompt, response) in zip(ds, want):
        assert row["input_ids"] == prompt + response
        assert row["labels"] == [-100] * len(prompt) + response  # TRL folded the completion mask in
    assert response[-1] == tok.eos_token_id
    # the collator turns the mask into labels: -100 on prompt and padding, the token on the response
    batch = trainer.data_collator([ds[i] for i in range(3)])
    for i, (prompt, response) in enumerate(want[:3]):
        labels = batch["labels"][i].tolist()
        assert labels[:len(prompt)] == [-100] * len(prompt)
        assert labels[len(prompt):len(prompt) + len(response)] == response
        assert all(x == -100 for x in labels[len(prompt) + len(response):])


def test_lora_defaults_and_targets_match_stage_one():
    tok = build_tokenizer()
    cfg = SFTConfig()
    assert (cfg.r, cfg.lora_alpha, cfg.target_modules) == (16, 16, "all-linear")
    model = tiny(tok)
    targets = linear_targets(model)
    res = sft(model, tok, SFTConfig.quick(steps=1, batch_size=2, probe_size=2))
    pc = res.model.peft_config["default"]
    assert (pc.r, pc.lora_alpha) == (16, 16) and set(pc.target_modules) == set(targets)
    lora = {n.removeprefix("base_model.model.") for n, m in res.model.named_modules()
            if isinstance(m, peft.tuners.lora.Linear)}
    assert lora == set(targets) and len(lora) == 2 * 7
    assert res.trainable == sum(p.numel() for n, p in res.model.named_parameters() if "lora_" in n)


def test_sft_trains_and_writes_the_run_folder(tmp_path):
    tok = build_tokenizer()
    res = sft(tiny(tok), tok, SFTConfig(steps=12, batch_size=8, lr=3e-2, probe_size=16), tmp_path / "run")
    assert len(res.losses) == 12 and res.probe_loss_after < res.probe_loss_before - 0.1
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(12)) and [x["loss"] for x in lines] == res.losses
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"] == json.loads(json.dumps(dataclasses.asdict(SFTConfig(steps=12, batch_size=8, lr=3e-2,
                                                                                    probe_size=16))))
    assert summary["trainer"] == "trl.SFTTrainer"
    assert "forward" not in vars(res.model)  # float32 by default: no accelerate autocast wrapper left behind
    loaded = peft.PeftModel.from_pretrained(tiny(tok), tmp_path / "run" / "adapter")
    ids = torch.tensor([tok("What is 3+4?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, res.model(input_ids=ids).logits)


def test_sft_config_is_validated_by_pydantic():
    import pydantic

    for bad, field in ((dict(r=0), "r"), (dict(r=True), "r"), (dict(lr=float("inf")), "lr"),
                       (dict(lora_dropout=1.0), "lora_dropout"), (dict(levels=()), "levels"),
                       (dict(levels=(9,)), "levels"), (dict(target_modules=()), "target_modules"),
                       (dict(target_modules="some"), "target_modules"), (dict(stepz=1), "stepz")):
        with pytest.raises(pydantic.ValidationError, match=field):
            SFTConfig(**bad)
    assert SFTConfig(target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj", "v_proj")
    with pytest.raises(dataclasses.FrozenInstanceError):
        SFTConfig().r = 3
