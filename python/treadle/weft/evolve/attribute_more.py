"""The attribution checks that hold off the reference's path, in the order :func:`attribute` applies them once
the reference plan has executed and passed as certified (seed: WEFT 5.1):

1. **policy** ``forbidden_action``: the policy called a tool the task forbids (before any rule that could call a
   forbidden read-only call a reproduction of the reference);
2. **harness** ``harness_format``: the harness the policy's calls went through cannot carry the reference
   calls, or its instructions teach another format than its parser reads (:func:`~.probes.harness_faults`);
   the cross-harness verdicts go into the detail;
3. **environment** ``off_path``: a call of the policy, replayed on the certified and on the current server from
   the same start, is treated otherwise (the certified server accepts what the current one rejects);
   ``contract``: a call of the reference or of the policy breaks its tool's contract (read-only claims,
   declared writes, units, assignments, directions, the keyed row: :func:`~.probes.contract_violations`);
   ``off_path_probe``: an input the schema allows near a reference call (:func:`~.probes.input_variants`)
   is treated otherwise by the current server than by the certified one;
4. **task** ``inconsistent_request`` (two actions that exclude each other, or a quantity restated with another
   value), ``other_party``, ``underivable_gold`` (:mod:`~.task_checks`: a gold value nothing a competent policy
   knows gives; one only world knowledge may give is **undecided**, ``underivable_undecided``, once the checks
   below find nothing);
5. **evaluator** ``free_text_strict``: the policy's state differs from the reference's only in free text, each
   a faithful paraphrase of the reference's (text the request quotes must match exactly); a text that says
   something else is the policy's (``free_text_differs``); one the offline comparison cannot place is
   **undecided** (``free_text_undecided``: an LLM judge decides it where one is configured).

Every check is executable and offline. :func:`audit_slot` runs the checks that need no failed checkpoint
(contracts of the reference calls; the verifier's negative controls) on a task whose checkpoint passed: a
born-broken server and a lenient verifier reward what they should not and never fail a checkpoint.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from treadle.weft.runtime.callparse import ToolCall


def _calls(outcomes: Sequence[Any]) -> list[ToolCall]:
    return [ToolCall(name=o.call.name, arguments=dict(o.call.arguments)) for o in outcomes]


async def _final(rt: Any, server_hash: str, start: Any, calls: Sequence[ToolCall]) -> Any:
    sid = await rt.create_session(server_hash, start)
    try:
        for c in calls:
            await rt.call_tool(sid, c.name, c.arguments)
        return rt.snapshot(sid)
    finally:
        await rt.close(sid)


async def further_checks(rt: Any, server_hash: str, start: Any, spec: Any, evidence: Any, outcomes: Sequence[Any],
                         *, request: str | None, harness: Any = None, forbidden: Sequence[str] = (),
                         history: Sequence[Any] = (), healthy: str | None = None,
                         harness_verdicts: dict[str, int] | None = None) -> tuple[str, str, str] | None:
    """``(blame, rule, detail)`` of the first check (module docstring) that decides, or None."""
    from treadle.weft.evolve import probes, task_checks, text_checks

    reg = rt.registry.spec(server_hash)
    tools = {t["name"]: t for t in reg.tools}
    gold = list(evidence.calls)
    policy_calls = _calls(outcomes)
    forb = set(spec.forbidden_tools) | set(forbidden)
    if request:
        forb |= set(text_checks.forbidden_by_request(request, tools))
    used = sorted({c.name for c in policy_calls if c.name in forb})
    if used:
        return "policy", "forbidden_action", f"the policy called {used}, which the task forbids"
    if harness is not None:
        bad = probes.harness_faults(harness, gold, reg.tools)
        if bad:
            hv = f"; verdicts per harness: {dict(sorted(harness_verdicts.items()))}" if harness_verdicts else ""
            return "harness", "harness_format", "; ".join(bad) + hv
    healthy = healthy or evidence.server_hash
    sqlite = start.kind == "sqlite"
    off = await probes.off_path_difference(rt, healthy, server_hash, start, policy_calls)
    if off:
        return "environment", "off_path", off
    if sqlite:
        broken = await probes.contract_probe(rt, server_hash, start, gold, tools)
        broken = broken or await probes.contract_probe(rt, server_hash, start, policy_calls, tools)
        if broken:
            return "environment", "contract", "; ".join(broken[:3])
    con = None
    pending: tuple[str, str, str] | None = None
    if sqlite:
        from treadle.weft.evolve.grounding import open_copy

        con = open_copy(start)
    try:
        probe = await probes.probe_off_path(rt, healthy, server_hash, start, gold, tools, con)
        if probe:
            return "environment", "off_path_probe", probe
        if request is None:
            return None
        clash = await task_checks.inconsistent_request(rt, healthy if healthy in rt.registry else server_hash,
                                                       start, request, gold, tools)
        clash = clash or task_checks.restated_quantities(request, gold)
        if clash:
            return "task", "inconsistent_request", clash
        if con is not None:
            from treadle.weft.runtime.sqlite_state import SqliteState

            st = SqliteState(start)
            try:
                diff = st.diff(evidence.final)
            finally:
                st.close()
            other = task_checks.other_party(con, request, diff)
            if other:
                return "task", "other_party", "the gold acts for another party than the request's: " + \
                    "; ".join(other)
        derived = task_checks.derive_values(request, gold, evidence.results, tools, history, policy=policy_calls)
        if derived.missing or derived.undecided:  # what the environment holds may give them (derivable.World)
            from treadle.weft.evolve.derivable import known_world

            world = await known_world(rt, healthy if healthy in rt.registry else server_hash, start, tools, con,
                                     request=request)
            derived = task_checks.derive_values(request, gold, evidence.results, tools, history, world=world,
                                                policy=policy_calls)
        if derived.missing:
            return "task", "underivable_gold", ("gold values the request, history, tool results, documentation "
                                                "and start state do not give: " + task_checks.describe(derived.missing))
        if derived.undecided:
            pending = ("undecided", "underivable_undecided", "gold values only world knowledge may give (an LLM "
                       "decides whether the request implies them): " + task_checks.describe(derived.undecided))
    finally:
        if con is not None:
            con.close()
    if sqlite and all(o.ok for o in outcomes):
        from treadle.weft.runtime.sqlite_state import SqliteState

        final = await _final(rt, server_hash, start, policy_calls)
        ref = SqliteState(evidence.final)
        try:
            pairs = text_checks.free_text_only_diff(ref.diff(final))
        finally:
            ref.close()
        if pairs:
            verdicts = [text_checks.text_verdict(a, b, request) for a, b in pairs]
            shown = "; ".join(f"{a!r} vs {b!r}: {v}" for (a, b), v in zip(pairs, verdicts))
            if all(v == "same" for v in verdicts):
                return "evaluator", "free_text_strict", ("the policy's state differs from the reference's only in "
                                                         "free text that says the same: " + shown)
            if "different" not in verdicts:
                return "undecided", "free_text_undecided", ("free text the offline comparison cannot place "
                                                            "(an LLM judge decides it): " + shown)
    return pending


async def audit_slot(rt: Any, server_hash: str, start: Any, spec: Any, evidence: Any, *, request: str = "",
                     forbidden: Sequence[str] = ()) -> tuple[str, str, str] | None:
    """``(blame, rule, detail)`` for a task whose checkpoint passed but whose server breaks a tool contract on the
    reference calls (``environment``, ``contract``: a born-broken server), or whose verifier passes a negative
    control (``evaluator``, ``negative_control``: a lenient verifier); None when both hold."""
    from treadle.weft.evolve import probes, text_checks

    tools = {t["name"]: t for t in rt.registry.spec(server_hash).tools}
    gold = list(evidence.calls)
    if start.kind == "sqlite":
        broken = await probes.contract_probe(rt, server_hash, start, gold, tools)
        if broken:
            return "environment", "contract", "; ".join(broken[:3])
    forb = set(forbidden) | set(text_checks.forbidden_by_request(request, tools)) if request else set(forbidden)
    passed = await text_checks.negative_controls(rt, server_hash, start, spec, gold, tools, sorted(forb))
    if passed:
        return "evaluator", "negative_control", "the verifier passes what it must fail: " + "; ".join(passed[:3])
    return None
