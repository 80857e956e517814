"""Merging a gated SCALE model: constant gates fold exactly into the merged weight,
token-dependent gates are refused before any change, remove_gates() gives back the Stage-I LoRA, and
gates on an untrained LoRA (B = 0) get zero gradient (with a warning)."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from treadle.scale import GateError, attach_gates, gated_layers, remove_gates  # noqa: E402

GATE = dict(L=-1.0, U=2.5, tau=0.7)


def tiny_qwen3(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg).eval()


def peft_model(seed: int = 0, init_lora_weights=False):
    model = tiny_qwen3(seed)
    torch.manual_seed(seed + 1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                          init_lora_weights=init_lora_weights)
    return peft.get_peft_model(model, cfg)


IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def set_gates(pm, *, token_dependent: bool, seed: int = 0):
    """Non-trivial gates: a different bias per layer; weights non-zero only if token_dependent."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in gated_layers(pm).values():
            m.scale_gate_bias.copy_(torch.randn(1, generator=g))
            if token_dependent:
                m.scale_gate_weight.copy_(torch.randn(m.scale_gate_weight.shape, generator=g))


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_constant_gates_fold_exactly_into_merge_and_unload():
    pm = peft_model()
    attach_gates(pm, **GATE)
    set_gates(pm, token_dependent=False)
    lam = {n: m.scale_constant_lambda() for n, m in gated_layers(pm).items()}
    assert len(set(lam.values())) > 1 and all(v != 1.0 for v in lam.values())  # per-layer, not the trivial 1
    gated = logits(pm)
    stage_one = peft_model()  # same base and LoRA, no gates
    assert not torch.allclose(logits(stage_one), gated, atol=1e-4)
    merged = pm.merge_and_unload()
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
    torch.testing.assert_close(logits(merged), gated, atol=2e-5, rtol=2e-5)
    # the folded weight is W + lambda * scaling * B A, layer by layer
    ref = peft_model()
    for name, m in ref.named_modules():
        if isinstance(m, peft.tuners.lora.Linear):
            want = m.base_layer.weight + lam[name] * m.scaling["default"] * (m.lora_B["default"].weight
                                                                             @ m.lora_A["default"].weight)
            got = merged.get_submodule(name.removeprefix("base_model.model.")).weight
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_fresh_gates_merge_like_the_stage_one_lora():
    pm = peft_model()
    attach_gates(pm, **GATE)  # zero gates: lambda = 1
    merged = pm.merge_and_unload()
    torch.testing.assert_close(logits(merged), logits(peft_model().merge_and_unload()), atol=1e-6, rtol=1e-6)


def test_merge_adapter_and_unmerge_round_trip_with_constant_gates():
    pm = peft_model()
    attach_gates(pm, **GATE)
    set_gates(pm, token_dependent=False, seed=1)
    gated, before = logits(pm), weights(pm)
    pm.merge_adapter()
    assert all(m.merged for m in gated_layers(pm).values())
    torch.testing.assert_close(logits(pm), gated, atol=2e-5, rtol=2e-5)
    pm.unmerge_adapter()
    after = weights(pm)
    assert after.keys() == before.keys()
    for k in before:
        torch.testing.assert_close(after[k], before[k], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(pm), gated, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("how", ["merge_and_unload", "merge_adapter", "layer.merge", "get_delta_weight"])
def test_token_dependent_gates_refuse_every_merge_path_before_any_change(how):
    pm = peft_model()
    attach_gates(pm, **GATE)
    set_gates(pm, token_dependent=True)
    # one layer with a constant gate comes first in module order: it must not be merged either
    first = next(iter(gated_layers(pm).values()))
    with torch.no_grad():
        first.scale_gate_weight.zero_()
    gated, before = logits(pm), weights(pm)
    layer = list(gated_layers(pm).values())[1]
    with pytest.raises(GateError, match="cannot merge a gated SCALE adapter|depends on the token") as err:
        if how == "merge_and_unload":
            pm.merge_and_unload()
        elif how == "merge_adapter":
            pm.merge_adapter()
        elif how == "layer.merge":
            layer.merge()
        else:
            layer.get_delta_weight("default")
    if how != "get_delta_weight":
        assert "remove_gates" in str(err.value)
    if how in ("merge_and_unload", "merge_adapter"):  # names the layers and how many
        assert f"{len(gated_layers(pm)) - 1} layer(s)" in str(err.value)
    assert not any(m.merged for m in gated_layers(pm).values())
    assert len(gated_layers(pm)) == 14
    after = weights(pm)
    assert all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(logits(pm), gated, atol=0, rtol=0)


def test_remove_gates_returns_them_and_leaves_the_stage_one_lora():
    pm = peft_model()
    attach_gates(pm, **GATE)
    set_gates(pm, token_dependent=True)
    kept = {f"{n}.{p}": getattr(m, f"scale_gate_{p}").detach().clone()
            for n, m in gated_layers(pm).items() for p in ("weight", "bias")}
    removed = remove_gates(pm)
    assert removed.keys() == kept.keys() and all(torch.equal(removed[k], kept[k]) for k in kept)
    assert gated_layers(pm) == {}
    lora_layers = [m for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(lora_layers) == 14 and all(type(m) is peft.tuners.lora.Linear for m in lora_layers)
    assert not any(hasattr(m, "scale_gate_weight") or "scale_gate_weight" in dict(m.named_parameters())
                   for m in lora_layers)
    assert type(pm.base_model) is peft.LoraModel
    stage_one = peft_model()
    torch.testing.assert_close(logits(pm), logits(stage_one), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits(pm.merge_and_unload()), logits(stage_one.merge_and_unload()),
                               atol=1e-6, rtol=1e-6)
    with pytest.raises(GateError, match="no gates to remove"):
        remove_gates(peft_model())


def test_remove_gates_refuses_a_merged_model():
    pm = peft_model()
    attach_gates(pm, **GATE)
    set_gates(pm, token_dependent=False)
    pm.merge_adapter()
    with pytest.raises(GateError, match="unmerge_adapter"):
        remove_gates(pm)
    assert len(gated_layers(pm)) == 14 and all(m.merged for m in gated_layers(pm).values())


def test_gates_on_an_untrained_lora_get_zero_gradient_and_a_warning():
    pm = peft_model(init_lora_weights=True)  # PEFT's default: B = 0
    with pytest.warns(UserWarning, match="zero gradient"):
        params = attach_gates(pm, **GATE)
    out = pm(input_ids=IDS).logits
    (out.float() ** 2).mean().backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in params)
    # and with a trained (non-zero) B the same loss moves them: the zero is B's doing, not a dead graph
    pm2 = peft_model(init_lora_weights=False)
    params2 = attach_gates(pm2, **GATE)
    (pm2(input_ids=IDS).logits.float() ** 2).mean().backward()
    assert any(torch.count_nonzero(p.grad) > 0 for p in params2)
