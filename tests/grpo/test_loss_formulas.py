"""Loss aggregation and the clipped policy loss against formulas written out independently here:
explicit Python loops over rows and tokens in float64, on ragged masks (rows of different lengths,
an empty row, a one-token row, holes where tool output is masked out), with garbage in the masked-out
positions so that any leak shows. Each formula is the one in the module docstring of
:mod:`treadle.grpo.losses` (verl ``agg_loss``; Dr.GRPO sec. 3.1; PPO eq. 7; dual-clip PPO).

A planted bug such as ``seq-mean-token-mean`` dividing by the padded width instead of each row's token
count changes the value on these masks by far more than the tolerance (see
``test_padded_width_bug_would_be_caught``).
"""
import math

import pytest
import torch

from treadle.grpo import LOSS_AGG_MODES, aggregate_loss, policy_loss

GARBAGE = 1.0e4  # value put where the mask is 0: must never reach the result


def _ragged(seed=0, dtype=torch.float64):
    """(B=6, T=7) loss and mask: lengths 7, 3, 0, 1, 5 (with a hole), 2 (not at the start)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1],  # multi-turn: tool output at t = 2, 3 is not the policy's
        [0, 0, 0, 1, 1, 0, 0],
    ]
    mask = torch.tensor(rows, dtype=torch.bool)
    loss = torch.randn(6, 7, generator=gen, dtype=torch.float64) + 0.3
    loss = torch.where(mask, loss, torch.full_like(loss, GARBAGE)).to(dtype)
    return loss, mask


def _by_hand(loss, mask, mode, *, global_tokens=None, global_seqs=None, norm_constant=None, dp_size=1):
    """The aggregation formulas, one row and one token at a time, in Python floats (float64)."""
    L = loss.detach().to(torch.float64).tolist()
    M = mask.tolist()
    row_sums, row_counts = [], []
    for lrow, mrow in zip(L, M):
        s, n = 0.0, 0
        for v, keep in zip(lrow, mrow):
            if keep:
                s += v
                n += 1
        row_sums.append(s)
        row_counts.append(n)
    tokens = sum(row_counts) if global_tokens is None else float(global_tokens)
    seqs = sum(1 for n in row_counts if n > 0) if global_seqs is None else float(global_seqs)
    if mode == "token-mean":
        return sum(row_sums) / tokens * dp_size
    if mode == "seq-mean-token-sum":
        return sum(row_sums) / seqs * dp_size
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(row_sums, row_counts) if n > 0) / seqs * dp_size
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sums) / (seqs * norm_constant) * dp_size
    raise AssertionError(mode)


def _weights_by_hand(mask, mode, *, global_tokens=None, global_seqs=None, norm_constant=None, dp_size=1):
    """d loss / d per_token_loss[b, t], by hand: what each token's loss is multiplied by."""
    M = mask.tolist()
    counts = [sum(r) for r in M]
    tokens = sum(counts) if global_tokens is None else global_tokens
    seqs = sum(1 for n in counts if n > 0) if global_seqs is None else global_seqs
    out = []
    for row, n in zip(M, counts):
        w = []
        for keep in row:
            if not keep:
                w.append(0.0)
            elif mode == "token-mean":
                w.append(dp_size / tokens)
            elif mode == "seq-mean-token-sum":
                w.append(dp_size / seqs)
            elif mode == "seq-mean-token-mean":
                w.append(dp_size / (n * seqs))
            else:
                w.append(dp_size / (seqs * norm_constant))
        out.append(w)
    return torch.tensor(out, dtype=torch.float64)


def _kw(mode):
    return {"norm_constant": 16.0} if mode == "seq-mean-token-sum-norm" else {}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.int64])
def test_every_mode_matches_the_formula_on_ragged_masks(mode, mask_dtype):
    loss, mask = _ragged()
    got = aggregate_loss(loss, mask.to(mask_dtype), mode, **_kw(mode))
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(_by_hand(loss, mask, mode, **_kw(mode)), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_mode_gradient_is_the_per_token_weight(mode):
    loss, mask = _ragged()
    loss.requires_grad_(True)
    aggregate_loss(loss, mask, mode, **_kw(mode)).backward()
    torch.testing.assert_close(loss.grad, _weights_by_hand(mask, mode, **_kw(mode)), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dp_size", [1, 3])
def test_global_denominators_and_dp_size(mode, dp_size):
    loss, mask = _ragged(seed=1)
    kw = dict(global_tokens=37.0, global_seqs=11.0, dp_size=dp_size, **_kw(mode))
    got = aggregate_loss(loss, mask, mode, **kw)
    assert got.item() == pytest.approx(_by_hand(loss, mask, mode, **kw), rel=1e-12)
    # tensors as denominators (what a DP all-reduce gives) work the same
    kw_t = dict(kw, global_tokens=torch.tensor(37.0, dtype=torch.float64),
                global_seqs=torch.tensor(11.0, dtype=torch.float64))
    assert aggregate_loss(loss, mask, mode, **kw_t).item() == pytest.approx(got.item(), rel=1e-12)
    loss.requires_grad_(True)
    aggregate_loss(loss, mask, mode, **kw).backward()
    torch.testing.assert_close(loss.grad, _weights_by_hand(mask, mode, **kw), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_the_whole(mode):
    loss, mask = _ragged(seed=2)
    whole = _by_hand(loss, mask, mode, **_kw(mode))
    tokens = int(mask.sum())
    seqs = int((mask.sum(-1) > 0).sum())
    for cut in (1, 2, 3, 5):
        parts = sum(aggregate_loss(l_, m_, mode, global_tokens=tokens, global_seqs=seqs, **_kw(mode)).item()
                    for l_, m_ in ((loss[:cut], mask[:cut]), (loss[cut:], mask[cut:])))
        assert parts == pytest.approx(whole, rel=1e-12), cut


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_width_changes_nothing(mode):
    loss, mask = _ragged(seed=3)
    pad_l = torch.cat([loss, torch.full((6, 9), GARBAGE, dtype=loss.dtype)], 1)
    pad_m = torch.cat([mask, torch.zeros(6, 9, dtype=torch.bool)], 1)
    a = aggregate_loss(loss, mask, mode, **_kw(mode)).item()
    assert aggregate_loss(pad_l, pad_m, mode, **_kw(mode)).item() == pytest.approx(a, rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_dtypes_keep_their_dtype_and_the_formula(mode, dtype, rel):
    loss64, mask = _ragged(seed=4)
    loss = torch.where(mask, loss64, torch.zeros_like(loss64)).to(dtype)  # fp16 cannot hold the garbage
    got = aggregate_loss(loss, mask, mode, **_kw(mode))
    assert got.dtype == dtype
    want = _by_hand(loss, mask, mode, **_kw(mode))  # same rounded inputs, exact arithmetic
    assert got.item() == pytest.approx(want, rel=rel, abs=rel)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_result_dtype_is_the_loss_dtype_whatever_the_mask_dtype(mode):
    loss, mask = _ragged(seed=6)
    loss = torch.where(mask, loss, torch.zeros_like(loss)).to(torch.float16)
    got = aggregate_loss(loss, mask.to(torch.float32), mode, **_kw(mode))
    assert got.dtype == torch.float16
    assert got.item() == pytest.approx(_by_hand(loss, mask, mode, **_kw(mode)), rel=2e-3, abs=2e-3)


def test_all_rows_empty_is_zero_not_nan_for_the_sequence_modes():
    loss = torch.full((2, 3), GARBAGE, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        # a micro-batch with no token inside a step that has some: contributes exactly 0
        assert aggregate_loss(loss, mask, mode, global_seqs=4, **_kw(mode)).item() == 0.0
    assert aggregate_loss(loss, mask, "token-mean", global_tokens=9).item() == 0.0


def test_padded_width_bug_would_be_caught():
    """A planted bug: ``seq-mean-token-mean`` dividing every row by the padded width T.
    On the ragged masks above it is far off the formula, so the tests above fail on it."""
    loss, mask = _ragged()
    T = mask.shape[1]
    m = mask.to(loss.dtype)
    buggy = ((loss * m).sum(-1) / T).sum() / (mask.sum(-1) > 0).sum()
    right = _by_hand(loss, mask, "seq-mean-token-mean")
    assert abs(buggy.item() - right) > 1e-3 * max(1.0, abs(right))
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(right, rel=1e-12)


def test_aggregate_refusals_name_the_problem():
    loss, mask = _ragged()
    with pytest.raises(ValueError, match=r"per_token_loss and mask must both be \(B, T\)"):
        aggregate_loss(loss, mask[:, :3])
    with pytest.raises(ValueError, match=r"per_token_loss and mask must both be \(B, T\)"):
        aggregate_loss(loss[0], mask[0])
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        aggregate_loss(loss, mask, dp_size=0)
    with pytest.raises(ValueError, match="dp_size must be an int >= 1"):
        aggregate_loss(loss, mask, dp_size=2.0)
    with pytest.raises(ValueError, match="global_seqs is required when dp_size > 1"):
        aggregate_loss(loss, mask, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match=r"^seq-mean-token-sum-norm needs norm_constant > 0 \(e\.g\. the maximum "
                                         r"response length\); the padded width is never used, since it changes "
                                         r"with the micro-batch$"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=0.0)
    with pytest.raises(ValueError, match=r"^global_tokens is required when dp_size > 1$"):
        aggregate_loss(loss, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match=r"^global_seqs is required when dp_size > 1$"):
        aggregate_loss(loss, mask, "seq-mean-token-sum", dp_size=2)
    # any positive constant is allowed, also below 1
    want = _by_hand(loss, mask, "seq-mean-token-sum-norm", norm_constant=0.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=0.5).item() == pytest.approx(want)
    # dp_size = 1 needs no global denominator
    assert torch.isfinite(aggregate_loss(loss, mask, "seq-mean-token-sum", dp_size=1))


# ---------------------------------------------------------------------------------------------------
# policy_loss


def _policy_by_hand(lp, old, adv, mask, *, clip_low, clip_high, dual_clip):
    """PPO-clip (eq. 7, decoupled DAPO upper bound) with optional dual clip, one token at a time.

    Returns per-token losses, the per-token gradient d l / d logprob, and the three stats."""
    LP, OLD, M = lp.tolist(), old.tolist(), mask.tolist()
    A = adv.tolist() if adv.dim() == 2 else [[a] * len(LP[0]) for a in adv.tolist()]
    losses, grads = [], []
    n = clipped = lower = 0
    kl = 0.0
    for b in range(len(LP)):
        lrow, grow = [], []
        for t in range(len(LP[b])):
            a = A[b][t]
            r = math.exp(LP[b][t] - OLD[b][t])
            unclipped = -a * r
            r_c = min(max(r, 1.0 - clip_low), 1.0 + clip_high)
            clipped_term = -a * r_c
            if clipped_term > unclipped:
                val, g, was_clipped = clipped_term, 0.0, True
            else:
                val, g, was_clipped = unclipped, -a * r, False
            was_lower = False
            if dual_clip is not None and a < 0 and val > -a * dual_clip:
                val, g, was_lower = -a * dual_clip, 0.0, True
            lrow.append(val)
            grow.append(g)
            if M[b][t]:
                n += 1
                clipped += was_clipped
                lower += was_lower
                kl += OLD[b][t] - LP[b][t]
        losses.append(lrow)
        grads.append(grow)
    n = max(n, 1)
    stats = {"clipfrac": clipped / n, "approx_kl": kl / n}
    if dual_clip is not None:
        stats["clipfrac_lower"] = lower / n
    return torch.tensor(losses, dtype=torch.float64), torch.tensor(grads, dtype=torch.float64), stats


def _policy_inputs(seed=0, per_token_adv=True):
    """Ratios spread over [0.2, 5] (both clip edges and the dual-clip region), both advantage signs;
    no ratio sits exactly on a clip edge (ties would make the subgradient ambiguous)."""
    gen = torch.Generator().manual_seed(seed)
    _, mask = _ragged(seed)
    old = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3
    lp = old + (torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3.2 - 1.6)
    adv = torch.randn(6, 7 if per_token_adv else 1, generator=gen, dtype=torch.float64)
    adv = adv + 0.1 * torch.sign(adv)
    if not per_token_adv:
        adv = adv[:, 0]
    return lp, old, adv, mask


@pytest.mark.parametrize("clip_low,clip_high,dual_clip", [(0.2, None, None), (0.2, 0.28, None), (0.1, 0.3, 3.0),
                                                          (0.0, 0.0, 1.5)])
@pytest.mark.parametrize("per_token_adv", [True, False])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_ppo_by_hand(clip_low, clip_high, dual_clip, per_token_adv, mode):
    lp, old, adv, mask = _policy_inputs(per_token_adv=per_token_adv)
    ch = clip_low if clip_high is None else clip_high
    tok, grad_tok, stats_want = _policy_by_hand(lp, old, adv, mask, clip_low=clip_low, clip_high=ch,
                                                dual_clip=dual_clip)
    # the inputs reach every branch, so each term is really exercised
    assert 0 < stats_want["clipfrac"] < 1
    if dual_clip is not None:
        assert 0 < stats_want["clipfrac_lower"] < 1
    lp = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                              mode=mode, **_kw(mode))
    assert loss.item() == pytest.approx(_by_hand(tok, mask, mode, **_kw(mode)), rel=1e-12, abs=1e-12)
    assert set(stats) == set(stats_want)
    for k, v in stats_want.items():
        assert stats[k].item() == pytest.approx(v, rel=1e-12, abs=1e-15), k
        assert not stats[k].requires_grad, k
    loss.backward()
    want_grad = grad_tok * _weights_by_hand(mask, mode, **_kw(mode))
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-10, atol=1e-14)


def test_policy_loss_passes_global_denominators_through():
    lp, old, adv, mask = _policy_inputs(seed=5)
    tok, _, _ = _policy_by_hand(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None)
    loss, _ = policy_loss(lp, old, adv, mask, mode="seq-mean-token-mean", global_seqs=9, dp_size=2)
    assert loss.item() == pytest.approx(_by_hand(tok, mask, "seq-mean-token-mean", global_seqs=9, dp_size=2),
                                        rel=1e-12)


def test_approx_kl_is_k1_mean_over_masked_tokens_only():
    lp = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -60.0, -70.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, 0.0], [-0.25, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    _, stats = policy_loss(lp, old, torch.ones(2), mask)
    # (old - new) on the three masked tokens: 0.5, 1.0, 0.25
    assert stats["approx_kl"].item() == pytest.approx((-0.5 + 1.0 + 0.25) / 3, rel=1e-15)


def test_policy_loss_one_token_and_dtypes():
    # one masked token: clipfrac and KL are over exactly that token (the count is not clamped above 1)
    lp = torch.tensor([[math.log(2.0), -3.0]], dtype=torch.float32)
    old = torch.zeros(1, 2, dtype=torch.float32)
    mask = torch.tensor([[True, False]])
    adv = torch.tensor([1.0], dtype=torch.float64)  # float64 advantages do not promote a float32 loss
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(-1.2)
    assert stats["clipfrac"].item() == 1.0
    assert stats["approx_kl"].item() == pytest.approx(-math.log(2.0))


def test_dual_clip_tie_is_not_counted_as_clipped():
    """ratio exactly c with A < 0: the loss equals -A c on both sides; verl counts a lower clip only
    when the PPO term is strictly above -A c."""
    lp = torch.tensor([[math.log(2.0), math.log(4.0)]], dtype=torch.float64)  # exp gives 2.0, 4.0 exactly
    assert torch.exp(lp).tolist() == [[2.0, 4.0]]
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, stats = policy_loss(lp, old, torch.tensor([[-1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2),
                              dual_clip=2.0)
    assert loss.item() == pytest.approx((2.0 + 2.0) / 2)
    assert stats["clipfrac_lower"].item() == 0.5


def test_policy_loss_with_no_token_is_finite():
    lp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, stats = policy_loss(lp, lp, torch.ones(2), mask, global_tokens=5)
    assert loss.item() == 0.0
    assert stats["clipfrac"].item() == 0.0 and stats["approx_kl"].item() == 0.0


def test_policy_loss_refusals_name_the_problem():
    lp, old, adv, mask = _policy_inputs()
    with pytest.raises(ValueError, match="must share one"):
        policy_loss(lp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="must share one"):
        policy_loss(lp, old, adv, mask[:, :3])
    with pytest.raises(ValueError, match="must share one"):
        policy_loss(lp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match=r"advantages must be \(B,\) or \(B, T\) with B=6"):
        policy_loss(lp, old, adv[:4], mask)
    with pytest.raises(ValueError, match="need 0 <= clip_low < 1"):
        policy_loss(lp, old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="need 0 <= clip_low < 1"):
        policy_loss(lp, old, adv, mask, clip_low=-0.1)
    with pytest.raises(ValueError, match="clip_high >= 0"):
        policy_loss(lp, old, adv, mask, clip_high=-0.1)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(lp, old, adv, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        policy_loss(lp, old, adv, mask, mode="token-sum")
