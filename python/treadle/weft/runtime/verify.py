"""Checkpoint verification: ``r_k`` in {0, 1} per checkpoint, ``R(tau) = mean_k r_k``, typed reasons.

Seed: WEFT sections 3.1 / 4.1 (atomic tasks with executable checks; failure attribution keeps
environment and infrastructure failures apart from policy failures). A checkpoint is judged from

- *state evidence*: the session's state after the turn against the expected state (the gold calls
  replayed on a private copy of the turn's start state, compared by row/attribute diff), and/or
  assertions over the state (SQL queries with expected rows, or Python predicates);
- *tool-return evidence*: every gold call's result appears among the results the agent received,
  and/or explicit expected values are contained (JSON subset) in some result;
- *call evidence*: forbidden tools were not called; no call at all on a turn whose gold is empty.

Reasons form a closed set (:class:`FailureReason`); ``infrastructure`` and ``timeout`` mark
checkpoints that failed for reasons outside the policy (:attr:`CheckpointResult.policy_failure` is
False for them). Verifiers run inside the runtime next to the state
(:meth:`treadle.weft.runtime.Runtime.verify_turn`); specs and gold data are never passed to servers.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime.state import Snapshot, StateBackend, StateDiff, TableDiff


class FailureReason(str, Enum):
    """Why a checkpoint scored 0."""

    state_mismatch = "state_mismatch"
    response_mismatch = "response_mismatch"
    forbidden_call = "forbidden_call"
    interface_error = "interface_error"
    timeout = "timeout"
    infrastructure = "infrastructure"
    nondeterministic_environment = "nondeterministic_environment"


NON_POLICY = frozenset({FailureReason.timeout, FailureReason.infrastructure,
                        FailureReason.nondeterministic_environment})


class StateAssertion(BaseModel):
    """``sql`` (a read-only query on SQLite state) must return exactly ``expected`` rows (in order)."""

    sql: str
    expected: list[list[Any]]
    description: str = ""


class CheckpointSpec(BaseModel):
    """One verifiable condition (an atomic task's completion check).

    Attributes:
        name: identifier.
        gold_calls: calls that solve the turn; replayed on a private copy of the turn's start state to
            get the expected state and gold results. ``[]`` means the turn needs no call (any call is
            a ``forbidden_call``); None means no gold replay.
        compare_state: compare the agent's state with the gold state (default True with gold calls).
        ignore_tables: tables (or ``"attributes"``) left out of the state comparison.
        gold_results_contained: every gold call's result must be among the agent's results.
        assertions: SQL checks on the final state (SQLite state only).
        predicates: Python checks ``f(state_handle) -> bool`` (any backend).
        expected_returns: values that must each be contained (JSON subset) in some agent result.
        forbidden_tools: tools that must not be called (successfully or not).
        strict_interface: an ``invalid_args``/``unknown_tool`` call fails the checkpoint by itself.
        compare_private: include attributes/columns whose path has a ``_``-prefixed part in the state
            comparison (BFCL compares public attributes only: set False).
        calls_allowed_without_gold: with ``gold_calls == []``, calls are allowed (state and returns are
            still checked); for one server's share of a turn whose gold calls go to other servers.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    gold_calls: list[ToolCall] | None = None
    compare_state: bool = True
    ignore_tables: list[str] = Field(default_factory=list)
    gold_results_contained: bool = True
    assertions: list[StateAssertion] = Field(default_factory=list)
    predicates: list[Callable[[Any], bool]] = Field(default_factory=list)
    expected_returns: list[Any] = Field(default_factory=list)
    forbidden_tools: list[str] = Field(default_factory=list)
    strict_interface: bool = False
    compare_private: bool = True
    calls_allowed_without_gold: bool = False


class CheckpointResult(BaseModel):
    """Verdict of one checkpoint: ``r`` in {0, 1}, the reasons for a 0, and details per reason."""

    name: str
    r: int
    reasons: list[FailureReason] = Field(default_factory=list)
    details: list[str] = Field(default_factory=list)
    diff: StateDiff | None = None

    @property
    def policy_failure(self) -> bool:
        """True when the checkpoint failed and nothing outside the policy (timeout, infrastructure) explains it."""
        return self.r == 0 and not (set(self.reasons) & NON_POLICY)


def contains(actual: Any, expected: Any) -> bool:
    """JSON-subset containment: dict keys recursively, each expected list item in some actual item."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and contains(actual[k], v) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(actual, list) and all(any(contains(a, e) for a in actual) for e in expected)
    return actual == expected


def _public(key: str) -> bool:
    return not any(part.startswith("_") for part in key.split("."))


def filter_diff(diff: StateDiff, ignore: Sequence[str], compare_private: bool = True) -> StateDiff:
    """``diff`` without the ``ignore`` tables and, unless ``compare_private``, without private keys (``_x``)."""
    tables = {k: v for k, v in diff.tables.items() if k not in set(ignore)}
    if not compare_private:
        tables = {k: TableDiff(added={p: x for p, x in v.added.items() if _public(p)},
                               removed={p: x for p, x in v.removed.items() if _public(p)},
                               changed={p: x for p, x in v.changed.items() if _public(p)})
                  for k, v in tables.items()}
    return StateDiff(tables={k: v for k, v in tables.items() if not v.empty})


#: Outcome kinds that are the policy's misuse of the interface (a made-up tool, unparseable or invalid arguments).
INTERFACE_ERRORS = (ErrorKind.invalid_args, ErrorKind.unknown_tool)


def _interface_detail(outcomes: Sequence[Any]) -> str:
    """The ``interface_error`` detail for the interface errors among ``outcomes``; "" when there is none."""
    bad = [o for o in outcomes if o.error_kind in INTERFACE_ERRORS]
    if not bad:
        return ""
    return f"{len(bad)} call(s) with invalid arguments or unknown tools: {[o.call.name for o in bad]}"


def judge_checkpoint(spec: CheckpointSpec, state: StateBackend, outcomes: Sequence[Any],
                     expected_state: StateBackend | Snapshot | None = None,
                     gold_results: Sequence[Any] | None = None, gold_error: str = "",
                     gold_reproducible: bool = True) -> CheckpointResult:
    """Judge one checkpoint from the session's ``state`` and the turn's tool ``outcomes``.

    Args:
        spec: the checkpoint.
        state: the session's state after the turn (privileged access).
        outcomes: the turn's :class:`~treadle.weft.runtime.ToolOutcome` objects, in order.
        expected_state: gold state (from replaying ``spec.gold_calls``), or None.
        gold_results: results of the gold calls, or None.
        gold_error: non-empty when replaying the gold failed (an evaluator/task defect:
            ``infrastructure``, not a policy failure).
        gold_reproducible: False when two replays of the gold from the same start disagreed: a
            failed check is then also ``nondeterministic_environment`` (never a policy failure).

    Returns:
        A :class:`CheckpointResult`.
    """
    reasons: list[FailureReason] = []
    details: list[str] = []
    diff = None

    def fail(reason: FailureReason, detail: str) -> None:
        if reason not in reasons:
            reasons.append(reason)
        details.append(f"{reason.value}: {detail}")

    if gold_error:
        fail(FailureReason.infrastructure, f"gold replay failed: {gold_error}")
    for o in outcomes:
        if o.error_kind in (ErrorKind.crash, ErrorKind.infrastructure):
            fail(FailureReason.infrastructure, f"{o.call.name}: {o.error_kind.value}: {o.text[:200]}")
        elif o.error_kind == ErrorKind.timeout:
            fail(FailureReason.timeout, f"{o.call.name}: {o.text[:200]}")
    if spec.gold_calls == [] and outcomes and not spec.calls_allowed_without_gold:
        fail(FailureReason.forbidden_call, f"turn needs no call, got {[o.call.name for o in outcomes]}")
    for o in outcomes:
        if o.call.name in spec.forbidden_tools:
            fail(FailureReason.forbidden_call, f"called forbidden tool {o.call.name}")
    if expected_state is not None and spec.compare_state:
        diff = filter_diff(state.diff(expected_state), spec.ignore_tables, spec.compare_private)
        if not diff.empty:
            fail(FailureReason.state_mismatch, f"state differs from gold: {diff.counts()}")
    for a in spec.assertions:
        con = state.handle
        if not isinstance(con, sqlite3.Connection):
            fail(FailureReason.infrastructure, f"SQL assertion on non-SQLite state: {a.sql}")
            continue
        try:
            rows = [list(r) for r in con.execute(a.sql).fetchall()]
        except sqlite3.Error as err:
            fail(FailureReason.infrastructure, f"assertion query failed: {err}: {a.sql}")
            continue
        if rows != a.expected:
            fail(FailureReason.state_mismatch, f"{a.description or a.sql}: got {rows}, expected {a.expected}")
    for p in spec.predicates:
        try:
            ok = bool(p(state.handle))
        except Exception as err:  # noqa: BLE001  (a broken verifier is not the policy's fault)
            fail(FailureReason.infrastructure, f"predicate {getattr(p, '__name__', p)} raised {err!r}")
            continue
        if not ok:
            fail(FailureReason.state_mismatch, f"predicate {getattr(p, '__name__', p)} is false")
    results = [o.result for o in outcomes if o.ok]
    if spec.gold_results_contained and gold_results:
        for g in gold_results:
            if not any(r == g for r in results):
                fail(FailureReason.response_mismatch, f"gold result {str(g)[:200]} not among the agent's results")
    for e in spec.expected_returns:
        if not any(contains(r, e) for r in results):
            fail(FailureReason.response_mismatch, f"expected return {str(e)[:200]} not contained in any result")
    detail = _interface_detail(outcomes)
    if detail and (spec.strict_interface or reasons):
        fail(FailureReason.interface_error, detail)
    if reasons and not gold_reproducible:
        fail(FailureReason.nondeterministic_environment,
             "two replays of the gold calls from the same start state disagree (a tool reads the process clock "
             "or a global random source): the check cannot tell the policy's mistakes from the environment's noise")
    return CheckpointResult(name=spec.name, r=0 if reasons else 1, reasons=reasons, details=details, diff=diff)


def trajectory_reward(results: Sequence[CheckpointResult]) -> float:
    """``R(tau) = mean_k r_k``; 0.0 for no checkpoints.

    Raises:
        TypeError: an element is not a CheckpointResult.
    """
    for i, r in enumerate(results):
        if not isinstance(r, CheckpointResult):
            raise TypeError(f"results[{i}] must be a CheckpointResult, got {type(r).__name__}")
    return sum(r.r for r in results) / len(results) if results else 0.0


def merge_checkpoints(name: str, parts: Sequence[CheckpointResult], outcomes: Sequence[Any], *,
                      strict_interface: bool = False) -> CheckpointResult:
    """One verdict for a turn whose calls went to several servers: ``parts`` holds one verdict per server
    session (each judged by :func:`judge_checkpoint` on that server's state and calls), ``outcomes`` every
    tool outcome of the turn, whichever session recorded it.

    ``r`` is the minimum of the parts' (1 with no part); reasons are the union in order of first
    appearance, details concatenated. ``interface_error`` is decided on the whole turn with
    :func:`judge_checkpoint`'s rule: when the merged verdict fails (or ``strict_interface``), every
    interface error of the turn (a made-up tool, an unparseable call, invalid arguments) is a reason, even
    when the session that recorded it passed its own part and another server's part failed. The parts'
    own ``interface_error`` reasons and details are replaced by the one for the whole turn.

    Raises:
        TypeError: a part is not a CheckpointResult.
    """
    for i, p in enumerate(parts):
        if not isinstance(p, CheckpointResult):
            raise TypeError(f"parts[{i}] must be a CheckpointResult, got {type(p).__name__}")
    prefix = f"{FailureReason.interface_error.value}:"
    reasons: list[FailureReason] = []
    for p in parts:
        reasons += [r for r in p.reasons if r not in reasons and r != FailureReason.interface_error]
    details = [d for p in parts for d in p.details if not d.startswith(prefix)]
    detail = _interface_detail(outcomes)
    if detail and (strict_interface or reasons):
        reasons.append(FailureReason.interface_error)
        details.append(f"{prefix} {detail}")
    r = min((p.r for p in parts), default=1)
    if strict_interface and detail:
        r = 0
    return CheckpointResult(name=name, r=r, reasons=reasons, details=details)
