"""``treadle demo --sections weft-evolve``: certification, cross-server composition and the attribution table.

Offline and deterministic: certifies the shop's and the CRM's atomic-task candidates (coverage,
pruned near-duplicates, rejections), composes one task across both servers and runs its reference
plan, then runs the fault-injection suite (native environments, the composed task's binding / edge /
cycle faults; BFCL classes too when ``bfcl-eval`` is installed and not ``--quick``) and prints the confusion matrix of deterministic attribution,
after the held-apart figure (:mod:`~treadle.weft.evolve.faults_heldout`, attributed as the evolution loop does:
the figure that says how attribution holds on faults it was not written for).
Writes ``certification.jsonl``, ``composed.json``, ``heldout.json``, ``faults.jsonl`` and ``confusion.json``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio


async def _main(quick: bool) -> dict[str, Any]:
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
    from treadle.weft.evolve.certify import certify_server
    from treadle.weft.evolve.compose import ServerBundle, certify_composed, compose, propose_groups, run_composed
    from treadle.weft.evolve.faults import native_suite
    from treadle.weft.evolve.faults_composed import composed_suite
    from treadle.weft.runtime import Runtime

    out: dict[str, Any] = {}
    async with Runtime() as rt:
        reports, bundles = [], []
        for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
            h = rt.register(mod)
            rep = await certify_server(rt, h, mod.initial_snapshot(), cands)
            reports.append(rep)
            bundles.append(ServerBundle(name=mod.server.name, server_hash=h, snapshot=mod.initial_snapshot(),
                                        tools=rt.registry.spec(h).tools, kept=list(rep.kept)))
        out["reports"] = reports
        hashes = {b.name: b.server_hash for b in bundles}
        group = propose_groups(bundles)["ada@example.com"]
        ct = await certify_composed(rt, compose(bundles, group, name="ada-across-shop-and-crm",
                                                persona=("Mary Jackson", "mary@example.com"),
                                                lookalike=("Mary Jackman", "mary.jackman@example.com")), hashes)
        out["composed"] = ct
        out["composed_run"] = await run_composed(rt, ct, hashes)
        cases = await native_suite(rt, [(shop, reports[0].kept), (crm, reports[1].kept)])
        cases += await composed_suite(rt, ct, hashes)  # composed cross-server faults: bindings, edges, cycles
        if not quick:
            try:
                import bfcl_eval  # noqa: F401
            except ModuleNotFoundError:
                pass
            else:
                from treadle.weft.evolve.faults_bfcl import bfcl_suite

                cases += await bfcl_suite(rt, limit=3, per_class=1)
        out["cases"] = cases
        from treadle.weft.evolve.faults_heldout import heldout_suite

        out["heldout"] = await heldout_suite(rt)  # attributed as the evolution loop does
    return out


def run(run_dir: Path, quick: bool, console) -> None:
    """Demo section (see the module docstring)."""
    from rich.table import Table

    from treadle.weft.evolve.faults import report

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)  # injected crashes are expected
    res = anyio.run(_main, quick)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t = Table(title="atomic-task certification by execution")
    for col in ("server", "candidates", "certified", "pruned (near-duplicate)", "kept", "tool coverage", "missing"):
        t.add_column(col)
    lines = []
    for rep in res["reports"]:
        lines += [c.model_dump_json() + "\n" for c in rep.certificates]
        t.add_row(rep.server, str(len(rep.certificates)), str(sum(c.certified for c in rep.certificates)),
                  str(len(rep.pruned)), str(len(rep.kept)), f"{rep.coverage.ratio:.0%}", ",".join(rep.coverage.missing))
    (run_dir / "certification.jsonl").write_text("".join(lines), encoding="utf-8")
    console.print(t)
    ct, cr = res["composed"], res["composed_run"]
    (run_dir / "composed.json").write_text(json.dumps({
        "name": ct.name, "rounds": ct.rounds, "dropped": ct.dropped,
        "bindings": [b.model_dump(mode="json") for b in ct.bindings],
        "nodes": [{"name": n.name, "server": n.server, "depends_on": n.depends_on, "request": n.atomic.request,
                   "gold": n.atomic.gold} for n in ct.ordered()],
        "reference_reward": cr.reward}, indent=1, default=str), encoding="utf-8")
    console.print(f"composed {ct.name}: {len(ct.nodes)} atomic tasks over {sorted(ct.snapshots)}, "
                  f"{len(ct.bindings)} bindings; reference plan R = {cr.reward:.2f}", markup=False)
    from treadle.weft.evolve.drill_report import rows
    from treadle.weft.evolve.faults_heldout import summary

    held = summary(res["heldout"])
    (run_dir / "heldout.json").write_text(json.dumps(held, indent=1), encoding="utf-8")
    t = Table(title="failure attribution on the held-apart fault set (faults of kinds the rules were not written "
                    "for; as the evolution loop attributes)")
    for col in ("component", "correct", "accuracy"):
        t.add_column(col)
    for row in rows(held):
        t.add_row(*row)
    console.print(t)
    console.print(f"held-apart: {held['correct']}/{held['observed']} correct; non-policy faults blamed on the policy: "
                  f"{len(held['blamed_on_policy'])}; policy errors blamed elsewhere: "
                  f"{len(held['policy_blamed_elsewhere'])}; undecided offline: {len(held['undecided'])}", markup=False)
    r = report(res["cases"])
    (run_dir / "faults.jsonl").write_text("".join(c.model_dump_json() + "\n" for c in r.cases), encoding="utf-8")
    (run_dir / "confusion.json").write_text(json.dumps({"confusion": r.confusion, "accuracy": r.accuracy,
                                                        "observed": len(r.observed), "cases": len(r.cases)}, indent=1),
                                            encoding="utf-8")
    rows = r.table()
    t = Table(title=f"failure attribution on the fault catalogue (written with the rules; deterministic path; "
                    f"{len({c.env for c in r.cases})} environments)")
    for col in rows[0]:
        t.add_column(col)
    for row in rows[1:]:
        t.add_row(*row)
    console.print(t)
    console.print(f"accuracy {r.accuracy:.1%} over {len(r.observed)} observed faults "
                  f"({len(r.cases) - len(r.observed)} injected faults left the checkpoint passing)", markup=False)
    comp = [c for c in r.observed if c.id.startswith("composed/")]
    console.print(f"of which composed cross-server ({ct.name}): {sum(c.correct for c in comp)} of {len(comp)} correct "
                  f"({sum(c.label.value == 'task' for c in comp)} wrong bindings, free-text bindings, dropped edges and "
                  f"cycles; {sum(c.label.value == 'policy' for c in comp)} skipped nodes)", markup=False)
