"""The attribution drill (``treadle weft evolve --drill``): accuracy per component and the two cross-blames that
corrupt training, on two held-apart fault sets and on the fault catalogue, reported apart.

- **held-apart** (:mod:`~treadle.weft.evolve.faults_heldout`): faults of kinds the catalogue does not inject,
  written before the rules that decide them; each case goes through what the evolution loop does with its
  slot (a failed checkpoint: :func:`~treadle.weft.evolve.loop.attribute_failure` with the harness and the
  cross-harness verdicts; a passing one: :func:`~treadle.weft.evolve.loop.audit_passing`);
- **fresh** (:mod:`~treadle.weft.evolve.faults_fresh`): a second held-apart set with other mechanisms, written
  before its author read the rules, run the same way;
- **catalogue** (:func:`~treadle.weft.evolve.faults.native_suite` over the certified shop and CRM, attributed
  as the loop does, and :func:`~treadle.weft.evolve.faults_composed.composed_suite` over one composed task);
- **bfcl** (:func:`~treadle.weft.evolve.faults_bfcl.bfcl_suite`: the first turn of one ``base`` entry per BFCL
  class, :data:`BFCL_ENTRIES` in all, or of every eligible entry with ``bfcl_all``, with the BFCL fault kinds,
  attributed as the loop does): its own table,
  since BFCL object state has no entity map or contracts and its requests are BFCL's own; without
  ``bfcl-eval`` installed it is reported as skipped, with the reason.

The cross-blames: ``blamed_on_policy`` (an environment, task, harness or evaluator fault blamed on the policy,
or a silent one left rewarded) and ``policy_blamed_elsewhere`` (a policy error blamed on another component).
``undecided`` cases are neither: offline they wait for an LLM attributor. Each table row gives, per component, the
correct / observed cases and that component's share of the cross-blames (:data:`COLUMNS`).
"""
from __future__ import annotations

from typing import Any

COMPONENTS = ("environment", "task", "harness", "evaluator", "policy")
COLUMNS = ("component", "correct", "accuracy", "blamed on policy", "policy blamed elsewhere", "undecided")
"""The columns of :func:`rows`: the two cross-blames that corrupt training are counted per component (a non-policy
fault blamed on the policy falls in its own component's row, a policy error blamed elsewhere in the policy row)."""
BFCL_ENTRIES = 6
"""BFCL ``base`` entries the drill injects faults into (one per class): the run stays a few seconds."""


async def bfcl_cases(rt: Any, limit: int | None = BFCL_ENTRIES, per_class: int | None = 1) -> tuple[list[Any], str]:
    """``(cases, "")`` of :func:`~treadle.weft.evolve.faults_bfcl.bfcl_suite` (one entry per class by default;
    ``limit=None, per_class=None``: every eligible ``base`` entry; attributed as the loop does), or ``([], why)``
    when BFCL is not installed here."""
    try:
        import bfcl_eval  # noqa: F401
    except ImportError as err:
        return [], f"bfcl-eval is not installed ({err}); pip install --no-deps bfcl-eval"
    from treadle.weft.evolve.faults_bfcl import bfcl_suite

    return await bfcl_suite(rt, limit=limit, per_class=per_class, as_loop=True), ""


async def attribution_drill(rt: Any, *, bfcl: bool = True, bfcl_all: bool = False) -> dict[str, Any]:
    """``{"held_apart": summary, "fresh": summary, "catalogue": summary, "bfcl": summary}`` (see
    :func:`~treadle.weft.evolve.faults_heldout.summary`); ``bfcl`` is ``{"skipped": why}`` when BFCL is not
    installed, and left out with ``bfcl=False``; ``bfcl_all``: over every eligible BFCL ``base`` entry instead of
    one per class (about a minute on two CPU cores; ``bench/bfcl_attribution_wide.py`` reports it)."""
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
    out = {"held_apart": summary(held), "fresh": summary(fresh), "catalogue": summary(catalogue)}
    cases = {"held_apart": held, "fresh": fresh, "catalogue": catalogue}
    if bfcl:
        found, why = await (bfcl_cases(rt, None, None) if bfcl_all else bfcl_cases(rt))
        out["bfcl"] = summary(found) if not why else {"skipped": why}
        cases["bfcl"] = found
    for key, s in out.items():
        if "skipped" not in s:
            s["by_component"] = by_component(cases[key])
    out["cases"] = {k: [c.model_dump(mode="json") for c in v] for k, v in cases.items()}
    return out


def by_component(cases: Any) -> dict[str, dict[str, int]]:
    """Per component (the label): observed, correct, blamed on the policy (non-policy labels), blamed elsewhere
    (policy label: on another component than the policy) and undecided, over the observed cases."""
    from treadle.weft.evolve.attribute import Blame

    out: dict[str, dict[str, int]] = {}
    for c in cases:
        if not c.observed:
            continue
        row = out.setdefault(c.label.value, {"n": 0, "correct": 0, "blamed_on_policy": 0, "blamed_elsewhere": 0,
                                             "undecided": 0})
        got = c.attribution.blame if c.attribution is not None else None
        row["n"] += 1
        row["correct"] += bool(c.correct)
        row["undecided"] += got == Blame.undecided
        if c.label != Blame.policy:
            row["blamed_on_policy"] += got in (None, Blame.policy)
        else:
            row["blamed_elsewhere"] += got not in (Blame.policy, Blame.undecided)
    return out


def rows(s: dict[str, Any]) -> list[list[str]]:
    """Table rows (:data:`COLUMNS`): one per component, then the total; one row saying why for a skipped set."""
    if "skipped" in s:
        return [["skipped", s["skipped"], "", "", "", ""]]
    out = []
    per = s.get("by_component") or {}
    for comp in COMPONENTS:
        v = s["per_component"].get(comp)
        if v:
            b = per.get(comp, {})
            out.append([comp, f"{v['correct']}/{v['n']}", f"{v['correct'] / v['n']:.0%}",
                        str(b.get("blamed_on_policy", 0)) if comp != "policy" else "-",
                        str(b.get("blamed_elsewhere", 0)) if comp == "policy" else "-", str(b.get("undecided", 0))])
    out.append(["all", f"{s['correct']}/{s['observed']}", f"{s['accuracy']:.1%}", str(len(s["blamed_on_policy"])),
                str(len(s["policy_blamed_elsewhere"])), str(len(s["undecided"]))])
    return out
