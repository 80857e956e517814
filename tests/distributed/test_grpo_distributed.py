"""GRPO over 2 gloo ranks: every loss-aggregation mode's global denominators and the group statistics
of groups split across ranks equal the single-process results of the whole batch (float64)."""
import pytest
import torch

from treadle.distributed import NotDistributedError, aggregate_loss_dp, global_group_ids, grpo_advantages_dp
from treadle.grpo import LOSS_AGG_MODES, aggregate_loss, grpo_advantages, group_ids_from_uids

W = 2


def _batch():
    """A global batch whose halves have different token and sequence counts (so a per-rank mean of means
    is NOT the global mean: the test can fail), one empty sequence, float64."""
    g = torch.Generator().manual_seed(5)
    B, T = 7, 6
    loss = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4])
    mask = torch.arange(T)[None] < lengths[:, None]
    return loss, mask


SPLIT = (2, 5)  # rank 0: rows 0-1 (7 tokens, 2 sequences), rank 1: rows 2-6 (14 tokens, 4 non-empty)


def _loss_worker():
    import torch.distributed as dist

    r = dist.get_rank()
    loss, mask = _batch()
    lo = sum(SPLIT[:r])
    rows = slice(lo, lo + SPLIT[r])
    out = {}
    for mode in LOSS_AGG_MODES:
        x = loss[rows].clone().requires_grad_(True)
        val = aggregate_loss_dp(x, mask[rows], mode, norm_constant=6.0)
        val.backward()
        # DDP averages gradients over ranks; these rows live on this rank only, so their share is grad / W
        grad = x.grad.clone()
        mean = val.detach().clone()
        dist.all_reduce(mean)
        # gradient accumulation: two micro-batches per rank, the step's denominators passed in
        from treadle.distributed import global_loss_denominators

        parts = [slice(lo, lo + 1), slice(lo + 1, lo + SPLIT[r])]
        den = global_loss_denominators([mask[p] for p in parts])
        acc = sum(aggregate_loss_dp(loss[p], mask[p], mode, norm_constant=6.0, denominators=den) for p in parts)
        dist.all_reduce(acc)
        out[mode] = {"loss": mean / W, "grad": grad / W, "accum": acc / W}
    return out


def _adv_worker(cases):
    import torch.distributed as dist

    r = dist.get_rank()
    res = []
    for rewards, gids, valid, flags, split, kw in cases:
        lo = sum(split[:r])
        s = slice(lo, lo + split[r])
        res.append(grpo_advantages_dp(rewards[s], gids[s], valid=None if valid is None else valid[s],
                                      flags=None if flags is None else flags[s], **kw))
    uids = [["p3", "p1", "p3"], ["p1", "p9", "p3", "p7"]][r]
    res.append(global_group_ids(uids))
    return res


def test_loss_aggregation_over_ranks_equals_whole_batch(run_ranks):
    results = run_ranks(_loss_worker, W)
    loss, mask = _batch()
    for mode in LOSS_AGG_MODES:
        x = loss.clone().requires_grad_(True)
        ref = aggregate_loss(x, mask, mode, norm_constant=6.0)
        ref.backward()
        lo = 0
        for r in range(W):
            got = results[r][mode]
            torch.testing.assert_close(got["loss"], ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got["accum"], ref.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got["grad"], x.grad[lo:lo + SPLIT[r]], rtol=1e-12, atol=1e-12)
            lo += SPLIT[r]
        # the per-rank local mean is NOT the global one for this batch: the test can tell them apart
        local = [aggregate_loss(loss[:2], mask[:2], mode, norm_constant=6.0).detach(),
                 aggregate_loss(loss[2:], mask[2:], mode, norm_constant=6.0).detach()]
        assert abs(float(sum(local) / W - ref.detach())) > 1e-3, mode


def _adv_cases():
    g = torch.Generator().manual_seed(11)
    N = 13
    rewards = torch.randn(N, generator=g, dtype=torch.float64)
    gids = torch.tensor([4, 9, 4, 2, 9, 9, 4, 2, 7, 4, 9, 2, 5])  # groups 4, 9, 2 span both ranks; 5 and 7 singletons
    valid = torch.ones(N, dtype=torch.bool)
    valid[[1, 8]] = False
    flags = torch.zeros(N, dtype=torch.bool)
    flags[[0, 10]] = True
    cases = []
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        cases.append((rewards, gids, None, None, (6, 7), {"estimator": est}))
    cases.append((rewards, gids, valid, flags, (5, 8), {"estimator": "grpo", "std": "biased", "singleton": "raw"}))
    cases.append((rewards, gids, valid, None, (6, 7), {"estimator": "grpo", "scale_rewards": "batch"}))
    cases.append((rewards, gids, None, flags, (0, 13), {"estimator": "rloo"}))  # one rank holds no rows
    return cases


def test_advantages_of_groups_split_over_ranks_equal_single_process(run_ranks):
    cases = _adv_cases()
    results = run_ranks(_adv_worker, W, cases)
    for i, (rewards, gids, valid, flags, split, kw) in enumerate(cases):
        ref = grpo_advantages(rewards, gids, valid=valid, flags=flags, **kw)
        got = torch.cat([results[r][i] for r in range(W)])
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, ref, rtol=0, atol=0, msg=f"case {i} {kw}")
        if split[0]:  # per-rank statistics would differ: the test can fail
            local = torch.cat([grpo_advantages(rewards[:split[0]], gids[:split[0]],
                                               valid=None if valid is None else valid[:split[0]],
                                               flags=None if flags is None else flags[:split[0]], **kw),
                               grpo_advantages(rewards[split[0]:], gids[split[0]:],
                                               valid=None if valid is None else valid[split[0]:],
                                               flags=None if flags is None else flags[split[0]:], **kw)])
            assert not torch.allclose(local, ref)
    ids = torch.cat([results[r][-1] for r in range(W)])
    assert torch.equal(ids, group_ids_from_uids(["p3", "p1", "p3", "p1", "p9", "p3", "p7"]))


def test_calls_without_torch_distributed_say_so():
    with pytest.raises(NotDistributedError, match="torchrun"):
        grpo_advantages_dp(torch.zeros(2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(NotDistributedError, match="init_process_group"):
        aggregate_loss_dp(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_loss_dp(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "sum")


def _dtensor_worker():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from treadle.distributed import DTensorInputError
    from treadle.ops import gated_lora, stair_readout, topk_entropy, topk_entropy_from_hidden

    mesh = init_device_mesh("cpu", (W,))
    rep = lambda t: distribute_tensor(t, mesh, [Replicate()])  # noqa: E731
    x, A, B = torch.randn(3, 8), torch.randn(2, 8), torch.randn(4, 2)
    calls = {
        "stair_readout": lambda: stair_readout(torch.randn(1, 2, 3, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8),
                                               distribute_tensor(torch.randn(2, 8), mesh, [Shard(0)]), eps=0.0,
                                               scale=0.3),
        "grpo_advantages": lambda: grpo_advantages(rep(torch.randn(4)), torch.zeros(4, dtype=torch.long)),
        "topk_entropy": lambda: topk_entropy(rep(torch.randn(2, 3, 30)), 5),
        "topk_entropy_from_hidden": lambda: topk_entropy_from_hidden(torch.randn(2, 8), rep(torch.randn(30, 8)), 5),
        "gated_lora": lambda: gated_lora(x, torch.zeros(3, 4), A, B, rep(torch.zeros(8)), torch.zeros(1), scaling=2.0,
                                         L=-2.0, U=2.0, tau=1.0),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "ran"
        except DTensorInputError as err:
            out[name] = str(err)
    return out


def test_ops_refuse_dtensor_inputs_with_a_clear_error(run_ranks):
    res = run_ranks(_dtensor_worker, W)
    for name, msg in res[0].items():
        assert msg.startswith(f"treadle op {name!r} got a DTensor"), (name, msg)
        assert "full_tensor()" in msg
