"""The references themselves (python/treadle/reference/) against the papers' formulas written out
here as explicit float64 loops, and the "plain PyTorch" yardstick of the tolerance rule
(``grpo_advantages_scatter``) against the reference: a wrong yardstick would silently loosen every
kernel test that uses it (found by mutation testing, tests/MUTATION.md)."""
import math
import statistics

import pytest
import torch

from treadle.reference.grpo import grpo_advantages_reference, grpo_advantages_scatter
from treadle.reference.scale import gate_lambda_reference, topk_entropy_reference, topk_entropy_rows_reference
from treadle.reference.stair import stair_readout_reference


def _grpo_inputs(seed=0):
    """Groups of sizes 1..5 interleaved, no group with all-equal rewards."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 1, 3]
    ids = torch.tensor([g for g, s in enumerate(sizes) for _ in range(s)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    rewards = torch.rand(len(ids), generator=gen, dtype=torch.float64) * 3 - 1
    return rewards, ids


def _by_hand(rewards, ids, *, estimator="grpo", unbiased=True, eps=1e-6, scale_rewards="group", singleton="zero",
             valid=None, flags=None, eps_in_sqrt=False):
    r, g = rewards.tolist(), ids.tolist()
    ok = [True] * len(r) if valid is None else valid.tolist()
    sd = statistics.stdev if unbiased else statistics.pstdev
    considered = [i for i in range(len(r)) if ok[i]]
    groups = {}
    for i in considered:
        groups.setdefault(g[i], []).append(i)
    batch_s = sd([r[i] for i in considered]) if len(considered) > 1 else 0.0
    adv = [0.0] * len(r)
    for rows in groups.values():
        x = [r[i] for i in rows]
        n = len(x)
        if n == 1:
            if singleton == "raw":
                adv[rows[0]] = x[0] / (1 + eps) if estimator == "grpo" and scale_rewards != "none" else x[0]
            continue
        if max(x) == min(x):
            continue
        m = sum(x) / n
        for i in rows:
            d = r[i] - m
            if estimator == "grpo" and scale_rewards == "group":
                var = sd(x) ** 2
                adv[i] = d / math.sqrt(var + eps) if eps_in_sqrt else d / (sd(x) + eps)
            elif estimator == "grpo" and scale_rewards == "batch":
                adv[i] = d / (batch_s + eps)
            elif estimator == "rloo":
                adv[i] = r[i] - (sum(x) - r[i]) / (n - 1)  # leave-one-out mean, RLOO eq. 5
            else:
                adv[i] = d
    if estimator == "reinforce_baseline" and considered:
        a = [adv[i] for i in considered]
        ma = sum(a) / len(a)
        s = sd(a) if len(a) > 1 else 0.0
        for i in considered:
            adv[i] = (adv[i] - ma) / (s + eps)
    if flags is not None:
        adv = [min(a, 0.0) if f else a for a, f in zip(adv, flags.tolist())]
    return torch.tensor([a if o else 0.0 for a, o in zip(adv, ok)], dtype=torch.float64)


@pytest.mark.parametrize("kw", [
    dict(), dict(unbiased=False), dict(eps=0.5), dict(eps=0.3, eps_in_sqrt=True),
    dict(scale_rewards="batch"), dict(scale_rewards="batch", unbiased=False), dict(scale_rewards="none"),
    dict(estimator="dr_grpo"), dict(estimator="rloo"), dict(estimator="reinforce_baseline"),
    dict(estimator="reinforce_baseline", unbiased=False, eps=0.1), dict(singleton="raw", eps=0.25),
    dict(singleton="raw", estimator="rloo"), dict(singleton="raw", scale_rewards="none", eps=0.25),
])
def test_grpo_reference_matches_the_formulas(kw):
    rewards, ids = _grpo_inputs()
    got = grpo_advantages_reference(rewards, ids, **kw)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _by_hand(rewards, ids, **kw), rtol=1e-12, atol=1e-12)


def test_grpo_reference_valid_flags_equal_groups():
    rewards, ids = _grpo_inputs(seed=1)
    rewards[ids == 3] = 0.5  # one group with all-equal rewards: exactly 0
    valid = torch.ones(len(ids), dtype=torch.bool)
    valid[::4] = False
    flags = torch.zeros(len(ids), dtype=torch.bool)
    flags[1::3] = True
    for est in ("grpo", "reinforce_baseline"):
        got = grpo_advantages_reference(rewards, ids, valid=valid, flags=flags, estimator=est)
        torch.testing.assert_close(got, _by_hand(rewards, ids, valid=valid, flags=flags, estimator=est),
                                   rtol=1e-12, atol=1e-12)
    assert (grpo_advantages_reference(rewards, ids)[ids == 3] == 0).all()


def test_grpo_reference_nonfinite_rewards():
    rewards, ids = _grpo_inputs(seed=5)
    bad = int((ids == 4).nonzero()[0])  # a row of the group of five
    rewards[bad] = float("nan")
    default = grpo_advantages_reference(rewards, ids)  # skip_nonfinite=False: NaN spreads over its group only
    assert torch.isnan(default[ids == 4]).all() and torch.isfinite(default[ids != 4]).all()
    finite = torch.isfinite(rewards)
    skipped = grpo_advantages_reference(rewards, ids, skip_nonfinite=True)
    torch.testing.assert_close(skipped, grpo_advantages_reference(rewards, ids, valid=finite), rtol=0, atol=0)
    valid = torch.ones(len(ids), dtype=torch.bool)
    valid[(ids == 2).nonzero()[0]] = False
    both = grpo_advantages_reference(rewards, ids, valid=valid, skip_nonfinite=True)  # valid AND finite
    torch.testing.assert_close(both, grpo_advantages_reference(rewards, ids, valid=valid & finite), rtol=0, atol=0)
    torch.testing.assert_close(both, _by_hand(rewards.nan_to_num(0.0), ids, valid=valid & finite), rtol=1e-12,
                               atol=1e-12)


def test_grpo_reference_batch_scaling_with_two_rows():
    rewards = torch.tensor([1.0, 3.0], dtype=torch.float64)
    ids = torch.tensor([0, 0])
    # batch std of (1, 3) = sqrt(2) (unbiased): A = (-1, 1) / (sqrt(2) + eps)
    got = grpo_advantages_reference(rewards, ids, scale_rewards="batch", eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0], dtype=torch.float64) / math.sqrt(2), rtol=1e-14, atol=0)


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.2])
def test_scatter_yardstick_equals_the_reference_in_float64(unbiased, eps):
    rewards, ids = _grpo_inputs(seed=2)
    plain = grpo_advantages_scatter(rewards, ids, eps=eps, unbiased=unbiased)
    torch.testing.assert_close(plain, grpo_advantages_reference(rewards, ids, eps=eps, unbiased=unbiased),
                               rtol=1e-12, atol=1e-12)
    # default arguments are the op's: unbiased std, eps = 1e-6
    torch.testing.assert_close(grpo_advantages_scatter(rewards, ids), grpo_advantages_reference(rewards, ids),
                               rtol=1e-12, atol=1e-12)


def test_scatter_yardstick_groups_of_one_are_zero_even_with_eps_zero():
    rewards, ids = _grpo_inputs(seed=4)
    plain = grpo_advantages_scatter(rewards, ids, eps=0.0)  # a group of one has std 0: 0 / 0 without the guard
    assert torch.isfinite(plain).all()
    torch.testing.assert_close(plain, grpo_advantages_reference(rewards, ids, eps=0.0), rtol=1e-12, atol=1e-12)


def test_scatter_yardstick_keeps_the_dtype():
    rewards, ids = _grpo_inputs(seed=3)
    plain = grpo_advantages_scatter(rewards.float(), ids)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain.double(), grpo_advantages_reference(rewards.float(), ids), rtol=1e-4, atol=1e-5)


def test_gate_lambda_formula():
    L, U = -2.0, 3.0
    v = torch.tensor([-1.0, -0.5, 0.0, 0.25, 1.0], dtype=torch.float64, requires_grad=True)
    lam = gate_lambda_reference(v, L, U)
    # 1 + (1 - L) min(v, 0) + (U - 1) max(v, 0)
    assert lam.tolist() == [1 - 3.0, 1 - 1.5, 1.0, 1 + 0.5, 1 + 2.0]
    lam.sum().backward()
    # slope (1 - L) on the left, (U - 1) on the right, the midpoint (U - L) / 2 at v = 0
    assert v.grad.tolist() == [3.0, 3.0, 2.5, 2.0, 2.0]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert gate_lambda_reference(v.detach().to(dtype), L, U).dtype == dtype
        assert gate_lambda_reference(torch.tensor(0.5, dtype=dtype), L, U).dtype == dtype  # 0-d: no promotion


def test_topk_entropy_formula():
    # k = 2 over logits [0, log 3]: p = (1/4, 3/4)
    logits = torch.tensor([[[5.0, -9.0, math.log(3.0), 0.0, -1.0]]], dtype=torch.float64)
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)) / math.log(2)
    # the two largest logits are 5 and log 3: p = softmax([5, log 3])
    p = [math.exp(5) / (math.exp(5) + 3), 3 / (math.exp(5) + 3)]
    want_top = -sum(x * math.log(x) for x in p) / math.log(2)
    assert topk_entropy_rows_reference(logits, 2).item() == pytest.approx(want_top, rel=1e-12)
    two = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    assert topk_entropy_rows_reference(two, 2).item() == pytest.approx(want, rel=1e-12)
    # uniform over the top k: exactly 1
    flat = torch.tensor([[2.0, 2.0, 2.0, -5.0]], dtype=torch.float64)
    assert topk_entropy_rows_reference(flat, 3).item() == pytest.approx(1.0, rel=1e-12)
    rows = torch.stack([two[0], torch.tensor([1.0, 1.0], dtype=torch.float64)])  # (2, 2): entropies want, 1
    assert topk_entropy_reference(rows, 2).item() == pytest.approx((want + 1.0) / 2, rel=1e-12)
    assert topk_entropy_reference(rows, 2, mask=torch.tensor([True, False])).item() == pytest.approx(want, rel=1e-12)
    assert topk_entropy_reference(rows, 2, mask=torch.tensor([False, True])).item() == pytest.approx(1.0, rel=1e-12)


def test_topk_entropy_default_k_is_100():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 150, generator=gen, dtype=torch.float64) * 4
    h100 = topk_entropy_reference(logits, 100)
    assert topk_entropy_reference(logits).item() == h100.item()
    assert topk_entropy_reference(logits, 101).item() != h100.item()


def _stair_by_hand(q, k, v, n, *, lengths, eps, scale, mode):
    """STAIR sec. 3.4 read-out, one (b, h, t) at a time."""
    B, Hq, T, D = q.shape
    Hkv, M, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.zeros(B, Hq, T, Dv, dtype=torch.float64)
    for b in range(B):
        Lb = M if lengths is None else int(lengths[b])
        if Lb == 0:
            continue
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            u = n[h].double() / n[h].double().norm()
            for t in range(T):
                qt = q[b, h, t].double()
                s = [scale * float(qt @ k[b, kv, j].double()) for j in range(Lb)]
                mx = max(s)
                z = sum(math.exp(x - mx) for x in s)
                pi_ref = [(1 - eps) * math.exp(x - mx) / z + eps / Lb for x in s]
                tt = [-2 * scale * float(u @ qt) * float(u @ k[b, kv, j].double()) for j in range(Lb)]
                w = [p * math.exp(x) for p, x in zip(pi_ref, tt)]
                pi_r = [x / sum(w) for x in w]
                weights = {"diff": [a - c for a, c in zip(pi_r, pi_ref)], "reflected": pi_r, "reference": pi_ref}[mode]
                out[b, h, t] = sum(wj * v[b, kv, j].double() for j, wj in enumerate(weights))
    return out


@pytest.mark.parametrize("mode", ["diff", "reflected", "reference"])
@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_stair_readout_reference_matches_the_formula(mode, eps):
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, M, D, Dv = 3, 4, 2, 2, 5, 3, 2
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hkv, M, Dv, generator=gen, dtype=torch.float64)
    n = torch.randn(Hq, D, generator=gen, dtype=torch.float64) * 3  # not unit: normalised by the reference
    lengths = torch.tensor([5, 0, 2])
    got = stair_readout_reference(q, k, v, n, bank_lengths=lengths, eps=eps, scale=0.7, mode=mode)
    torch.testing.assert_close(got, _stair_by_hand(q, k, v, n, lengths=lengths, eps=eps, scale=0.7, mode=mode),
                               rtol=1e-10, atol=1e-12)
    # defaults: eps = 0, scale = D ** -0.5, mode "diff", every key valid
    torch.testing.assert_close(stair_readout_reference(q, k, v, n),
                               _stair_by_hand(q, k, v, n, lengths=None, eps=0.0, scale=D ** -0.5, mode="diff"),
                               rtol=1e-10, atol=1e-12)


def test_stair_readout_reference_one_key_mixed_dtypes_and_empty_bank():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 1, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 1, 1, 3, generator=gen, dtype=torch.float64)
    n = torch.randn(2, 4, generator=gen, dtype=torch.float32)  # float32 normals with float64 q, k, v
    # one key: pi_ref = pi_R = 1, so "reflected" reads v and "diff" is 0
    refl = stair_readout_reference(q, k, v, n, mode="reflected")
    assert refl.dtype == torch.float64
    torch.testing.assert_close(refl, v.expand(1, 2, 1, 3), rtol=1e-12, atol=1e-12)
    assert stair_readout_reference(q, k, v, n).abs().max().item() < 1e-12
    # M = 0 with all-zero queries: exactly 0, never NaN
    z = stair_readout_reference(torch.zeros(1, 2, 1, 4, dtype=torch.float64), k[:, :, :0], v[:, :, :0],
                                torch.zeros(2, 4, dtype=torch.float64))
    assert z.shape == (1, 2, 1, 3) and torch.equal(z, torch.zeros_like(z))
    with pytest.raises(ValueError, match=r"^mode must be one of \('diff', 'reflected', 'reference'\), got 'sum'$"):
        stair_readout_reference(q, k, v, n, mode="sum")


def test_grpo_reference_equal_rewards_exact_zero_with_eps_zero():
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 2.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1])
    got = grpo_advantages_reference(rewards, ids, eps=0.0)  # without the max == min guard: 0 / 0 = NaN
    assert got[:3].tolist() == [0.0, 0.0, 0.0]
    # group (1, 2): d = -/+0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(got[3:], torch.tensor([-0.5, 0.5], dtype=torch.float64) / math.sqrt(0.5),
                               rtol=1e-14, atol=0)


@pytest.mark.parametrize("n_rows", [1, 2])
def test_reinforce_baseline_whitening_with_one_or_two_rows(n_rows):
    rewards = torch.tensor([3.0, 5.0][:n_rows], dtype=torch.float64)
    ids = torch.arange(n_rows)  # every row its own group: raw singletons (a_i = r_i), then whitened
    got = grpo_advantages_reference(rewards, ids, estimator="reinforce_baseline", singleton="raw", eps=0.5)
    torch.testing.assert_close(got, _by_hand(rewards, ids, estimator="reinforce_baseline", singleton="raw", eps=0.5),
                               rtol=1e-14, atol=1e-15)
    want = [0.0] if n_rows == 1 else [-1.0 / (math.sqrt(2) + 0.5), 1.0 / (math.sqrt(2) + 0.5)]
    assert got.tolist() == pytest.approx(want, rel=1e-14, abs=0)


def test_grpo_reference_unknown_estimator():
    rewards, ids = _grpo_inputs()
    with pytest.raises(ValueError, match=r"^unknown estimator 'ppo'; expected one of \('grpo', 'dr_grpo', 'rloo', "
                                         r"'reinforce_baseline'\)$"):
        grpo_advantages_reference(rewards, ids, estimator="ppo")
