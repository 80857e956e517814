"""The fault-injection suite over BFCL v4 multi-turn classes (needs ``bfcl-eval``; see :mod:`treadle.weft.envs.bfcl`).

Atomic tasks: the first turn of BFCL ``base`` entries that involve one class, whose gold is not on
the mechanical audit's exclusion list and executes. Faults:

- **environment**: a generic bug wrapped around the method of the task's last gold call, appended to
  the class's server source (``crash``: raises; ``not_persisted``: its state changes are undone;
  ``wrong_return``: its result is altered);
- **evaluator** and **policy**: as for the native environments (:mod:`~treadle.weft.evolve.faults`).

Task defects are not injected here: object state has no entity map, so "a referenced entity missing
from the initial state" cannot be told from an environment failure by the deterministic path (it
would need the LLM attributor); the native suite measures that kind.
"""
from __future__ import annotations

from typing import Any

from treadle.weft.callparse import parse_call
from treadle.weft.evolve.attribute import Blame, generate_verifier, record_evidence
from treadle.weft.evolve.faults import POLICY_PERTURBATIONS, CaseResult, corrupt_verifier, perturbed_calls, run_case
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.verify import CheckpointSpec

GENERIC_BUGS = ("crash", "not_persisted", "wrong_return")

_BUG_CODE = '''

# --- injected by treadle.weft.evolve.faults_bfcl: an environment bug ---
def _weft_injected_bug(cls, name, kind):
    import copy as _copy
    orig = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        if kind == "crash":
            raise RuntimeError("backend down")
        if kind == "not_persisted":
            saved = _copy.deepcopy(self.__dict__)
            out = orig(self, *args, **kwargs)
            self.__dict__.clear()
            self.__dict__.update(saved)
            return out
        out = orig(self, *args, **kwargs)
        if isinstance(out, dict) and out:
            return dict(out, **{sorted(out)[0]: "wrong"})
        return "wrong"

    setattr(cls, name, wrapped)


_weft_injected_bug(@CLS@, @METHOD@, @KIND@)
'''


def bug_source(source: str, class_name: str, method: str, kind: str) -> str:
    """``source`` (a BFCL class's server module) with ``kind`` injected into ``class_name.method``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in GENERIC_BUGS:
        raise ValueError(f"unknown bug kind {kind!r}; expected one of {GENERIC_BUGS}")
    return source + _BUG_CODE.replace("@CLS@", class_name).replace("@METHOD@", repr(method)).replace("@KIND@", repr(kind))


def bfcl_tasks(rt: Any, limit: int = 6, per_class: int = 2) -> list[tuple[str, dict[str, Any], AtomicTask]]:
    """``(class name, initial config, atomic task)`` for the first turn of single-class ``base`` entries, at most
    ``per_class`` per class and ``limit`` in all (audited-bad entries skipped). Classes are registered in ``rt``
    (their tools give positional arguments their names)."""
    from treadle.weft.envs import bfcl

    entries, gold = bfcl.load_entries("base")
    bad = bfcl.KNOWN_BAD_GOLD
    out: list[tuple[str, dict[str, Any], AtomicTask]] = []
    seen: dict[str, int] = {}
    for e in entries:
        if len(out) >= limit:
            break
        (cls, *more) = e["involved_classes"]
        if more or e["id"] in bad or not gold[e["id"]] or not gold[e["id"]][0] or seen.get(cls, 0) >= per_class:
            continue
        order = {t["name"]: list(t["input_schema"].get("properties", {}))
                 for t in rt.registry.spec(bfcl.register_class(rt, cls)).tools}
        calls = [parse_call(c, param_order=order) for c in gold[e["id"]][0]]
        spec = CheckpointSpec(name=f"{e['id']}/turn0", gold_calls=calls, compare_private=False)
        question = e["question"][0]
        request = " ".join(m.get("content", "") for m in question if isinstance(m, dict)) or e["id"]
        out.append((cls, e.get("initial_config", {}).get(cls, {}),
                    AtomicTask(name=spec.name, request=request, checkpoint=spec)))
        seen[cls] = seen.get(cls, 0) + 1
    return out


async def bfcl_suite(rt: Any, *, limit: int = 6, per_class: int = 2, seeds: tuple[int, ...] = (0,)) -> list[CaseResult]:
    """Environment, evaluator and policy faults over :func:`bfcl_tasks` (a task whose reference does not execute
    on the healthy class is skipped: it would not be certified)."""
    from treadle.weft.envs import bfcl

    cases: list[CaseResult] = []
    for cls, config, task in bfcl_tasks(rt, limit, per_class):
        h = bfcl.register_class(rt, cls)
        start = bfcl.initial_snapshot(rt, h, cls, config)
        gold = list(task.checkpoint.gold_calls or [])
        try:
            ev = await record_evidence(rt, h, start, task.name, gold)
        except ValueError:
            continue
        spec = generate_verifier(task.checkpoint, start, ev)
        env = f"bfcl:{cls}"
        common = {"env": env, "task": task, "start": start, "evidence": ev}
        src = bfcl.server_source(cls)
        for kind in GENERIC_BUGS:
            bh = rt.register(bug_source(src, cls, gold[-1].name, kind))
            cases.append(await run_case(rt, case_id=f"{env}/{task.name}/env:{kind}", label=Blame.environment,
                                        fault=f"{gold[-1].name}:{kind}", server_hash=bh, spec=spec, calls=gold,
                                        **common))
        for how in ("wrong_expected_return", "wrong_gold_argument"):
            bad = corrupt_verifier(spec, how)
            if bad is not None:
                cases.append(await run_case(rt, case_id=f"{env}/{task.name}/evaluator:{how}", label=Blame.evaluator,
                                            fault=how, server_hash=h, spec=bad, calls=gold, **common))
        for p in POLICY_PERTURBATIONS:
            for seed in seeds:
                cases.append(await run_case(rt, case_id=f"{env}/{task.name}/policy:{p}:{seed}", label=Blame.policy,
                                            fault=p, server_hash=h, spec=spec, calls=perturbed_calls(task, p, seed),
                                            **common))
    return cases
