"""The grouped-contiguous fast path of the C++ GRPO kernel (csrc/cpu/grpo_advantages.cpp,
``contiguous_advantages``): every group's rows form one run of equal ids. Its outputs must be the
general (radix-partition) path's, bit for bit, and the reference's within float64 rounding; ids that
repeat after their run (a shuffled tail, a split group, a repeat across the two threads' chunks) must
fall back to the general path with the same result. ``TREADLE_GRPO_CONTIGUOUS=0`` turns the fast path
off, which gives the general path's output to compare with."""
import pytest
import torch

from treadle import dispatch
from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_reference
from treadle.testing import assert_close_verbose


def _cpp_built() -> bool:
    try:
        dispatch.choose("grpo_advantages", "cpu", "cpp")
    except dispatch.BackendUnavailableError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _cpp_built(), reason="treadle._C is not built")

OPTIONS = [
    dict(estimator="grpo"),
    dict(estimator="grpo", std="biased", eps_placement="var"),
    dict(estimator="grpo", scale_rewards="batch"),
    dict(estimator="grpo", scale_rewards="none", singleton="raw"),
    dict(estimator="dr_grpo"),
    dict(estimator="rloo"),
    dict(estimator="reinforce_baseline"),
]


def _sizes(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "equal":
        return torch.full((n // 8,), 8)
    sizes = torch.randint(1, 20, (n,), generator=gen)
    sizes = sizes[: int((sizes.cumsum(0) <= n).sum())]
    return torch.cat([sizes, torch.tensor([n - int(sizes.sum())])]) if int(sizes.sum()) < n else sizes


def _layout(n: int, kind: str, id_order: str, seed: int):
    """Rewards and ids with contiguous groups; ids numbered 0, 1, 2... (the adapters' first-appearance
    order) or in random order with gaps and negative values."""
    gen = torch.Generator().manual_seed(seed)
    sizes = _sizes(n, kind, gen)
    g = sizes.numel()
    names = torch.arange(g) if id_order == "increasing" else torch.randperm(g, generator=gen) * 7919 - 5000
    ids = torch.repeat_interleave(names, sizes)
    r = (torch.rand(n, generator=gen, dtype=torch.float64) < 0.4).double() + 0.1 * torch.rand(n, generator=gen, dtype=torch.float64)
    r[: min(n, 16)] = 1.0  # the first groups: all-equal rewards (advantage exactly 0)
    return r, ids


def _both_paths(monkeypatch, r, ids, **kw):
    monkeypatch.setenv("TREADLE_GRPO_CONTIGUOUS", "0")
    general = grpo_advantages(r, ids, backend="cpp", **kw)
    monkeypatch.setenv("TREADLE_GRPO_CONTIGUOUS", "1")
    fast = grpo_advantages(r, ids, backend="cpp", **kw)
    return general, fast


def _check(general, fast, r, ids, **kw):
    assert torch.equal(general, fast), f"fast path differs from the general path: max |diff| {(general - fast).abs().max()}"
    ref_kw = {k: v for k, v in kw.items() if k not in ("std", "eps_placement", "singleton", "scale_rewards", "nonfinite")}
    ref = grpo_advantages_reference(
        r.double(), ids, kw.get("valid"), kw.get("flags"), unbiased=kw.get("std", "unbiased") == "unbiased",
        eps_in_sqrt=kw.get("eps_placement") == "var", singleton=kw.get("singleton", "zero"),
        scale_rewards=kw.get("scale_rewards") or "group", skip_nonfinite=kw.get("nonfinite") == "skip",
        **{k: v for k, v in ref_kw.items() if k not in ("valid", "flags")})
    tol = 1e-12 if r.dtype == torch.float64 else 2e-6
    assert_close_verbose(fast.double(), ref.double(), atol=tol, rtol=tol, name="fast path vs reference")


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
@pytest.mark.parametrize("kind", ["equal", "ragged"])
@pytest.mark.parametrize("id_order", ["increasing", "random"])
def test_contiguous_layouts_match_general_path_and_reference(monkeypatch, opts, kind, id_order):
    r, ids = _layout(3001 if kind == "ragged" else 3000, kind, id_order, seed=1)
    general, fast = _both_paths(monkeypatch, r, ids, **opts)
    _check(general, fast, r, ids, **opts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("opts", OPTIONS[:3] + OPTIONS[-1:], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_valid_and_flags_on_contiguous_groups(monkeypatch, dtype, opts):
    r, ids = _layout(2000, "ragged", "random", seed=2)
    gen = torch.Generator().manual_seed(3)
    valid = torch.rand(r.numel(), generator=gen) > 0.2
    valid[16:24] = False  # a whole group left out
    flags = torch.rand(r.numel(), generator=gen) > 0.8
    r = r.to(dtype)
    general, fast = _both_paths(monkeypatch, r, ids, valid=valid, flags=flags, **opts)
    _check(general, fast, r, ids, valid=valid, flags=flags, **opts)
    assert (fast[~valid] == 0).all()


def test_nonfinite_rewards_skipped_on_contiguous_groups(monkeypatch):
    r, ids = _layout(496, "equal", "increasing", seed=4)
    r[[3, 40, 41, 100]] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")], dtype=r.dtype)
    general, fast = _both_paths(monkeypatch, r, ids, nonfinite="skip")
    _check(general, fast, r, ids, nonfinite="skip")
    assert (fast[[3, 40, 41, 100]] == 0).all()


@pytest.mark.parametrize("mix", ["shuffled_tail", "split_group", "repeat_of_first", "one_swap"])
def test_ids_repeating_after_their_run_fall_back(monkeypatch, mix):
    r, ids = _layout(4000, "ragged", "random", seed=5)
    gen = torch.Generator().manual_seed(6)
    if mix == "shuffled_tail":  # the first half contiguous, the second half shuffled
        tail = torch.randperm(2000, generator=gen) + 2000
        order = torch.cat([torch.arange(2000), tail])
        r, ids = r[order].contiguous(), ids[order].contiguous()
    elif mix == "split_group":  # one group's rows in two runs far apart
        ids = ids.clone()
        ids[-1] = ids[0]
    elif mix == "repeat_of_first":  # a later run reuses the first run's id
        ids = ids.clone()
        ids[2000:2003] = ids[0]
    else:  # two neighbouring rows of different groups swapped
        k = int((ids[1:] != ids[:-1]).nonzero()[5]) + 1
        ids = ids.clone()
        ids[k - 1], ids[k] = ids[k].item(), ids[k - 1].item()
    general, fast = _both_paths(monkeypatch, r, ids)
    _check(general, fast, r, ids)


@pytest.mark.parametrize("case", ["contiguous", "repeat_across_chunks", "run_across_chunk_bound", "decreasing"])
def test_two_thread_chunks(monkeypatch, case):
    # 300,000 rows: two threads, each with one chunk whose bound moves to the next id change.
    n = 300_000
    r, ids = _layout(n, "ragged", "increasing", seed=7)
    ids = ids.clone()
    if case == "repeat_across_chunks":  # chunk 1 reuses an id of chunk 0: only the cross check sees it
        ids[-5:] = ids[10]
    elif case == "run_across_chunk_bound":  # one long run over the middle row
        ids[n // 2 - 50: n // 2 + 50] = ids[n // 2 - 50]
        ids[n // 2 + 50:] += 1_000_000
    elif case == "decreasing":  # no increasing shortcut: both chunks fill their id sets
        ids = -ids
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(_both_paths(monkeypatch, r, ids))
    finally:
        torch.set_num_threads(before)
    for general, fast in outs:
        assert torch.equal(general, fast)
    assert torch.equal(outs[0][1], outs[1][1])
    # The float64 reference loops over groups (~110 s for all 300,000 rows): groups are independent, so it
    # checks the groups at both ends, around the two chunks' bound and a random sample, about 1% of rows.
    gen = torch.Generator().manual_seed(8)
    rows = torch.cat([torch.arange(200), torch.arange(n // 2 - 300, n // 2 + 300), torch.arange(n - 200, n),
                      torch.randint(0, n, (300,), generator=gen)])
    keep = torch.isin(ids, ids[rows])
    assert keep.sum() < n // 20
    _check(outs[1][0][keep], outs[1][1][keep], r[keep], ids[keep])


def test_small_and_degenerate_batches(monkeypatch):
    for r, ids in [
        (torch.tensor([0.5]), torch.tensor([7])),
        (torch.tensor([1.0, 2.0]), torch.tensor([3, 3])),
        (torch.tensor([1.0, 2.0, 5.0]), torch.tensor([3, 4, 4])),
        (torch.tensor([1.0, 2.0, 5.0, 1.0]), torch.tensor([2**63 - 1, 2**63 - 1, -(2**63), 0])),
        (torch.arange(10.0), torch.full((10,), -1)),
    ]:
        general, fast = _both_paths(monkeypatch, r, ids)
        _check(general, fast, r, ids)
