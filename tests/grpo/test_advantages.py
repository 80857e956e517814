"""treadle.ops.grpo_advantages: exact small cases on every backend, randomised agreement with the
float64 reference, and bad input."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle import dispatch
from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_reference, grpo_advantages_scatter
from treadle.testing import assert_close_verbose, assert_within_rule


def _backends():
    out = []
    for b in ("reference", "cpp", "triton"):
        try:
            dispatch.choose("grpo_advantages", "cpu", b)
            out.append(b)
        except dispatch.BackendUnavailableError:
            pass
    return out


BACKENDS = _backends()
R2 = 0.5**0.5


def test_cpu_backends_are_all_here():
    # CI builds the extension and runs Triton under the interpreter: a missing backend is a bug there.
    assert BACKENDS == ["reference", "cpp", "triton"]


def adv(rewards, ids, backend, dtype=torch.float64, **kw):
    return grpo_advantages(torch.tensor(rewards, dtype=dtype), torch.tensor(ids), backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
class TestExactCases:
    def test_interleaved_prompts_group_by_id_not_position(self, backend):
        a = adv([1.0, 0.0, 0.0, 1.0], [0, 1, 0, 1], backend, eps=0.0)
        assert_close_verbose(a, torch.tensor([R2, -R2, -R2, R2], dtype=torch.float64), atol=1e-15, rtol=0)

    def test_uneven_groups(self, backend):
        a = adv([0.0, 1.0, 2.0, 3.0, 5.0], [5, 5, 5, 9, 9], backend, eps=0.0)
        assert_close_verbose(a, torch.tensor([-1.0, 0.0, 1.0, -R2, R2], dtype=torch.float64), atol=1e-15, rtol=0)

    def test_group_of_one_zero_convention(self, backend):
        a = adv([3.0, 0.0, 1.0], [1, 2, 2], backend, eps=0.0)
        assert a.tolist() == pytest.approx([0.0, -R2, R2], abs=1e-15)
        assert a[0].item() == 0.0

    def test_group_of_one_raw_convention_matches_verl(self, backend):
        a = adv([3.0, 0.0, 1.0], [1, 2, 2], backend, singleton="raw", eps=1e-6)
        assert a[0].item() == pytest.approx(3.0 / (1 + 1e-6), rel=1e-15)
        b = adv([3.0], [1], backend, singleton="raw", estimator="rloo")
        assert b.item() == 3.0

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_all_equal_rewards_give_exact_zero(self, backend, dtype):
        a = adv([3.7] * 16, [4] * 16, backend, dtype=dtype)
        assert torch.equal(a, torch.zeros(16, dtype=dtype))
        for est in ("grpo", "dr_grpo", "rloo"):
            assert torch.equal(adv([0.1] * 5 + [0.2, 0.3], [1] * 5 + [2, 2], backend, dtype=dtype, estimator=est)[:5],
                               torch.zeros(5, dtype=dtype))

    def test_nearly_constant_group_is_normalised(self, backend):
        a = adv([1.0, 1.00001, 1.00002, 1.00003], [0] * 4, backend, eps=0.0)
        s = math.sqrt(5 / 3) * 1e-5
        expected = torch.tensor([-1.5e-5 / s, -0.5e-5 / s, 0.5e-5 / s, 1.5e-5 / s], dtype=torch.float64)
        assert_close_verbose(a, expected, atol=1e-9, rtol=0)  # 1.161895, 0.387298: no variance floor
        a32 = adv([1.0, 1.00001, 1.00002, 1.00003], [0] * 4, backend, dtype=torch.float32, eps=0.0)
        r32 = torch.tensor([1.0, 1.00001, 1.00002, 1.00003], dtype=torch.float32).double()
        exp32 = (r32 - r32.mean()) / r32.std()
        assert_close_verbose(a32, exp32, atol=1e-6, rtol=0)

    def test_rejected_row_excluded_from_baseline(self, backend):
        a = grpo_advantages(torch.tensor([0.0, 1.0, 100.0], dtype=torch.float64), torch.tensor([0, 0, 0]),
                            valid=torch.tensor([True, True, False]), eps=0.0, backend=backend)
        assert a.tolist() == pytest.approx([-R2, R2, 0.0], abs=1e-15)

    def test_flagged_positive_row_clamped_others_keep(self, backend):
        a = grpo_advantages(torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0, 0, 0]),
                            flags=torch.tensor([False, True, False, True]), eps=0.0, backend=backend)
        c = 0.5 / math.sqrt(1 / 3)
        assert a.tolist() == pytest.approx([-c, 0.0, c, -c], abs=1e-12)

    def test_nan_skip_like_trl(self, backend):
        a = grpo_advantages(torch.tensor([0.0, float("nan"), 1.0], dtype=torch.float64), torch.tensor([0, 0, 0]),
                            nonfinite="skip", eps=0.0, backend=backend)
        assert a.tolist() == pytest.approx([-R2, 0.0, R2], abs=1e-15)

    def test_estimators(self, backend):
        r, ids = [0.0, 1.0, 5.0, 2.0, 4.0], [0, 0, 0, 1, 1]
        assert adv(r, ids, backend, estimator="dr_grpo").tolist() == pytest.approx([-2, -1, 3, -1, 1])
        # RLOO: r_i minus the mean of the others
        assert adv(r, ids, backend, estimator="rloo").tolist() == pytest.approx([-3, -1.5, 4.5, -2, 2])
        d = torch.tensor([-2.0, -1, 3, -1, 1], dtype=torch.float64)
        assert adv(r, ids, backend, estimator="reinforce_baseline", eps=0.0).tolist() == pytest.approx(
            ((d - d.mean()) / d.std()).tolist())
        # TRL's scale_rewards="batch": group mean, batch std
        rb = torch.tensor(r, dtype=torch.float64)
        exp = torch.tensor([-2.0, -1, 3, -1, 1], dtype=torch.float64) / (rb.std() + 1e-4)
        assert adv(r, ids, backend, scale_rewards="batch", eps=1e-4).tolist() == pytest.approx(exp.tolist())
        # biased std and eps inside the sqrt
        e = adv(r, ids, backend, std="biased", eps_placement="var", eps=1e-3)
        v = torch.tensor([2.0**2 + 1 + 9], dtype=torch.float64) / 3
        assert e[0].item() == pytest.approx(-2 / math.sqrt(v.item() + 1e-3))

    def test_empty_batch(self, backend):
        a = grpo_advantages(torch.empty(0), torch.empty(0, dtype=torch.int64), backend=backend)
        assert a.shape == (0,) and a.dtype == torch.float32

    def test_half_inputs_give_float32(self, backend):
        a = grpo_advantages(torch.tensor([0.0, 1.0], dtype=torch.bfloat16), torch.tensor([1, 1]), backend=backend)
        assert a.dtype == torch.float32


ragged = st.lists(st.tuples(st.integers(1, 9), st.integers(-(2**62), 2**62)), min_size=1, max_size=40)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=ragged, seed=st.integers(0, 2**31 - 1),
       estimator=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_baseline"]),
       singleton=st.sampled_from(["zero", "raw"]), masks=st.booleans())
def test_random_ragged_batches_agree_with_reference(groups, seed, estimator, singleton, masks):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((size,), gid, dtype=torch.int64) for size, gid in groups])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    rewards = torch.randint(0, 3, ids.shape, generator=gen).double() + torch.rand(ids.shape, generator=gen).double() * (seed % 2)
    valid = torch.rand(ids.shape, generator=gen) > 0.2 if masks else None
    flags = torch.rand(ids.shape, generator=gen) > 0.7 if masks else None
    kw = dict(valid=valid, flags=flags, estimator=estimator, singleton=singleton)
    ref = grpo_advantages_reference(rewards, ids, valid, flags, estimator=estimator, singleton=singleton)
    for b in BACKENDS[1:]:
        assert_close_verbose(grpo_advantages(rewards, ids, backend=b, **kw), ref, atol=1e-10, rtol=1e-10, name=b)
        a32 = grpo_advantages(rewards.float(), ids, backend=b, **kw)
        assert_close_verbose(a32, ref, atol=1e-5, rtol=1e-5, name=f"{b} fp32")


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tolerance_rule_against_plain_pytorch(backend, dtype):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (700,), generator=gen)
    rewards = torch.rand(700, generator=gen).to(dtype)
    ref = grpo_advantages_reference(rewards, ids)
    plain = grpo_advantages_scatter(rewards, ids)
    kernel = grpo_advantages(rewards, ids, backend=backend)
    assert_within_rule(kernel, plain, ref, factor=2.0, floor=1e-6, name=f"{backend} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_non_contiguous_inputs(backend):
    r = torch.rand(40, dtype=torch.float64)[::2]
    ids = torch.arange(40)[::2] % 3
    assert_close_verbose(grpo_advantages(r, ids, backend=backend), grpo_advantages_reference(r, ids), atol=1e-12, rtol=0)


def test_inputs_are_not_modified():
    r = torch.tensor([1.0, float("nan"), 3.0])
    ids = torch.tensor([0, 0, 0])
    valid = torch.tensor([True, True, True])
    before = (r.clone(), ids.clone(), valid.clone())
    for b in BACKENDS:
        grpo_advantages(r, ids, valid=valid, nonfinite="skip", backend=b)
    assert torch.equal(ids, before[1]) and torch.equal(valid, before[2]) and torch.allclose(r, before[0], equal_nan=True)


class TestBadInput:
    def test_mismatched_lengths(self):
        with pytest.raises(ValueError, match="group_ids must have shape \\(3,\\)"):
            grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64))

    def test_float_group_ids(self):
        with pytest.raises(TypeError, match="group_ids must be an integer tensor"):
            grpo_advantages(torch.zeros(3), torch.zeros(3))

    def test_non_tensor(self):
        with pytest.raises(TypeError, match="rewards must be a torch.Tensor"):
            grpo_advantages([1.0, 2.0], torch.zeros(2, dtype=torch.int64))

    def test_integer_rewards(self):
        with pytest.raises(TypeError, match="rewards must be a floating tensor"):
            grpo_advantages(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))

    @pytest.mark.parametrize("bad", [float("nan"), float("inf")])
    def test_nonfinite_rewards(self, bad):
        with pytest.raises(ValueError, match="NaN/inf value\\(s\\) in considered rows \\(first at index 1"):
            grpo_advantages(torch.tensor([0.0, bad]), torch.tensor([0, 0]))

    def test_nan_in_rejected_row_is_fine(self):
        a = grpo_advantages(torch.tensor([0.0, float("nan"), 1.0]), torch.tensor([0, 0, 0]),
                            valid=torch.tensor([True, False, True]))
        assert a[1].item() == 0.0

    def test_masks(self):
        with pytest.raises(TypeError, match="valid must have dtype torch.bool"):
            grpo_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.int64), valid=torch.ones(2))
        with pytest.raises(ValueError, match="flags must have shape \\(2,\\)"):
            grpo_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.int64), flags=torch.ones(3, dtype=torch.bool))

    def test_wrong_rank(self):
        with pytest.raises(ValueError, match="rewards must be 1-D"):
            grpo_advantages(torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64))

    def test_options(self):
        r, g = torch.zeros(2), torch.zeros(2, dtype=torch.int64)
        for kw, msg in [({"estimator": "ppo"}, "estimator must be one of"), ({"eps": -1}, "eps must be"),
                        ({"std": "sample"}, "std must be"), ({"singleton": "one"}, "singleton must be"),
                        ({"estimator": "rloo", "scale_rewards": "batch"}, "applies to estimator='grpo' only"),
                        ({"nonfinite": "ignore"}, "nonfinite must be")]:
            with pytest.raises(ValueError, match=msg):
                grpo_advantages(r, g, **kw)

    def test_unavailable_backend(self):
        with pytest.raises(dispatch.BackendUnavailableError, match="cuda"):
            grpo_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.int64), backend="cuda")


def test_torch_compile_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")  # aot_eager runs the fake implementation
    def f(r, g):
        return grpo_advantages(r, g, backend="cpp") * 2

    r, g = torch.rand(10, dtype=torch.float64), torch.arange(10) % 3
    assert_close_verbose(f(r, g), 2 * grpo_advantages_reference(r, g), atol=1e-12, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_backends_agree(backend):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (100_000,), generator=gen)
    r = torch.rand(100_000, generator=gen, dtype=torch.float64)
    valid = torch.rand(100_000, generator=gen) > 0.1
    flags = torch.rand(100_000, generator=gen) > 0.9
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        ref = grpo_advantages(r, ids, valid=valid, flags=flags, estimator=est, backend="cpp")
        out = grpo_advantages(r.cuda(), ids.cuda(), valid=valid.cuda(), flags=flags.cuda(), estimator=est, backend=backend)
        assert_close_verbose(out.cpu(), ref, atol=1e-9, rtol=1e-9, name=f"{backend} {est}")


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_baseline"])
def test_large_batch_uses_partitioned_hash_pass(estimator):
    # 40,000 rows: the C++ kernel's radix pass spreads them over 32 partitions of hashed ids.
    gen = torch.Generator().manual_seed(5)
    n = 40_000
    ids = torch.randint(0, 3000, (n,), generator=gen) * 1_000_003 - 7
    r = torch.rand(n, generator=gen, dtype=torch.float64)
    valid = torch.rand(n, generator=gen) > 0.05
    flags = torch.rand(n, generator=gen) > 0.9
    ref = grpo_advantages_reference(r, ids, valid, flags, estimator=estimator)
    out = grpo_advantages(r, ids, valid=valid, flags=flags, estimator=estimator, backend="cpp")
    assert_close_verbose(out, ref, atol=1e-10, rtol=1e-10)


# - exact zero, not by luck
INEXACT = [0.1, 0.1, 0.1]  # float64: sum 0.30000000000000004, mean 0.10000000000000002 != 0.1
INEXACT7 = [0.7] * 7       # float64: mean 0.7000000000000001


def test_the_exact_zero_cases_really_have_an_inexact_mean():
    # what makes the cases below mean something: a mean that differs from the value it averages
    for vals in (INEXACT, INEXACT7):
        t = torch.tensor(vals, dtype=torch.float64)
        assert t.mean().item() != vals[0] and t.sum().item() / len(vals) != vals[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("dr_grpo", None),
                                             ("rloo", None)])
@pytest.mark.parametrize("eps_placement", ["std", "var"])
def test_equal_rewards_exact_zero_at_eps_zero(backend, dtype, estimator, scale, eps_placement):
    # eps = 0: a missing all-equal guard divides 0 by 0 (NaN) or rounding noise by rounding noise
    # (an O(1) advantage); the contract is exactly 0 in every dtype and backend
    rewards = INEXACT + INEXACT7 + [0.0, 1.0, 0.5]
    ids = [3] * 3 + [8] * 7 + [1, 1, 1]
    a = adv(rewards, ids, backend, dtype=dtype, estimator=estimator, scale_rewards=scale, eps=0.0,
            eps_placement=eps_placement)
    assert bool(torch.isfinite(a).all())
    assert torch.equal(a[:10], torch.zeros(10, dtype=a.dtype)), a[:10]
    assert bool((a[10:] != 0).any())  # the varied group is not zeroed by mistake


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_reinforce_baseline_all_equal_batch_is_exactly_zero(backend, dtype, singleton):
    # every group all-equal: pre-whitening advantages are all exactly 0; whitening them must give 0,
    # not 0 / (0 + eps) = NaN at eps = 0
    a = adv(INEXACT + INEXACT7, [3] * 3 + [8] * 7, backend, dtype=dtype, estimator="reinforce_baseline", eps=0.0,
            singleton=singleton)
    assert torch.equal(a, torch.zeros(10, dtype=a.dtype)), a
    # all singletons with one raw reward whose mean is inexact: equal pre-whitening advantages again
    b = adv([0.1] * 3, [1, 2, 3], backend, dtype=dtype, estimator="reinforce_baseline", eps=0.0, singleton="raw")
    assert torch.equal(b, torch.zeros(3, dtype=b.dtype)), b
