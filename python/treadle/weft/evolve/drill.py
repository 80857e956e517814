"""An offline drill for the evolution loop: the certified shop and CRM with one injected fault of each kind.

Offline there is no faulty system to repair, so the drill makes one from the fault catalog of
:mod:`~treadle.weft.evolve.faults`: the shop's ``get_order`` crashes (environment), the customer of
``shop-cancel-order`` is missing from its initial state (task), and the verifier of ``crm-vip``
expects a wrong value (evaluator); the replay policy adds its own perturbations (policy).
"""
from __future__ import annotations

import inspect
from typing import Any

from treadle.weft.evolve.attribute import generate_verifier, record_evidence
from treadle.weft.evolve.certify import certify_server
from treadle.weft.evolve.faults import SHOP_BUGS, corrupt_verifier, delete_entity, patch_source
from treadle.weft.evolve.loop import EvolvingSystem, TaskSlot

ENV_BUG = "get_order_crashes"
TASK_DEFECT = "shop-cancel-order"
EVALUATOR_DEFECT = "crm-vip"


async def drill_system(rt: Any) -> EvolvingSystem:
    """The certified native environments with the three injected faults (see the module docstring)."""
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic

    sources, slots = {}, []
    for mod, cands in ((shop, shop_atomic.candidates()), (crm, crm_tasks.candidates())):
        env = mod.server.name
        h = rt.register(mod)
        start = mod.initial_snapshot()
        rep = await certify_server(rt, h, start, cands)
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
    return EvolvingSystem(sources=sources, certified=certified, tasks=slots)
