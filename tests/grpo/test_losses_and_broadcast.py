"""Token broadcast, atomic-turn groups, loss aggregation and the clipped policy loss."""
import pytest
import torch

from treadle.grpo import (aggregate_loss, atomic_turn_group_ids, broadcast_packed, broadcast_to_tokens,
                          group_ids_from_uids, policy_loss)


def test_broadcast_to_tokens_zero_outside_mask():
    a = torch.tensor([1.5, -2.0])
    m = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert broadcast_to_tokens(a, m).tolist() == [[1.5, 1.5, 0.0], [0.0, -2.0, -2.0]]


def test_broadcast_packed_only_current_turn_policy_tokens():
    # packed: [prompt prompt | turn0 x2 | tool output | turn1 x2 | pad]
    a = torch.tensor([0.5, -1.0])
    seg = torch.tensor([0, 0, 0, 0, 0, 1, 1, -1])
    policy = torch.tensor([False, False, True, True, False, True, True, False])
    assert broadcast_packed(a, seg, policy).tolist() == [0, 0, 0.5, 0.5, 0, -1.0, -1.0, 0]


def test_broadcast_bad_input():
    with pytest.raises(ValueError, match="response_mask must be \\(B=2, T\\)"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(3, 4))
    with pytest.raises(ValueError, match="segment_ids must be < R=2"):
        broadcast_packed(torch.zeros(2), torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="segment_ids must be a 1-D integer"):
        broadcast_packed(torch.zeros(2), torch.tensor([0.0, 1.0]))


def test_atomic_turn_group_ids():
    ids = atomic_turn_group_ids(["t1", "t1", "t1", "t2", "t1"], [0, 0, 1, 0, 0], ["s", "s", "s", "s", "other"])
    assert ids.tolist() == [0, 0, 1, 2, 3]
    assert ids.dtype == torch.int64
    with pytest.raises(ValueError, match="one length"):
        atomic_turn_group_ids([1], [0, 1], ["a"])
    with pytest.raises(ValueError, match="non-negative"):
        atomic_turn_group_ids([1], [-1], ["a"])


def test_group_ids_from_uids():
    import numpy as np

    assert group_ids_from_uids(np.array(["b", "a", "b", "c"], dtype=object)).tolist() == [0, 1, 0, 2]


def test_token_mean_over_two_micro_batches_equals_global_mean():
    torch.manual_seed(0)
    loss = torch.randn(6, 7)
    mask = torch.rand(6, 7) > 0.4
    whole = aggregate_loss(loss, mask, "token-mean")
    n = mask.sum()
    parts = aggregate_loss(loss[:2], mask[:2], "token-mean", global_tokens=n) + \
        aggregate_loss(loss[2:], mask[2:], "token-mean", global_tokens=n)
    assert torch.allclose(whole, parts, atol=1e-6)
    assert torch.allclose(whole, (loss * mask).sum() / mask.sum())
    seqs = (mask.sum(-1) > 0).sum()
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        w = aggregate_loss(loss, mask, mode)
        p = aggregate_loss(loss[:3], mask[:3], mode, global_seqs=seqs) + aggregate_loss(loss[3:], mask[3:], mode, global_seqs=seqs)
        assert torch.allclose(w, p, atol=1e-6), mode


def test_dr_grpo_normaliser_independent_of_padding_width():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    padded_loss = torch.cat([loss, torch.zeros(2, 5)], 1)
    padded_mask = torch.cat([mask, torch.zeros(2, 5, dtype=torch.bool)], 1)
    a = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=16)
    b = aggregate_loss(padded_loss, padded_mask, "seq-mean-token-sum-norm", norm_constant=16)
    assert a.item() == b.item() == pytest.approx(10.0 / (2 * 16))
    with pytest.raises(ValueError, match="norm_constant"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")


def test_aggregate_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "sum")
    with pytest.raises(ValueError, match="global_tokens is required"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-mean", dp_size=2)


def test_policy_loss_clip_and_dual_clip():
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 5.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, mode="token-mean")
    # per token: max(-A r, -A clip(r)): [-1.28, -0.5, 1.0, 5.0]
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 1.0 + 5.0) / 4)
    assert stats["clipfrac"].item() == pytest.approx(0.25)
    loss2, stats2 = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss2.item() == pytest.approx((-1.28 - 0.5 + 1.0 + 3.0) / 4)
    assert stats2["clipfrac_lower"].item() == pytest.approx(0.25)
    lp.requires_grad_(True)
    policy_loss(lp, old, adv, mask)[0].backward()
    assert lp.grad is not None
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)


# ---- found by mutation testing (tests/MUTATION.md): dtypes, devices, exact messages, edge sizes ----


def test_broadcast_to_tokens_keeps_the_advantage_dtype():
    a = torch.tensor([1.5, -2.0], dtype=torch.float16)
    out = broadcast_to_tokens(a, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))  # float32 mask
    assert out.dtype == torch.float16 and out.tolist() == [[1.5, 0.0], [-2.0, -2.0]]


def test_broadcast_refusals_exact():
    m = torch.ones(2, 3, dtype=torch.bool)
    for bad in ((torch.zeros(2), m.tolist()), ([0.0, 1.0], m)):  # either argument not a tensor
        with pytest.raises(TypeError, match=r"^advantages and response_mask must be torch\.Tensors$"):
            broadcast_to_tokens(*bad)
    with pytest.raises(TypeError, match=r"^advantages must be a floating tensor, got torch\.int64$"):
        broadcast_to_tokens(torch.zeros(2, dtype=torch.int64), m)
    with pytest.raises(ValueError, match=r"^advantages must be \(B,\), got shape \(2, 1\)$"):
        broadcast_to_tokens(torch.zeros(2, 1), m)
    with pytest.raises(ValueError, match=r"^response_mask must be \(B=2, T\), got shape \(3,\)$"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(3))
    seg = torch.tensor([0, 1])
    for bad in ((torch.zeros(2), [0, 1]), ([0.0, 1.0], seg)):
        with pytest.raises(TypeError, match=r"^advantages and segment_ids must be torch\.Tensors$"):
            broadcast_packed(*bad)
    with pytest.raises(ValueError, match=r"^advantages must be a 1-D floating tensor \(R,\), got torch\.float32 \(2, 1\)$"):
        broadcast_packed(torch.zeros(2, 1), seg)
    with pytest.raises(ValueError, match=r"^advantages must be a 1-D floating tensor \(R,\), got torch\.int64 \(2,\)$"):
        broadcast_packed(torch.zeros(2, dtype=torch.int64), seg)
    with pytest.raises(TypeError, match=r"^segment_ids must be a 1-D integer tensor \(L,\), got torch\.bool \(2,\)$"):
        broadcast_packed(torch.zeros(2), torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"^policy_mask must be a bool tensor of shape \(2,\), got torch\.int64 \(2,\)$"):
        broadcast_packed(torch.zeros(2), seg, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"^policy_mask must be a bool tensor of shape \(2,\), got torch\.bool \(3,\)$"):
        broadcast_packed(torch.zeros(2), seg, torch.tensor([True, False, True]))


def test_broadcast_packed_one_row_and_no_row():
    # R = 1: the row's value on its tokens (not the empty-batch shortcut)
    out = broadcast_packed(torch.tensor([0.75], dtype=torch.float16), torch.tensor([-1, 0, 0], dtype=torch.int32))
    assert out.dtype == torch.float16 and out.tolist() == [0.0, 0.75, 0.75]
    # R = 0: every token belongs to no row
    empty = broadcast_packed(torch.zeros(0, dtype=torch.float16), torch.tensor([-1, -1]))
    assert empty.dtype == torch.float16 and empty.shape == (2,) and empty.tolist() == [0.0, 0.0]


def test_group_ids_from_uids_inputs():
    # mixed types stay distinct: 1 and "1" are different uids
    assert group_ids_from_uids([1, "1", 1, ("a", 2), ("a", 2)]).tolist() == [0, 1, 0, 2, 2]
    # tensors of ids, and the device argument
    t = group_ids_from_uids(torch.tensor([7, 3, 7]), device="cpu")
    assert t.tolist() == [0, 1, 0] and t.dtype == torch.int64 and t.device.type == "cpu"
    assert group_ids_from_uids(torch.tensor([5, 5])).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"^uids must be one-dimensional, got shape \(1, 2\)$"):
        group_ids_from_uids([["a", "b"]])


def test_atomic_turn_group_ids_hash_types_and_tensors():
    ids = atomic_turn_group_ids(torch.tensor([1, 1, 1, 2]), torch.tensor([0, 0, 0, 0]),
                                [b"\x00s", bytearray(b"\x00s"), 7, 7])
    assert ids.tolist() == [0, 0, 1, 2]  # bytes == bytearray; int hash differs from bytes; task differs
    import numpy as np

    assert atomic_turn_group_ids([1, 1], [0, 0], [np.int64(3), 3]).tolist() == [0, 0]
    with pytest.raises(TypeError, match=r"^state hashes must be int, str or bytes, got float$"):
        atomic_turn_group_ids([1], [0], [1.5])


def test_devices_are_kept_and_checked():
    """The meta device stands in for a GPU: results stay on the inputs' device; devices that differ
    are refused."""
    meta = torch.device("meta")
    assert group_ids_from_uids(["a", "b", "a"], device=meta).device == meta
    assert group_ids_from_uids(["a", "b", "a"], device="cpu").device.type == "cpu"
    # a float tensor that requires grad goes through detach(), not numpy's array protocol
    assert group_ids_from_uids(torch.tensor([2.0, 1.0, 2.0], requires_grad=True)).tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match=r"^response_mask is on meta but advantages on cpu$"):
        broadcast_to_tokens(torch.zeros(2), torch.ones(2, 3, device=meta))
    out = broadcast_packed(torch.zeros(0, device=meta), torch.tensor([-1, -1], device=meta))
    assert out.device == meta and out.shape == (2,)
    out = broadcast_packed(torch.zeros(2, device=meta), torch.tensor([0, 1, -1], device=meta))
    assert out.device == meta and out.shape == (3,)
