"""SCALE Stage I (LoRA SFT), Stage II (gate training), ablations and the (L, U) sweep on tiny models."""
from __future__ import annotations

import json

import pytest
import torch

from treadle.testing import require_module

peft = require_module("peft")

from treadle.models import build_tiny_model  # noqa: E402
from treadle.ops import topk_entropy  # noqa: E402
from treadle.scale import (  # noqa: E402
    GateError,
    ScaleTrainConfig,
    SFTConfig,
    attach_gates,
    clamp_lambda,
    gate_objective,
    gated_layers,
    load_gates,
    load_stage_one,
    record_lambda,
    sft,
    train,
)
from treadle.scale.batches import collate, problem_pairs  # noqa: E402
from treadle.data import generate_problems  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(autouse=True)
def _integration(monkeypatch, one_thread):
    # integration tests: the kernels' own backends (C++ or the reference) instead of the Triton
    # interpreter that tests/conftest.py turns on (the kernels are checked in test_gated_lora.py etc.)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _model(tok, seed=0):
    """A tiny Qwen3 whose (tied) head is scaled up, so that its next-token distributions are far from uniform
    (a random tiny model's are nearly uniform: entropy ~ 1, hardly moved by any gate)."""
    model = build_tiny_model("qwen3", seed=seed, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **SMALL).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def _stage_one(tok, seed=0):
    """A tiny base wrapped with a LoRA adapter whose B is non-zero (so gates matter)."""
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(_model(tok, seed), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                                  init_lora_weights=False))


def _others(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "scale_gate" not in n}


QUICK = dict(train_size=16, batch_size=8, eval_size=3, eval_levels=(1,), max_new_tokens=4)


def test_batches_mark_the_positions_that_predict_the_response(tok):
    probs = generate_problems(1, 3, seed=0)
    pairs = problem_pairs(tok, probs)
    assert all(r[-1] == tok.eos_token_id for _, r in pairs)
    b = collate(pairs, tok.pad_token_id)
    for i, (p, r) in enumerate(pairs):
        pos = b.response_mask[i].nonzero().flatten().tolist()
        assert pos == list(range(len(p) - 1, len(p) + len(r) - 1))  # next token is a response token
        assert b.labels[i, len(p):len(p) + len(r)].tolist() == r
        assert b.attention_mask[i].sum() == len(p) + len(r)
    with pytest.raises(ValueError, match="no response positions"):
        collate([(pairs[0][0], [])], tok.pad_token_id)


def test_sft_lowers_loss_and_writes_a_loadable_adapter(tmp_path, tok):
    cfg = SFTConfig(steps=25, batch_size=16, lr=3e-2, probe_size=16)
    res = sft(_model(tok), tok, cfg, tmp_path / "sft")
    assert res.probe_loss_after < res.probe_loss_before - 0.2
    acfg = json.loads((res.adapter_path / "adapter_config.json").read_text())
    assert acfg["r"] == 16 and acfg["lora_alpha"] == 16 and acfg["peft_type"] == "LORA"
    assert {m.rsplit(".", 1)[-1] for m in acfg["target_modules"]} == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"}
    assert len((tmp_path / "sft" / "log.jsonl").read_text().splitlines()) == cfg.steps
    ids = collate(problem_pairs(tok, generate_problems(2, 2, seed=5)), tok.pad_token_id)
    reloaded = load_stage_one(_model(tok), res.adapter_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids.input_ids).logits, res.model(input_ids=ids.input_ids).logits)
    with pytest.raises(ValueError, match="already has LoRA"):
        sft(res.model, tok, SFTConfig.quick())
    with pytest.raises(FileNotFoundError):
        load_stage_one(_model(tok), tmp_path / "nope")
    with pytest.raises(ValueError, match="not a PEFT adapter"):
        load_stage_one(_model(tok), tmp_path / "sft")


def test_stage_two_trains_only_gates_and_lowers_the_entropy(tmp_path, tok):
    pm = _stage_one(tok)
    frozen = _others(pm)
    lora = {n: m for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    s = train(pm, tok, ScaleTrainConfig(epochs=4, lr=3e-2, **QUICK), tmp_path / "run")
    assert s["objective_after"] < s["objective_before"] - 1e-3
    assert s["gate_params"] == sum(m.in_features + 1 for m in lora.values())
    after = _others(pm)
    assert frozen.keys() == after.keys()
    assert all(torch.equal(frozen[n], after[n]) for n in frozen)
    assert {id(p) for p in pm.parameters() if p.requires_grad} == {
        id(p) for m in gated_layers(pm).values() for p in (m.scale_gate_weight, m.scale_gate_bias)}
    # zero gates = the Stage-I model: lambda is exactly 1 before training
    assert s["before"]["lambda"]["overall"] == {"reverse": 0.0, "suppress": 0.0, "keep": 1.0, "extrapolate": 0.0}
    lam = s["after"]["lambda"]
    assert set(lam["per_type"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert set(lam["per_layer"]) == {0, 1}
    for shares in [lam["overall"], *lam["per_type"].values(), *lam["per_layer"].values()]:
        assert sum(shares.values()) == pytest.approx(1.0)
    out = tmp_path / "run"
    for f in ("config.json", "summary.json", "gates.safetensors", "lambda_hist.png"):
        assert (out / f).exists(), f
    kinds = [json.loads(x)["type"] for x in (out / "log.jsonl").read_text().splitlines()]
    assert kinds[0] == "config" and kinds.count("step") == s["steps"] and kinds.count("eval") == 2
    # the saved gates reproduce the trained model on a fresh Stage-I copy
    fresh = _stage_one(tok)
    load_gates(fresh, out / "gates.safetensors")
    ids = collate(problem_pairs(tok, generate_problems(1, 2, seed=9)), tok.pad_token_id).input_ids
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, pm(input_ids=ids).logits)


def test_stage_two_is_deterministic(tok):
    cfg = ScaleTrainConfig(epochs=1, lr=3e-2, **QUICK)
    a = train(_stage_one(tok), tok, cfg, evaluate_model=False)
    b = train(_stage_one(tok), tok, cfg, evaluate_model=False)
    assert a["losses"] == b["losses"]


@pytest.mark.parametrize("no_reverse,no_extrapolate", [(True, False), (False, True), (True, True)])
def test_ablation_flags_bound_lambda(tok, no_reverse, no_extrapolate):
    cfg = ScaleTrainConfig(L=-3.0, U=3.0, epochs=3, lr=0.3, no_reverse=no_reverse, no_extrapolate=no_extrapolate,
                           **QUICK)
    pm = _stage_one(tok)
    train(pm, tok, cfg, evaluate_model=False)  # a large lr: the gates saturate (bounds tested, not the fit)
    record_lambda(pm)
    ids = collate(problem_pairs(tok, generate_problems(2, 6, seed=3)), tok.pad_token_id).input_ids
    with torch.no_grad():
        pm(input_ids=ids)
    lam = torch.cat([m.scale_last_lambda.reshape(-1) for m in gated_layers(pm).values()])
    if no_reverse:
        assert lam.min() >= 0
    else:
        assert lam.min() < 0  # the large lr makes the free side reach past 0 / 1: the bound is what stops it
    if no_extrapolate:
        assert lam.max() <= 1
    else:
        assert lam.max() > 1
    assert ((lam == 0) if no_reverse else (lam == 1)).any()  # the clamp binds on some tokens


def test_clamped_layers_match_the_fused_op_at_zero_initialised_gates(tok):
    """At v = 0 (every token of a zero-initialised gate, where Stage II starts) lambda has a kink: the
    clamped layers must use the fused op's midpoint slope (U - L) / 2, not the sum of both sides."""
    a, b = _stage_one(tok), _stage_one(tok)
    for pm in (a, b):
        attach_gates(pm, -2.0, 3.0, 0.7)
    clamp_lambda(b, -10.0, 10.0)
    ids = collate(problem_pairs(tok, generate_problems(1, 3, seed=1)), tok.pad_token_id)
    for pm in (a, b):
        gate_objective(pm, ids, k=50).backward()
    for ma, mb in zip(gated_layers(a).values(), gated_layers(b).values()):
        torch.testing.assert_close(ma.scale_gate_weight.grad, mb.scale_gate_weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ma.scale_gate_bias.grad, mb.scale_gate_bias.grad, rtol=1e-4, atol=1e-6)


def test_clamped_forward_matches_the_fused_op_when_the_clamp_never_binds(tok):
    torch.manual_seed(0)
    a, b = _stage_one(tok), _stage_one(tok)
    for pm in (a, b):
        attach_gates(pm, -2.0, 3.0, 0.7)
        with torch.no_grad():
            for m in gated_layers(pm).values():
                g = torch.Generator().manual_seed(1)
                m.scale_gate_weight.copy_(torch.randn(m.scale_gate_weight.shape, generator=g))
                m.scale_gate_bias.fill_(0.1)
    assert clamp_lambda(b, -10.0, 10.0) == len(gated_layers(b))
    ids = collate(problem_pairs(tok, generate_problems(1, 3, seed=1)), tok.pad_token_id)
    losses = []
    for pm in (a, b):
        loss = gate_objective(pm, ids, k=50)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (n, ma), mb in zip(gated_layers(a).items(), gated_layers(b).values()):
        torch.testing.assert_close(ma.scale_gate_weight.grad, mb.scale_gate_weight.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(ma.scale_gate_bias.grad, mb.scale_gate_bias.grad, rtol=1e-4, atol=1e-6)
    clamp_lambda(b)  # back to the fused op
    assert all(not hasattr(m, "scale_lambda_bounds") for m in gated_layers(b).values())
    with pytest.raises(ValueError, match="lo must be < hi"):
        clamp_lambda(b, 1.0, 0.0)
    with pytest.raises(GateError, match="no gates"):
        clamp_lambda(_stage_one(tok), 0.0, None)


def test_entropy_objective_equals_the_literal_top_k_entropy(tok):
    pm = _stage_one(tok)
    batch = collate(problem_pairs(tok, generate_problems(1, 3, seed=2)), tok.pad_token_id)
    with torch.no_grad():
        logits = pm(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        want = topk_entropy(logits, 50, batch.response_mask)
        got = gate_objective(pm, batch, k=50)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    empty = collate(problem_pairs(tok, generate_problems(1, 1, seed=2)), tok.pad_token_id)
    empty.response_mask[:] = False
    with pytest.raises(ValueError, match="no response positions"):
        gate_objective(pm, empty)


def test_ce_calibration_and_sampled_responses(tok):
    s = train(_stage_one(tok), tok, ScaleTrainConfig(objective="ce", epochs=3, lr=3e-2, **QUICK), evaluate_model=False)
    assert s["objective"] == "ce" and s["objective_after"] < s["objective_before"]
    assert s["objective_before"] > 1.0  # a CE in nats, not a normalised entropy
    s = train(_stage_one(tok), tok, ScaleTrainConfig(responses="sampled", epochs=1, **QUICK), evaluate_model=False)
    assert s["steps"] == 2
    with pytest.raises(ValueError, match="dataset"):
        ScaleTrainConfig(objective="ce", responses="sampled")


@pytest.mark.parametrize("kw,match", [
    (dict(L=0.0), r"L\n.*less than 0"), (dict(L=float("nan")), r"L\n.*finite"), (dict(U=1.0), r"U\n.*greater than 1"),
    (dict(tau=0.0), r"tau\n.*greater than 0"), (dict(k=1), r"k\n.*greater than or equal to 2"),
    (dict(k=2.5), r"k\n.*valid integer"), (dict(responses="x"), r"responses\n.*'dataset' or 'sampled'"),
    (dict(objective="kl"), r"objective\n.*'entropy' or 'ce'"), (dict(levels=(9,)), r"levels\n.*level"),
    (dict(levels=()), r"levels\n.*at least one"), (dict(epochs=0), r"epochs\n.*greater than or equal to 1"),
    (dict(lr=float("inf")), r"lr\n.*finite"), (dict(bogus=1), "bogus"),
    (dict(objective="ce", responses="sampled"), r"objective\n.*dataset")])
def test_config_refuses_bad_values(kw, match):
    """A pydantic ValidationError (a ValueError) naming the field and the range or choices."""
    with pytest.raises(ValueError, match=match):
        ScaleTrainConfig(**kw)


def test_config_accepts_its_boundary_values():
    c = ScaleTrainConfig(L=-1e-12, U=1 + 1e-12, tau=1e-9, k=2, epochs=1, batch_size=1, train_size=1, eval_size=1,
                         max_new_tokens=1, levels=(6,), eval_levels=(1,), objective="ce", responses="dataset")
    assert (c.k, c.levels, c.objective) == (2, (6,), "ce")


def test_train_refuses_models_it_cannot_gate_before_any_change(tok):
    plain = _model(tok)
    before = _others(plain)
    with pytest.raises(GateError, match="no PEFT LoRA layers"):
        train(plain, tok, ScaleTrainConfig.quick())
    assert not gated_layers(plain)
    assert all(torch.equal(before[n], p) for n, p in plain.named_parameters())
    pm = _stage_one(tok)
    attach_gates(pm, -1.0, 2.0, 1.0)
    with pytest.raises(GateError, match="already has gates"):
        train(pm, tok, ScaleTrainConfig.quick())


def test_k_is_clamped_to_the_vocabulary(tok):
    s = train(_stage_one(tok), tok, ScaleTrainConfig(k=1000, epochs=1, **QUICK), evaluate_model=False)
    assert s["k"] == len(tok)


def test_lambda_shares_count_exactly_one_as_keep():
    from treadle.scale import lambda_shares

    s = lambda_shares(torch.tensor([-0.5, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0]))
    assert s == {"reverse": 1 / 8, "suppress": 2 / 8, "keep": 2 / 8, "extrapolate": 3 / 8}


def test_a_bad_out_dir_is_refused_before_the_model_changes(tmp_path, tok):
    from treadle.scale.sft import _has_lora

    afile = tmp_path / "afile"
    afile.write_text("x")
    for bad, match in ((afile, "exists and is a file, not a folder"), (afile / "sub", "is a file")):
        pm = _stage_one(tok)
        frozen = _others(pm)
        with pytest.raises(ValueError, match=match):
            train(pm, tok, ScaleTrainConfig.quick(), bad)
        assert not gated_layers(pm)
        assert all(torch.equal(frozen[n], p) for n, p in pm.named_parameters())
        base = _model(tok)
        with pytest.raises(ValueError, match=match):
            sft(base, tok, SFTConfig.quick(), bad)
        assert not _has_lora(base) and not hasattr(base, "peft_config")


def test_all_linear_targets_only_gateable_linears_on_a_moe_model(tok):
    from treadle.scale.sft import linear_targets

    model = build_tiny_model("qwen3_next", vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=32,
                             num_hidden_layers=4).eval()
    names = linear_targets(model)
    assert "lm_head" not in names and not any(n.endswith("mlp.gate") or ".experts" in n for n in names)
    assert any(n.endswith("q_proj") for n in names) and any(n.endswith("in_proj_qkvz") for n in names)
    res = sft(model, tok, SFTConfig.quick(steps=1, batch_size=2, probe_size=2))
    wrapped = [type(m).__name__ for m in res.model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert wrapped and set(wrapped) == {"Linear"}  # no ParamWrapper around the router / experts
    params = attach_gates(res.model, -1.0, 2.0, 1.0)  # Stage II accepts every LoRA layer
    assert len(params) == 2 * len(names)


def test_load_gates_refuses_files_that_are_not_gate_files(tmp_path, tok):
    pm = _stage_one(tok)
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(GateError, match="summary.json"):
        load_gates(pm, tmp_path / "summary.json")
    from treadle.scale import save_gates

    donor = _stage_one(tok)
    attach_gates(donor, -1.0, 2.0, 1.0)
    data = save_gates(donor, tmp_path / "g.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(GateError, match="cut.safetensors"):
        load_gates(pm, tmp_path / "cut.safetensors")
    assert not gated_layers(pm)


def test_load_stage_one_errors_are_one_line(tmp_path, tok):
    pm = _stage_one(tok)
    pm.save_pretrained(tmp_path / "ad")
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "/somewhere/base"
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(cfg))
    other = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                             **dict(SMALL, hidden_size=64, intermediate_size=96))
    with pytest.raises(ValueError) as info:
        load_stage_one(other, tmp_path / "ad")
    msg = str(info.value)
    assert "\n" not in msg and "/somewhere/base" in msg and "more)" in msg and "size mismatch" not in msg
    weights = tmp_path / "ad" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_stage_one(_model(tok), tmp_path / "ad")


@pytest.mark.slow  # spawned workers import torch/transformers/peft: ~20 s on 2 busy cores
def test_sweep_2x2_in_two_processes(tmp_path, tok):
    from treadle.scale.sweep import sweep

    base = tmp_path / "base"
    _model(tok).save_pretrained(base)
    tok.save_pretrained(base)
    adapter = sft(_model(tok), tok, SFTConfig.quick(), tmp_path / "sft").adapter_path
    cfg = ScaleTrainConfig(epochs=1, lr=3e-2, **QUICK)
    res = sweep(base, adapter, [-2.0, -0.5], [1.5, 3.0], cfg, tmp_path / "sweep", jobs=2)
    assert (tmp_path / "sweep" / "heatmap.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert {(c["L"], c["U"]) for c in saved["cells"]} == {(-2.0, 1.5), (-2.0, 3.0), (-0.5, 1.5), (-0.5, 3.0)}
    assert res["jobs"] == 2 and 0 <= saved["baseline"]["accuracy_mean"] <= 1
    for c in saved["cells"]:
        assert c["objective_after"] <= c["objective_before"] + 1e-6
        assert (tmp_path / "sweep" / "cells" / f"L{c['L']:g}_U{c['U']:g}" / "gates.safetensors").exists()
    with pytest.raises(ValueError, match="L must be"):
        sweep(base, adapter, [0.0], [2.0], cfg, tmp_path / "bad")
    with pytest.raises(FileNotFoundError):
        sweep(base, tmp_path / "missing", [-1.0], [2.0], cfg, tmp_path / "bad")


def test_report_to_tensorboard(tmp_path, tok):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = train(_stage_one(tok), tok, ScaleTrainConfig(epochs=1, **QUICK), tmp_path, evaluate_model=False,
              report_to=["tensorboard"])
    (events,) = tmp_path.glob("runs/*/events.out.tfevents.*")  # the Trainer's TensorBoard folder
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(s["losses"], rel=1e-5)
    with pytest.raises(ValueError, match="unknown report_to"):
        train(_stage_one(tok), tok, ScaleTrainConfig(epochs=1, **QUICK), report_to="nope")
