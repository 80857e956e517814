"""Tiny randomly initialised models of every supported architecture forward and backward a batch."""
import pytest
import torch

from treadle.models import ARCHITECTURES, build_tiny_model, tiny_config


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_forward_backward_padded_batch(arch):
    model = build_tiny_model(arch, seed=1)
    ids = torch.randint(1, 128, (3, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    assert out.logits.shape == (3, 11, 128)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(p.numel() for p in model.parameters()) < 500_000


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_seeded_and_single_row_matches_batch(arch):
    a, b = build_tiny_model(arch, seed=3), build_tiny_model(arch, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    ids = torch.randint(1, 128, (2, 6))
    with torch.no_grad():
        full = a(input_ids=ids).logits
        one = a(input_ids=ids[1:]).logits
    torch.testing.assert_close(full[1:], one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_hybrid_gated_attention_layout(arch):
    cfg = tiny_config(arch, num_hidden_layers=8)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    model = build_tiny_model(arch, num_hidden_layers=4)
    attn = model.model.layers[3].self_attn  # the full-attention layer
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    assert attn.q_proj.out_features == 2 * heads * hd  # queries + per-head output gate


def test_bad_arguments():
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_model("gpt2")
    with pytest.raises(TypeError, match="dtype"):
        build_tiny_model("qwen3", dtype=torch.int64)
