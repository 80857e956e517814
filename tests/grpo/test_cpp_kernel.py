"""The C++ CPU kernel of treadle.ops.grpo_advantages (csrc/cpu/grpo_advantages.cpp) beyond the exact
small cases: determinism across thread counts, a partition holding every row (its table grows),
extreme id values, and the eager shortcut past the custom-op layer giving the custom op's result."""
import pytest
import torch

from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_reference, grpo_advantages_scatter
from treadle.testing import assert_close_verbose, require_backend



pytestmark = require_backend("grpo_advantages", "cpp")  # skips locally, fails under CI

_M = 2**64
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser, as in the kernel


def _unxorshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x


def _id_with_hash(h: int) -> int:
    """The int64 id whose splitmix64 hash is ``h`` (the finaliser is a bijection of 64-bit ints)."""
    x = _unxorshift(h, 31)
    x = (x * pow(_C2, -1, _M)) % _M
    x = _unxorshift(x, 27)
    x = (x * pow(_C1, -1, _M)) % _M
    x = _unxorshift(x, 30)
    return x - _M if x >= 2**63 else x


def _batch(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 33, (n,), generator=gen)
    sizes = sizes[: int((sizes.cumsum(0) <= n).sum())]
    sizes = torch.cat([sizes, torch.tensor([n - int(sizes.sum())])]) if int(sizes.sum()) < n else sizes
    ids = torch.repeat_interleave(torch.randperm(sizes.numel(), generator=gen) * 7919 - 3, sizes)
    perm = torch.randperm(n, generator=gen)
    r = (torch.rand(n, generator=gen, dtype=torch.float64) < 0.4).double() + 0.1 * torch.rand(n, generator=gen, dtype=torch.float64)
    valid = torch.rand(n, generator=gen) > 0.05
    flags = torch.rand(n, generator=gen) > 0.9
    return r[perm].contiguous(), ids[perm].contiguous(), valid, flags


@pytest.mark.parametrize("estimator,scale", [("grpo", None), ("grpo", "batch"), ("rloo", None),
                                             ("reinforce_baseline", None)])
def test_same_bits_for_one_and_two_threads(estimator, scale):
    # 300,000 rows: above the kernel's one-thread limit (2 x 131,072 rows), so two threads split it.
    r, ids, valid, flags = _batch(300_000, seed=1)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(grpo_advantages(r, ids, valid=valid, flags=flags, estimator=estimator, scale_rewards=scale,
                                        backend="cpp"))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    if estimator == "grpo" and scale is None:  # and the numbers are right (float64 scatter, no masks)
        plain = grpo_advantages(r, ids, backend="cpp")
        assert_close_verbose(plain, grpo_advantages_scatter(r, ids), atol=1e-10, rtol=1e-10)


def test_every_row_in_one_partition_grows_the_table():
    # Ids whose hashes share their top 8 bits all land in one partition: 10,000 groups of two there
    # overflow the table's first 16,384 slots (load 1/2), so it doubles mid-partition.
    n_groups = 10_000
    ids = torch.tensor([_id_with_hash((g * 0x9E3779B97F4A7C15) % 2**56) for g in range(n_groups)]).repeat(2)
    gen = torch.Generator().manual_seed(2)
    perm = torch.randperm(ids.numel(), generator=gen)
    ids = ids[perm].contiguous()
    r = torch.rand(ids.numel(), generator=gen, dtype=torch.float64)
    out = grpo_advantages(r, ids, backend="cpp", eps=0.0)
    assert_close_verbose(out, grpo_advantages_scatter(r, ids, eps=0.0), atol=1e-12, rtol=1e-12)
    assert_close_verbose(out.abs(), torch.full_like(out, 0.5**0.5), atol=1e-12, rtol=0)  # pairs: +-1/sqrt(2)


def test_extreme_and_colliding_ids():
    big, small = 2**63 - 1, -(2**63)
    ids = torch.tensor([big, small, 0, -1, big, small, 0, -1, 1 << 40, 2 << 40, 1 << 40, 2 << 40])
    r = torch.arange(12, dtype=torch.float64) ** 1.5
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        assert_close_verbose(grpo_advantages(r, ids, estimator=est, backend="cpp"),
                             grpo_advantages_reference(r, ids, estimator=est), atol=1e-12, rtol=1e-12, name=est)


@pytest.mark.parametrize("n", [7, 5000])
def test_eager_shortcut_gives_the_custom_ops_result(n):
    r, ids, valid, flags = _batch(n, seed=3)
    for dtype in (torch.float32, torch.float64):
        rr = r.to(dtype)
        fast = grpo_advantages(rr, ids, valid=valid, flags=flags, backend="cpp")  # plain eager: the shortcut
        via_op = torch.ops.treadle.grpo_advantages(rr, ids, valid, flags, 0, True, 1e-6, False, False, 0, False, "cpp")
        assert torch.equal(fast, via_op)
        # rewards that require grad go through the custom op, as before
        slow = grpo_advantages(rr.clone().requires_grad_(), ids, valid=valid, flags=flags, backend="cpp")
        assert torch.equal(slow.detach(), fast)


def test_nonfinite_check_sees_overflowing_float32_sums_and_half_dtypes():
    # float32 rewards whose sum overflows are finite: the quick sum check must not reject them
    r = torch.tensor([3e38, 3e38, -1.0, 2.0], dtype=torch.float32)
    out = grpo_advantages(r, torch.tensor([0, 0, 1, 1]), backend="cpp")
    assert torch.isfinite(out).all()
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="NaN/inf value\\(s\\) in considered rows \\(first at index 2"):
            grpo_advantages(torch.tensor([1.0, 2.0, float("inf"), 0.0], dtype=dtype), torch.tensor([0, 0, 1, 1]))
