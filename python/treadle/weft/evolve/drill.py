"""An offline drill for the evolution loop: the certified shop and CRM with one injected fault of each kind.

Offline there is no faulty system to repair, so the drill makes one from the fault catalog of
:mod:`~treadle.weft.evolve.faults`: the shop's ``get_order`` crashes (environment), the customer of
``shop-cancel-order`` is missing from its initial state (task), and the verifier of ``crm-vip``
expects a wrong value (evaluator); the replay policy adds its own perturbations (policy). Two composed
cross-server tasks over both (the composition of :func:`composed_drill`) carry a composed fault each: a
credit whose reason names the original customer's contact (a wrong binding in free text: execution alone
accepts it) and a DAG cycle (a prerequisite made to depend on the credit).
"""
from __future__ import annotations

import inspect
from typing import Any

from treadle.weft.evolve.attribute import generate_verifier, record_evidence
from treadle.weft.evolve.certify import certify_server
from treadle.weft.evolve.faults import SHOP_BUGS, corrupt_verifier, delete_entity, patch_source
from treadle.weft.evolve.loop import ComposedSlot, EvolvingSystem, TaskSlot

ENV_BUG = "get_order_crashes"
TASK_DEFECT = "shop-cancel-order"
EVALUATOR_DEFECT = "crm-vip"
COMPOSED_FAULTS = (("unbound_text", "crm:crm-credit"), ("cycle", "crm:crm-credit"))
"""The composed drill's faults: (kind of :data:`~treadle.weft.evolve.composed_revise.COMPOSED_FAULTS`, node)."""
PERSONA = ("Mary Jackson", "mary@example.com")
LOOKALIKE = ("Mary Jackman", "mary.jackman@example.com")


async def composed_drill(rt: Any, bundles: list, hashes: dict[str, str]) -> list[ComposedSlot]:
    """One composed slot per :data:`COMPOSED_FAULTS` entry, named ``ada-<kind>``: Ada's shop and CRM tasks bound
    to a new customer, certified, then the fault injected (the certified task is kept as the slot's reference)."""
    from treadle.weft.evolve.compose import certify_composed, compose, propose_groups
    from treadle.weft.evolve.composed_revise import inject, server_tools

    group = propose_groups(bundles)["ada@example.com"]
    ct = await certify_composed(rt, compose(bundles, group, name="ada", persona=PERSONA, lookalike=LOOKALIKE), hashes)
    tools = server_tools(rt, hashes)
    slots = []
    for how, node in COMPOSED_FAULTS:
        name = f"ada-{how.replace('_', '-')}"
        bad = inject(ct, tools, how, node)[0].model_copy(update={"name": name})
        slots.append(ComposedSlot(task=bad, certified=ct.model_copy(update={"name": name})))
    return slots


async def drill_system(rt: Any) -> EvolvingSystem:
    """The certified native environments with the three injected faults, and the composed slots of
    :func:`composed_drill` (see the module docstring)."""
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
    from treadle.weft.evolve.compose import ServerBundle

    sources, slots, bundles, hashes = {}, [], [], {}
    for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
        env = mod.server.name
        h = hashes[env] = rt.register(mod)
        start = mod.initial_snapshot()
        rep = await certify_server(rt, h, start, cands)
        bundles.append(ServerBundle(name=env, server_hash=h, snapshot=start, tools=rt.registry.spec(h).tools,
                                    kept=list(rep.kept)))
        sources[env] = inspect.getsource(mod)
        tools = {t["name"]: t for t in rt.registry.spec(h).tools}
        for task in rep.kept:
            gold = list(task.checkpoint.gold_calls or [])
            ev = await record_evidence(rt, h, start, task.name, gold)
            spec = generate_verifier(task.checkpoint, start, ev)
            slot_start = start
            if task.name == TASK_DEFECT:
                slot_start = delete_entity(start, env, tools, gold)[0]
            if task.name == EVALUATOR_DEFECT:
                spec = corrupt_verifier(spec, "wrong_expected_return")
            slots.append(TaskSlot(env=env, task=task, start=slot_start, spec=spec, evidence=ev, certified_start=start))
    certified = dict(sources)
    bug = next(b for b in SHOP_BUGS if b.name == ENV_BUG)
    sources["shop"] = patch_source(sources["shop"], bug)
    return EvolvingSystem(sources=sources, certified=certified, tasks=slots,
                          composed=await composed_drill(rt, bundles, hashes))
