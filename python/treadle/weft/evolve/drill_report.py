"""The attribution drill (``treadle weft evolve --drill``): accuracy per component and the two cross-blames that
corrupt training, on two held-apart fault sets and on the fault catalogue, reported apart.

- **held-apart** (:mod:`~treadle.weft.evolve.faults_heldout`): faults of kinds the catalogue does not inject,
  written before the rules that decide them; each case goes through what the evolution loop does with its
  slot (a failed checkpoint: :func:`~treadle.weft.evolve.loop.attribute_failure` with the harness and the
  cross-harness verdicts; a passing one: :func:`~treadle.weft.evolve.loop.audit_passing`);
- **fresh** (:mod:`~treadle.weft.evolve.faults_fresh`): a second held-apart set with other mechanisms, written
  before its author read the rules, run the same way;
- **catalogue** (:func:`~treadle.weft.evolve.faults.native_suite` over the certified shop and CRM, attributed
  as the loop does, and :func:`~treadle.weft.evolve.faults_composed.composed_suite` over one composed task).

The cross-blames: ``blamed_on_policy`` (an environment, task, harness or evaluator fault blamed on the policy,
or a silent one left rewarded) and ``policy_blamed_elsewhere`` (a policy error blamed on another component).
``undecided`` cases are neither: offline they wait for an LLM attributor.
"""
from __future__ import annotations

from typing import Any

COMPONENTS = ("environment", "task", "harness", "evaluator", "policy")


async def attribution_drill(rt: Any) -> dict[str, Any]:
    """``{"held_apart": summary, "fresh": summary, "catalogue": summary}`` (see
    :func:`~treadle.weft.evolve.faults_heldout.summary`) and every case under ``"cases"``."""
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
    from treadle.weft.evolve.certify import certify_server
    from treadle.weft.evolve.compose import ServerBundle, certify_composed, compose, propose_groups
    from treadle.weft.evolve.faults import native_suite
    from treadle.weft.evolve.faults_composed import composed_suite
    from treadle.weft.evolve.faults_fresh import fresh_suite
    from treadle.weft.evolve.faults_heldout import heldout_suite, summary

    held = await heldout_suite(rt)
    fresh = await fresh_suite(rt)
    envs, bundles = [], []
    for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
        h = rt.register(mod)
        rep = await certify_server(rt, h, mod.initial_snapshot(), cands)
        envs.append((mod, rep.kept))
        bundles.append(ServerBundle(name=mod.server.name, server_hash=h, snapshot=mod.initial_snapshot(),
                                    tools=rt.registry.spec(h).tools, kept=list(rep.kept)))
    catalogue = await native_suite(rt, envs, as_loop=True)
    hashes = {b.name: b.server_hash for b in bundles}
    group = propose_groups(bundles)["ada@example.com"]
    ct = await certify_composed(rt, compose(bundles, group, name="ada-across-shop-and-crm",
                                            persona=("Mary Jackson", "mary@example.com"),
                                            lookalike=("Mary Jackman", "mary.jackman@example.com")), hashes)
    catalogue += await composed_suite(rt, ct, hashes)
    return {"held_apart": summary(held), "fresh": summary(fresh), "catalogue": summary(catalogue),
            "cases": {"held_apart": [c.model_dump(mode="json") for c in held],
                      "fresh": [c.model_dump(mode="json") for c in fresh],
                      "catalogue": [c.model_dump(mode="json") for c in catalogue]}}


def rows(s: dict[str, Any]) -> list[list[str]]:
    """Table rows: one per component (correct / observed, accuracy), then the total."""
    out = []
    for comp in COMPONENTS:
        v = s["per_component"].get(comp)
        if v:
            out.append([comp, f"{v['correct']}/{v['n']}", f"{v['correct'] / v['n']:.0%}"])
    out.append(["all", f"{s['correct']}/{s['observed']}", f"{s['accuracy']:.1%}"])
    return out
