"""The fault-injection suite over BFCL v4 multi-turn classes (needs ``bfcl-eval``; see :mod:`treadle.weft.envs.bfcl`).

Atomic tasks: the first turn of BFCL ``base`` entries that involve one class, whose gold is not on
the mechanical audit's exclusion list and executes. Faults:

- **environment**: a generic bug wrapped around the method of the task's last gold call, appended to
  the class's server source (``crash``: raises; ``not_persisted``: its state changes are undone;
  ``wrong_return``: its result is altered);
- **task**: an entity the reference plan names is missing from the initial state
  (:func:`delete_referenced`: the first key, anywhere in the instantiated class's public state, equal
  to a string argument of the gold calls: a file or folder, a stock symbol, a door). Object state has
  no entity map, so the deterministic path tells it from an environment bug by replaying the reference
  from the defective start on the certified server (rule ``precondition_state`` of
  :func:`~treadle.weft.evolve.attribute.attribute`);
- **evaluator** and **policy**: as for the native environments (:mod:`~treadle.weft.evolve.faults`).
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.evolve.attribute import Blame, generate_verifier, record_evidence
from treadle.weft.evolve.faults import POLICY_PERTURBATIONS, CaseResult, corrupt_verifier, perturbed_calls, run_case
from treadle.weft.rollouts.tasks import AtomicTask
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointSpec

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


def _string_args(gold: Sequence[ToolCall]) -> list[str]:
    out: list[str] = []
    for c in gold:
        for v in c.arguments.values():
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, str) and len(x) > 1 and x not in out:
                    out.append(x)
    return out


def _delete_key(root: Any, key: str, module: str) -> str | None:
    """Delete the first dict entry named ``key`` (depth first through dicts, lists and the public attributes of
    objects of the server ``module``'s classes); its path, or None."""
    seen: set[int] = set()

    def walk(x: Any, path: str, depth: int) -> str | None:
        if depth > 16 or id(x) in seen:
            return None
        seen.add(id(x))
        if isinstance(x, dict):
            if key in x:
                del x[key]
                return f"{path}[{key!r}]"
            items = list(x.items())
        elif isinstance(x, (list, tuple)):
            items = [(f"{i}", v) for i, v in enumerate(x)]
        elif getattr(type(x), "__module__", None) == module and hasattr(x, "__dict__"):
            items = [(f".{k}", v) for k, v in vars(x).items() if not k.startswith("_")]
            for k, v in items:
                hit = walk(v, path + k, depth + 1)
                if hit:
                    return hit
            return None
        else:
            return None
        for k, v in items:
            hit = walk(v, f"{path}[{k!r}]" if isinstance(x, dict) else f"{path}[{k}]", depth + 1)
            if hit:
                return hit
        return None

    return walk(root, type(root).__name__, 0)


def delete_referenced(rt: Any, server_hash: str, config: dict[str, Any], gold: Sequence[ToolCall]
                      ) -> tuple[Snapshot, str] | None:
    """A task defect: the class's initial state (``_load_scenario(config)``) without the first entry a string
    argument of ``gold`` names (a dict key equal to it), and what was deleted; None when no argument names one."""
    from treadle.weft.runtime.object_state import snapshot_from_object
    from treadle.weft.runtime.registry import release_module

    module, weft = rt.registry.load(server_hash)
    try:
        obj = weft.state_class()
        load = getattr(obj, "_load_scenario", None)
        if load is not None:
            load(copy.deepcopy(config), long_context=False)
        for value in _string_args(gold):
            where = _delete_key(obj, value, type(obj).__module__)
            if where is not None:
                return snapshot_from_object(obj), f"deleted {where}"
        return None
    finally:
        release_module(module)


def bfcl_tasks(rt: Any, limit: int | None = 6, per_class: int | None = 2
               ) -> list[tuple[str, dict[str, Any], AtomicTask]]:
    """``(class name, initial config, atomic task)`` for the first turn of single-class ``base`` entries, at most
    ``per_class`` per class and ``limit`` in all (None: no bound; both None: every eligible entry), audited-bad
    entries skipped. Classes are registered in ``rt`` (their tools give positional arguments their names).

    Raises:
        ValueError: a bound below 1.
    """
    from treadle.weft.envs import bfcl

    for name, bound in (("limit", limit), ("per_class", per_class)):
        if bound is not None and bound < 1:
            raise ValueError(f"{name} must be >= 1 or None (no bound), got {bound}")
    entries, gold = bfcl.load_entries("base")
    limit = limit if limit is not None else len(entries)
    per_class = per_class if per_class is not None else len(entries)
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


async def bfcl_suite(rt: Any, *, limit: int | None = 6, per_class: int | None = 2, seeds: tuple[int, ...] = (0,),
                     as_loop: bool = False) -> list[CaseResult]:
    """Environment, task, evaluator and policy faults over :func:`bfcl_tasks` (``limit=None, per_class=None``: every
    eligible entry; a task whose reference does not execute on the healthy class is skipped: it would not be
    certified); ``as_loop``: attributed with the task's request and harness, as the evolution loop does
    (:func:`~treadle.weft.evolve.faults.run_case`)."""
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
        common = {"env": env, "task": task, "start": start, "evidence": ev, "as_loop": as_loop}
        src = bfcl.server_source(cls)
        for kind in GENERIC_BUGS:
            bh = rt.register(bug_source(src, cls, gold[-1].name, kind))
            cases.append(await run_case(rt, case_id=f"{env}/{task.name}/env:{kind}", label=Blame.environment,
                                        fault=f"{gold[-1].name}:{kind}", server_hash=bh, spec=spec, calls=gold,
                                        **common))
        defect = delete_referenced(rt, h, config, gold)
        if defect is not None:
            snap, what = defect
            cases.append(await run_case(rt, case_id=f"{env}/{task.name}/task:missing", label=Blame.task, fault=what,
                                        server_hash=h, spec=spec, calls=gold, **{**common, "start": snap}))
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
