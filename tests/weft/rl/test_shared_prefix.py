"""Shared prefixes in WEFT GRPO. The sampler's prefill once per distinct context (``HFSampler``): the
same tokens as ``generate``'s own prefill of every row. The update's log-probs with each distinct prefix
run once (``_row_logprobs``: the prefix's K/V repeated over the candidates that follow it) equal the full
right-padded forward (``_logprobs`` on ``_rows_batch``) on every policy position, outputs and gradients,
in float64 and float32; ragged groups, one-token and empty responses, a prefix of one token and a lone
candidate included."""
import pytest
import torch

from treadle.weft.rl.train import _logprobs, _row_logprobs, _rows_batch


def _model(dtype):
    from treadle.models.builders import build_tiny_model

    return build_tiny_model("qwen3", seed=0, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1).to(dtype)


def _rows():
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(2, 97, (n,), generator=g).tolist()  # noqa: E731
    rows = []
    for n_prefix, lens in ((37, (5, 1, 12, 9)), (1, (3, 7)), (23, (8,)), (11, (0, 4))):
        p = rand(n_prefix)
        rows += [(p, rand(n), [1] * n, 0.5) for n in lens]
    rows.insert(3, (rows[0][0], rand(6), [1, 0, 1, 1, 0, 1], -1.0))  # same prefix, not adjacent: merged
    return rows


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_shared_prefix_logprobs_and_gradients_equal_the_full_forward(dtype, tol):
    model = _model(dtype)
    rows = _rows()
    ids, mask, _ = _rows_batch(rows, 0)
    full = _logprobs(model, ids)
    (full * mask).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = _row_logprobs(model, rows, ids.shape[1])
    assert got.shape == full.shape and got.dtype == torch.float32
    torch.testing.assert_close(got * mask, full * mask, rtol=tol, atol=tol)
    span = torch.zeros_like(mask)  # each row's response positions (policy mask 0 inside a response too)
    for i, (p, resp, _, _) in enumerate(rows):
        span[i, len(p) - 1:len(p) - 1 + len(resp)] = 1
    assert not (got * (1 - span)).any()  # zeros before the response and in the padding
    (got * mask).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=tol, atol=tol * float(want[n].abs().max()), msg=n)


def test_the_comparison_can_fail():
    """A response scored after another prefix (its last token changed) gives other log-probs on its policy
    positions: the check above is not vacuous."""
    model = _model(torch.float64)
    rows = _rows()
    ids, mask, _ = _rows_batch(rows, 0)
    p = rows[0][0]
    other = [(p[:-1] + [(p[-1] + 1) % 97 or 2], *rows[0][1:])] + rows[1:]
    got, full = _row_logprobs(model, other, ids.shape[1]), _logprobs(model, ids)
    assert not torch.allclose(got[0] * mask[0], full[0] * mask[0], rtol=1e-3, atol=1e-3)


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
