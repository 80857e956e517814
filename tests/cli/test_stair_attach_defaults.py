"""``treadle.stair.attach(model)`` works with its default on any depth (layers="auto", as the CLI)."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from treadle.models import build_tiny_model
from treadle.models.tiny import build_tokenizer
from treadle.stair import UnsupportedModelError, attach, default_layers


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("depth, expected", [(1, (0,)), (2, (0, 1)), (4, (0, 2, 3)), (20, (3, 11, 19))])
def test_default_attach_adapts_to_the_depth(tok, depth, expected):
    torch.manual_seed(0)
    model = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_hidden_layers=depth,
                             hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    assert default_layers(model) == expected
    ids = torch.randint(0, len(tok), (1, 5))
    ref = model(ids).logits
    ctrl = attach(model)
    assert ctrl.layers == expected
    assert torch.equal(model(ids).logits, ref)
    ctrl.detach()
    with attach(model, layers="auto") as ctrl2:
        assert ctrl2.layers == expected


def test_default_on_a_hybrid_model_picks_only_softmax_layers(tok):
    model = build_tiny_model("qwen3_5", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    layers = default_layers(model)
    assert layers and all(isinstance(getattr(model.model.layers[i], "self_attn", None), torch.nn.Module) for i in layers)


def test_bad_layers_values(tok):
    model = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="layers must be 'auto'"):
        attach(model, layers="all")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        attach(gpt2)
