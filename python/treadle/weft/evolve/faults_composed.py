"""Fault-injection cases over a certified composed cross-server task, in the suite's terms (:mod:`.faults`).

For every node of the composed task and every kind of :data:`~treadle.weft.evolve.composed_revise.COMPOSED_FAULTS`
that :func:`~treadle.weft.evolve.composed_revise.inject` can make there, one **task** case (a wrong binding in an
entity-mapped or a free-text argument, a dropped edge, a cycle) played by a correct agent (the certified task's
calls); and per node one **policy** case on the healthy task (the agent skips that node's calls). A case is
*observed* when the run fails or the structural checks (bindings, edges) find the fault; it is attributed by
:func:`~treadle.weft.evolve.composed_revise.attribute_composed` (its first verdict; every verdict of a case is
kept in ``fault`` text when they differ) and counted in the same confusion matrix as the atomic cases.
"""
from __future__ import annotations

from typing import Any

from treadle.weft.evolve.attribute import Attribution, Blame
from treadle.weft.evolve.faults import CaseResult

__all__ = ["composed_suite"]


def _case(task: Any, case_id: str, label: Blame, fault: str, verdicts: list | None) -> CaseResult:
    env = "+".join(sorted(task.snapshots))
    if verdicts is None:
        return CaseResult(id=case_id, env=env, task=task.name, label=label, fault=fault, observed=False)
    blames = {v.attribution.blame for v in verdicts}
    att = verdicts[0].attribution
    if len(blames) > 1:  # the verdicts disagree: the case is not attributed to one component
        att = Attribution(checkpoint=att.checkpoint, blame=Blame.undecided, rule="composed_disagree",
                          detail="; ".join(f"{v.attribution.checkpoint}: {v.attribution.blame.value}"
                                           for v in verdicts))
    return CaseResult(id=case_id, env=env, task=task.name, label=label, fault=fault, observed=True, attribution=att)


async def composed_suite(rt: Any, certified: Any, hashes: dict[str, str]) -> list[CaseResult]:
    """The composed cases over ``certified`` (a certified :class:`~treadle.weft.evolve.compose.ComposedTask`) on the
    registered servers ``hashes`` (``{server: hash}``); see the module docstring.

    Raises:
        ValueError: ``certified`` does not re-certify here (its reference plan fails, or a structural check).
    """
    from treadle.weft.evolve import composed_revise as cr
    from treadle.weft.evolve.compose import run_composed
    from treadle.weft.rollouts.tasks import DependencyCycleError

    h = {s: hashes[s] for s in certified.snapshots}
    cert = await cr.recertify_composed(rt, certified, h)
    if not cert.certified:
        raise ValueError(f"composed task {certified.name!r} does not certify: {list(cert.reasons)[:3]}")
    tools = cr.server_tools(rt, h)
    correct = cr.plan_policy(certified)
    cases: list[CaseResult] = []
    for how in cr.COMPOSED_FAULTS:
        for node in certified.nodes:
            inj = cr.inject(certified, tools, how, node.name)
            if inj is None:
                continue
            bad, what = inj
            try:
                res = await run_composed(rt, bad, h, correct)
            except DependencyCycleError:
                res = None
            unseen = res is not None and res.reward == 1.0 and not (cr.edge_faults(bad, certified)
                                                                     or cr.binding_faults(bad, tools))
            verdicts = None if unseen else await cr.attribute_composed(rt, bad, certified, h, res)
            cases.append(_case(certified, f"composed/{certified.name}/task:{how}:{node.name}", Blame.task,
                               f"{how}: {what}", verdicts))
    for node in certified.nodes:
        def skip(n, history, _name=node.name):
            return [] if n.name == _name else correct(n, history)

        res = await run_composed(rt, certified, h, skip)
        verdicts = None if res.reward == 1.0 else await cr.attribute_composed(rt, certified, certified, h, res)
        cases.append(_case(certified, f"composed/{certified.name}/policy:skipped_node:{node.name}", Blame.policy,
                           f"skipped_node: {node.name}", verdicts))
    return cases
