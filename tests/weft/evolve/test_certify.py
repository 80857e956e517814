"""Atomic-task certification by execution: the three baselines, pruning, coverage."""
import anyio
import pytest

from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
from treadle.weft.envs.atomic import candidate
from treadle.weft.evolve.certify import Certificate, certify_server, coverage, jaccard, prune
from treadle.weft.runtime import Runtime


def _report(mod, cands):
    async def main():
        async with Runtime() as rt:
            return await certify_server(rt, rt.register(mod), mod.initial_snapshot(), cands)
    return anyio.run(main)


@pytest.fixture(scope="module")
def shop_report():
    return _report(shop, shop_atomic.candidates())


def test_each_defect_fails_its_own_baseline(shop_report):
    certs = {c.task: c for c in shop_report.certificates}
    lookup, shipped, thanks = certs["shop-caps-in-stock"], certs["shop-cancel-shipped"], certs["shop-thanks"]
    assert not lookup.certified and not lookup.checks["read_only_zero"] and lookup.checks["gold_passes"]
    assert not shipped.certified and not shipped.checks["gold_executes"] and shipped.checks["do_nothing_zero"]
    assert not thanks.certified and not thanks.checks["do_nothing_zero"] and thanks.checks["gold_passes"]
    good = [c for c in shop_report.certificates if c.certified]
    assert {c.task for c in good} == {"shop-place-order", "shop-cancel-order", "shop-ship-order", "shop-open-ticket",
                                      "shop-close-ticket", "shop-reorder"}
    assert all(all(c.checks.values()) and not c.reasons for c in good)


def test_near_duplicates_pruned_and_coverage_reported(shop_report):
    assert [(p.task, p.kept, p.similarity) for p in shop_report.pruned] == [("shop-reorder", "shop-place-order", 1.0)]
    assert "shop-reorder" not in {t.name for t in shop_report.kept}
    assert shop_report.coverage.missing == ("search_products",)
    assert shop_report.coverage.ratio == pytest.approx(8 / 9)


def test_crm_candidates_cover_every_tool():
    rep = _report(crm, crm_tasks.candidates())
    assert rep.coverage.missing == () and rep.coverage.ratio == 1.0
    assert {c.task for c in rep.certificates if not c.certified} == {"crm-case-status"}
    assert [p.task for p in rep.pruned] == ["crm-credit-again"]


def test_a_check_that_ignores_the_write_is_caught_by_the_read_only_baseline():
    """A checkpoint comparing only the gold results (no state comparison): the read-only agent gets the same
    lookup result and passes unless the write's result is required."""
    weak = candidate("weak", "Ship order 2.", ["get_order(order_id=2)", "ship_order(order_id=2)"],
                     compare_state=False, gold_results_contained=False)
    c = {x.task: x for x in _report(shop, [weak]).certificates}["weak"]
    assert not c.certified and not c.checks["initial_fails"] and not c.checks["read_only_zero"]


def test_prune_and_coverage_maths():
    def cert(name, tools, ok=True):
        return Certificate(server="s", task=name, tools=tools, checks={}, certified=ok)
    assert jaccard(("a", "b"), ("b", "c")) == pytest.approx(1 / 3)
    kept, pruned = prune([cert("x", ("a", "b")), cert("y", ("a", "b", "c")), cert("z", ("b", "a")),
                          cert("w", ("d",), ok=False)], max_similarity=0.6)
    assert [k.task for k in kept] == ["x"] and [(p.task, p.kept) for p in pruned] == [("y", "x"), ("z", "x")]
    assert coverage("s", ["a", "b", "d"], kept).missing == ("d",)
    with pytest.raises(ValueError, match="max_similarity"):
        prune([], max_similarity=0)
