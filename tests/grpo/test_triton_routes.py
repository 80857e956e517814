"""The Triton GRPO kernels' two routes (triton_kernels/grpo.py) under the interpreter, with chunks of
16 rows so that runs cross chunks: the sorted route (segmented scans + stitching of runs that cross
chunks) and the general route (group table by ``id - min`` or by hash), chosen on the device, agree
with the float64 reference for every estimator and option, masks and flags, odd sizes and ids from
dense to the int64 extremes; the route taken is the one designed for the layout; no buffer of the
batch's size is zero-filled."""
import pytest
import torch

import treadle.triton_kernels.grpo as tk
from treadle.ops import grpo_advantages
from treadle.reference.grpo import grpo_advantages_reference
from treadle.testing import assert_close_verbose

I64 = torch.iinfo(torch.int64)


def _ids(layout: str, n: int, gen: torch.Generator) -> torch.Tensor:
    if layout == "sorted":
        return torch.arange(n) // 5
    if layout == "sorted_ragged":
        return torch.sort(torch.randint(-7, 40, (n,), generator=gen)).values
    if layout == "one_group":
        return torch.full((n,), 3)
    if layout == "contiguous_unsorted":
        return 40 - torch.arange(n) // 6
    if layout == "shuffled":
        return (torch.arange(n) // 7)[torch.randperm(n, generator=gen)]
    if layout == "sparse":
        return torch.randint(0, 9, (n,), generator=gen) * 10 ** 17 - 4 * 10 ** 17
    if layout == "extremes":
        return torch.tensor([I64.min, I64.max, 5, -1])[torch.randint(0, 4, (n,), generator=gen)]
    raise AssertionError(layout)


LAYOUTS = ["sorted", "sorted_ragged", "one_group", "contiguous_unsorted", "shuffled", "sparse", "extremes"]
OPTIONS = [
    dict(estimator="grpo"),
    dict(estimator="grpo", std="biased", eps_placement="var", singleton="raw"),
    dict(estimator="grpo", scale_rewards="batch"),
    dict(estimator="grpo", scale_rewards="none", singleton="raw"),
    dict(estimator="dr_grpo"),
    dict(estimator="rloo"),
    dict(estimator="reinforce_baseline"),
]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(tk, "CHUNK", 16)
    monkeypatch.setattr(tk, "BLOCK", 16)


def _reference(r, ids, valid, flags, opts, skip=False):
    return grpo_advantages_reference(
        r, ids, valid, flags, estimator=opts.get("estimator", "grpo"), unbiased=opts.get("std", "unbiased") == "unbiased",
        eps_in_sqrt=opts.get("eps_placement") == "var", singleton=opts.get("singleton", "zero"),
        scale_rewards=opts.get("scale_rewards") or "group", skip_nonfinite=skip)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_routes_match_reference(small_chunks, layout, opts):
    gen = torch.Generator().manual_seed(1)
    n = 131
    ids = _ids(layout, n, gen)
    r = (torch.rand(n, generator=gen, dtype=torch.float64) < 0.5).double() + 0.1 * torch.rand(n, generator=gen,
                                                                                              dtype=torch.float64)
    r[:10] = 1.0  # the first run: all equal, exactly 0
    valid = torch.rand(n, generator=gen) > 0.15
    flags = torch.rand(n, generator=gen) > 0.85
    r[3] = float("nan")  # with nonfinite="skip" the row is left out like valid=False
    for v, f, skip in ((None, None, True), (valid, flags, True)):
        out = grpo_advantages(r, ids, valid=v, flags=f, backend="triton", nonfinite="skip", **opts)
        assert_close_verbose(out, _reference(r, ids, v, f, opts, skip=True), atol=1e-12, rtol=1e-12,
                             name=f"{layout} {opts}")


def test_float32_rewards_odd_size(small_chunks):
    gen = torch.Generator().manual_seed(2)
    n = 1001
    ids = torch.arange(n) // 16
    r = torch.rand(n, generator=gen)
    out = grpo_advantages(r, ids, backend="triton")
    ref = _reference(r, ids, None, None, {})
    assert out.dtype == torch.float32
    assert_close_verbose(out.double(), ref, atol=2e-6, rtol=2e-6)


class _Spy:
    """Wraps a kernel: records the route flag (state[0]) when the general route's first kernel starts."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(int(args[0][0]))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("layout, opts, route", [
    ("sorted", {}, 0), ("one_group", dict(estimator="rloo"), 0), ("sorted_ragged", dict(estimator="dr_grpo"), 0),
    ("shuffled", {}, 1), ("contiguous_unsorted", {}, 1), ("sparse", {}, 1),
    ("sorted", dict(scale_rewards="batch"), 1), ("sorted", dict(estimator="reinforce_baseline"), 1),
])
def test_route_taken(small_chunks, monkeypatch, layout, opts, route):
    seen = []
    monkeypatch.setattr(tk, "_table_init_kernel", _Spy(tk._table_init_kernel, seen))
    ids = _ids(layout, 203, torch.Generator().manual_seed(0))
    grpo_advantages(torch.rand(203, dtype=torch.float64), ids, backend="triton", **opts)
    assert seen == [route] if route == 0 else seen[0] != 0


def test_run_longer_than_the_walk_limit_goes_general(small_chunks, monkeypatch):
    seen = []
    monkeypatch.setattr(tk, "_table_init_kernel", _Spy(tk._table_init_kernel, seen))
    n = 16 * (tk.WALK_LIMIT + 3)
    ids = torch.arange(n) // (n - 5)  # one run over more than WALK_LIMIT chunks, then a short one
    r = torch.rand(n, dtype=torch.float64)
    out = grpo_advantages(r, ids, backend="triton")
    assert seen == [2]
    assert_close_verbose(out, _reference(r, ids, None, None, {}), atol=1e-12, rtol=1e-12)


def test_no_zero_filled_buffer_of_the_batch_size(small_chunks, monkeypatch):
    sizes = []
    real = torch.zeros

    def zeros(*a, **kw):
        sizes.append(a[0] if a else kw.get("size"))
        return real(*a, **kw)

    monkeypatch.setattr(tk.torch, "zeros", zeros)
    n = 4099
    grpo_advantages(torch.rand(n, dtype=torch.float64), torch.arange(n) // 16, backend="triton")
    grpo_advantages(torch.rand(n, dtype=torch.float64), torch.randperm(n) // 16, backend="triton",
                    estimator="reinforce_baseline")
    assert sizes and max(sizes) <= 8, sizes


@pytest.mark.parametrize("layout, opts", [("shuffled", {}), ("sparse", dict(estimator="rloo")),
                                          ("sorted", dict(estimator="reinforce_baseline")),
                                          ("extremes", dict(scale_rewards="batch"))])
def test_general_route_grid_stride(small_chunks, monkeypatch, layout, opts):
    """Two programs loop over every block of the general route's passes (the capped grid of a large batch)."""
    monkeypatch.setattr(tk, "MAX_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(3)
    n = 157
    ids = _ids(layout, n, gen)
    r = torch.rand(n, generator=gen, dtype=torch.float64)
    valid = torch.rand(n, generator=gen) > 0.2
    out = grpo_advantages(r, ids, valid=valid, backend="triton", **opts)
    assert_close_verbose(out, _reference(r, ids, valid, None, opts), atol=1e-12, rtol=1e-12, name=layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sorted_route_narrow_dtypes_equal_runs_and_offset(small_chunks, dtype):
    """Narrow rewards: equal runs (inside a chunk and across chunk edges) give exactly 0; a large
    reward offset keeps the digits of ``r - mean`` (float64 sums and mean)."""
    gen = torch.Generator().manual_seed(4)
    n = 203
    ids = torch.arange(n) // 11  # runs of 11 cross the 16-row chunks
    base = torch.randint(0, 3, (n,), generator=gen).to(torch.float64)
    base[:33] = 2.0  # three equal runs, two of them cut by a chunk edge
    off = 1024.0 if dtype != torch.float32 else 2.0 ** 20
    r = (base + off).to(dtype)
    out = grpo_advantages(r, ids, backend="triton")
    ref = _reference(r.double(), ids, None, None, {})
    assert out.dtype == torch.float32
    assert torch.equal(out[:33], torch.zeros(33))
    assert_close_verbose(out.double(), ref, atol=4e-6, rtol=4e-6)


def test_sorted_route_nan_makes_the_run_differ(small_chunks):
    """A NaN reward that reaches the kernel (``check_finite=False``, as on CUDA) makes its run's max
    and min NaN, so the run is not "all equal": its rows are NaN as in the reference, other runs are
    untouched, also when the run crosses a chunk edge."""
    n = 77
    ids = torch.arange(n) // 6
    r = torch.rand(n, dtype=torch.float64)
    r[15] = float("nan")  # run 2 (rows 12..17) crosses the first chunk edge
    r[38] = float("nan")  # run 6 (rows 36..41) inside the third chunk
    r[48:54] = 2.0  # an equal run crossing an edge
    out = grpo_advantages(r, ids, backend="triton", check_finite=False)
    ref = _reference(r, ids, None, None, {})
    assert torch.isnan(out[12:18]).all() and torch.isnan(out[36:42]).all() and torch.equal(out[48:54], torch.zeros(6))
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    keep = ~torch.isnan(ref)
    assert_close_verbose(out[keep], ref[keep], atol=1e-12, rtol=1e-12)
