"""treadle.scale gates on a tiny Qwen3 + PEFT LoRA built from configs (no downloads)."""
from __future__ import annotations

import pytest
import torch

from treadle.testing import require_module

peft = require_module("peft")
transformers = require_module("transformers")

from treadle.ops import topk_entropy_from_hidden  # noqa: E402
from treadle.scale import (  # noqa: E402
    GateError,
    attach_gates,
    gated_layers,
    lambda_report,
    lambda_shares,
    load_gates,
    record_lambda,
    save_gates,
)


GATE = dict(L=-1.0, U=2.0, tau=1.0)


def tiny_qwen3(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def peft_model(seed: int = 0, **lora):
    model = tiny_qwen3(seed)
    kw = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    kw.update(lora)
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(model, peft.LoraConfig(**kw))


def _ids(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 211, (2, 11), generator=g)


def test_attach_counts_freezes_and_keeps_stage_one_outputs():
    pm = peft_model()
    ids = _ids()
    with torch.no_grad():
        before = pm(input_ids=ids).logits
    lora_layers = {n: m for n, m in pm.named_modules() if isinstance(m, peft.tuners.lora.Linear)}
    assert len(lora_layers) == 2 * 7  # q k v o gate up down per layer
    params = attach_gates(pm, L=-2.0, U=3.0, tau=0.5)
    assert sum(p.numel() for p in params) == sum(m.in_features + 1 for m in lora_layers.values())
    trainable = [p for p in pm.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in params}
    assert set(gated_layers(pm)) == set(lora_layers)
    record_lambda(pm)
    with torch.no_grad():
        after = pm(input_ids=ids).logits
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    for m in gated_layers(pm).values():
        assert torch.equal(m.scale_last_lambda, torch.ones_like(m.scale_last_lambda))
    # PEFT's own paths stay available: adapters disabled = the base model
    with pm.disable_adapter(), torch.no_grad():
        base = pm(input_ids=ids).logits
    assert not torch.allclose(base, before)


def test_only_gates_train_on_topk_entropy():
    pm = peft_model()
    params = attach_gates(pm, L=-2.0, U=3.0, tau=1.0)
    frozen = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD(params, lr=0.5)
    ids = _ids(1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False  # prompt positions
    losses = []
    for _ in range(3):
        out = pm(input_ids=ids, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        loss = topk_entropy_from_hidden(hidden, pm.get_output_embeddings().weight, k=20, mask=mask, chunk_size=5)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in params)
        assert all(p.grad is None for n, p in pm.named_parameters() if not p.requires_grad)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), n
    assert any(float(p.detach().abs().sum()) > 0 for p in params)
    record_lambda(pm)
    with torch.no_grad():
        pm(input_ids=ids)
    lam = next(iter(gated_layers(pm).values())).scale_last_lambda
    shares = lambda_shares(lam, mask)
    assert abs(sum(shares.values()) - 1) < 1e-9
    report = lambda_report(pm, mask)
    assert set(report["per_type"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(report["per_module"]) == 14 and abs(sum(report["overall"].values()) - 1) < 1e-9


def test_save_load_round_trip(tmp_path):
    pm = peft_model()
    params = attach_gates(pm, L=-1.5, U=2.5, tau=0.8)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.3)
    ids = _ids(2)
    with torch.no_grad():
        expected = pm(input_ids=ids).logits
    path = save_gates(pm, tmp_path / "gates.safetensors")
    fresh = peft_model()
    loaded = load_gates(fresh, path)
    assert len(loaded) == len(params)
    assert next(iter(gated_layers(fresh).values())).scale_config == next(iter(gated_layers(pm).values())).scale_config
    with torch.no_grad():
        got = fresh(input_ids=ids).logits
    assert torch.equal(got, expected)
    # loading again onto the now-gated model works (same config), a different layout does not
    load_gates(fresh, path)
    with pytest.raises(GateError, match="layout differs"):
        load_gates(peft_model(r=8), path)
    with pytest.raises(GateError, match="layout differs"):
        load_gates(peft_model(target_modules=["q_proj", "v_proj"]), path)
    other = peft_model()
    attach_gates(other, L=-1.0, U=2.5, tau=0.8)
    with pytest.raises(GateError, match="config"):
        load_gates(other, path)


def _unchanged(pm):
    return (not gated_layers(pm)) and all(p.requires_grad == ("lora_" in n) for n, p in pm.named_parameters())


def test_refusals_name_the_layer_and_change_nothing():
    pm = peft_model()
    for kw, msg in ((dict(L=0.0), "L must be < 0"), (dict(U=1.0), "U must be > 1"), (dict(tau=0.0), "tau must be")):
        with pytest.raises(GateError, match=msg):
            attach_gates(pm, **{**dict(L=-1.0, U=2.0, tau=1.0), **kw})
        assert _unchanged(pm)

    merged = peft_model()
    merged.merge_adapter()
    with pytest.raises(GateError, match=r"layer '.*q_proj'.*merged"):
        attach_gates(merged, **GATE)

    dora = peft_model(use_dora=True)
    with pytest.raises(GateError, match=r"layer '.*'.*variant"):
        attach_gates(dora, **GATE)
    assert _unchanged(dora)

    drop = peft_model(lora_dropout=0.1)
    with pytest.raises(GateError, match=r"layer '.*'.*dropout"):
        attach_gates(drop, **GATE)
    assert _unchanged(drop)
    attach_gates(drop, **GATE, disable_dropout=True)
    assert gated_layers(drop)

    multi = peft_model()
    multi.add_adapter("second", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    multi.base_model.set_adapter(["default", "second"])
    with pytest.raises(GateError, match="2 are active"):
        attach_gates(multi, **GATE)

    with pytest.raises(GateError, match="no PEFT LoRA layers"):
        attach_gates(tiny_qwen3(), **GATE)

    emb = peft_model(target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(GateError, match=r"layer '.*embed_tokens'"):
        attach_gates(emb, **GATE)
    assert _unchanged(emb)

    twice = peft_model()
    attach_gates(twice, **GATE)
    with pytest.raises(GateError, match="already has gates"):
        attach_gates(twice, **GATE)


def test_fused_and_unfused_paths_agree():
    """Frozen base: the base GEMM is fused (gated_lora_linear); a trainable base runs on its own (gated_lora)."""
    pm = peft_model()
    params = attach_gates(pm, L=-2.0, U=3.0, tau=0.7)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.5)
    ids = _ids(4)
    fused = pm(input_ids=ids).logits
    for m in gated_layers(pm).values():
        m.base_layer.weight.requires_grad_(True)
    unfused = pm(input_ids=ids).logits
    # float32 rounding differs: the Triton backend's fused GEMM sums the base and LoRA terms in one
    # accumulator in its own order (both paths are ~1e-5 from a float64 run of this model)
    torch.testing.assert_close(unfused, fused, atol=5e-5, rtol=1e-4)
    unfused.square().mean().backward()
    layer = next(iter(gated_layers(pm).values()))
    assert layer.base_layer.weight.grad is not None and layer.scale_gate_weight.grad is not None
