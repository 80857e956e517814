"""Shared prefixes in WEFT sampling: the sampler's prefill once per distinct context (``HFSampler``, used by
``treadle weft groups`` and the held-out evaluation) draws the same tokens as ``generate``'s own prefill of
every row."""
import pytest
import torch



def _model(dtype):
    from treadle.models.builders import build_tiny_model

    return build_tiny_model("qwen3", seed=0, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_shared_prefill_samples_what_generate_samples(temperature):
    """Duplicated contexts (a group's G candidates), ragged lengths (left padding) and a one-token context:
    the same completions, token for token, with the prefill shared as with ``generate`` prefilling every row
    (float64: no rounding difference can flip a draw)."""
    from treadle.weft.rl.sampling import HFSampler, left_padded

    class _Tok:
        pad_token_id, eos_token_id = 0, 1

    model = _model(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    ctx = [torch.randint(2, 97, (n,), generator=g).tolist() for n in (9, 30, 1, 17)]
    rows = [(None, 0, c) for c in (ctx[0], ctx[1], ctx[0], ctx[2], ctx[1], ctx[3], ctx[0], ctx[2])]
    s = HFSampler(model, _Tok(), temperature=temperature, max_new_tokens=12)
    ids, mask = left_padded(rows, 0)
    assert s._shared_prefill(rows, ids, mask)  # the shared path is taken (4 distinct contexts of 8 rows)
    assert not s._shared_prefill(rows[:2], *left_padded(rows[:2], 0))  # all distinct: generate's own prefill
    shared = s.generate(rows, 7)
    s._shared_prefill = lambda *a: {}
    assert shared == s.generate(rows, 7)
    assert shared[0] != shared[2] or temperature == 0  # equal contexts, distinct draws
