"""Unit tests of every verification predicate: true and false cases, partial matches."""
import types

import pytest

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime.object_state import ObjectState, snapshot_from_object
from treadle.weft.runtime import ToolOutcome
from treadle.weft.runtime.sqlite_state import SqliteState, snapshot_from_sql
from treadle.weft.runtime.state import RowChange, StateDiff, TableDiff
from treadle.weft.runtime.verify import (
    CheckpointResult,
    CheckpointSpec,
    FailureReason,
    StateAssertion,
    filter_diff,
    _public,
    contains,
    judge_checkpoint,
    trajectory_reward,
)

DDL = "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT);"


@pytest.mark.parametrize("actual, expected, ok", [
    ({"a": 1, "b": 2}, {"a": 1}, True),                      # dict subset
    ({"a": 1}, {"a": 1, "b": 2}, False),                     # missing key
    ({"a": 1}, {"a": 2}, False),                             # wrong value
    ({"a": {"x": 1, "y": 2}}, {"a": {"x": 1}}, True),        # nested subset
    ({"a": {"x": 1}}, {"a": {"x": 1, "y": 2}}, False),       # nested partial
    ([1, 2, 3], [1, 3], True),                               # every expected item present
    ([1, 2, 3], [1, 4], False),                              # ANY is not enough: ALL items needed
    ([1, 2, 3], [4], False),
    ([{"id": 1, "v": "a"}, {"id": 2}], [{"id": 2}], True),   # item containment inside lists
    ([{"id": 1}], [{"id": 1}, {"id": 2}], False),            # partial list match
    ([], [], True),
    ({"a": [1, 2]}, {"a": []}, True),
    ({"a": 1}, [1], False),                                  # type mismatch
    ([1], {"a": 1}, False),
    ("x", "x", True),
    ("x", "y", False),
    (1, 1.0, True),
    (None, None, True),
    (None, 0, False),
])
def test_contains(actual, expected, ok):
    assert contains(actual, expected) is ok


@pytest.mark.parametrize("key, ok", [("a", True), ("a.b", True), ("_a", False), ("a._b", False), ("a_.b", True)])
def test_public(key, ok):
    assert _public(key) is ok


def test_filtered_drops_ignored_tables_and_private_paths():
    d = StateDiff(tables={
        "attributes": TableDiff(added={"x": 1, "_y": 2}, changed={"a._p": RowChange(before=1, after=2)}),
        "log": TableDiff(removed={"[1]": {}}),
    })
    assert filter_diff(d, ["log"]).touched() == {"attributes"}
    pub = filter_diff(d, [], compare_private=False)
    assert pub.tables["attributes"].added == {"x": 1} and not pub.tables["attributes"].changed
    assert pub.touched() == {"attributes", "log"}
    only_private = StateDiff(tables={"attributes": TableDiff(added={"_y": 2})})
    assert filter_diff(only_private, [], compare_private=False).empty
    assert not filter_diff(only_private, []).empty


def out(name, result=None, kind=None, text=""):
    return ToolOutcome(session_id="s", seq=1, call=ToolCall(name=name), ok=kind is None, result=result,
                       error_kind=kind, text=text)


@pytest.fixture
def sql_state():
    s = SqliteState(snapshot_from_sql(DDL, "INSERT INTO t VALUES (1, 'a');"))
    yield s
    s.close()


def test_judge_state_comparison(sql_state):
    spec = CheckpointSpec(name="c")
    same = snapshot_from_sql(DDL, "INSERT INTO t VALUES (1, 'a');")
    other = snapshot_from_sql(DDL, "INSERT INTO t VALUES (1, 'b');")
    assert judge_checkpoint(spec, sql_state, [], expected_state=same).r == 1
    res = judge_checkpoint(spec, sql_state, [], expected_state=other)
    assert res.r == 0 and res.reasons == [FailureReason.state_mismatch] and res.policy_failure
    assert res.diff.counts() == {"t": {"added": 0, "changed": 1, "removed": 0}}
    assert judge_checkpoint(spec.model_copy(update={"compare_state": False}), sql_state, [],
                            expected_state=other).r == 1
    assert judge_checkpoint(spec.model_copy(update={"ignore_tables": ["t"]}), sql_state, [],
                            expected_state=other).r == 1


def test_judge_sql_assertions(sql_state):
    ok = StateAssertion(sql="SELECT id, v FROM t", expected=[[1, "a"]])
    partial = StateAssertion(sql="SELECT id, v FROM t", expected=[[1, "a"], [2, "b"]])
    wrong_order = StateAssertion(sql="SELECT v FROM t", expected=[["b"]])
    broken = StateAssertion(sql="SELECT nope FROM t", expected=[])
    assert judge_checkpoint(CheckpointSpec(name="c", assertions=[ok]), sql_state, []).r == 1
    for a in (partial, wrong_order):
        res = judge_checkpoint(CheckpointSpec(name="c", assertions=[a]), sql_state, [])
        assert res.r == 0 and res.reasons == [FailureReason.state_mismatch]
    res = judge_checkpoint(CheckpointSpec(name="c", assertions=[broken]), sql_state, [])
    assert res.reasons == [FailureReason.infrastructure] and not res.policy_failure
    obj = ObjectState(snapshot_from_object(types.SimpleNamespace(x=1)), types.SimpleNamespace)
    res = judge_checkpoint(CheckpointSpec(name="c", assertions=[ok]), obj, [])
    assert res.reasons == [FailureReason.infrastructure]


def test_judge_predicates(sql_state):
    def has_a(con):
        return con.execute("SELECT count(*) FROM t WHERE v = 'a'").fetchone()[0] == 1

    def has_b(con):
        return con.execute("SELECT count(*) FROM t WHERE v = 'b'").fetchone()[0] == 1

    def raises(con):
        raise RuntimeError("verifier bug")

    assert judge_checkpoint(CheckpointSpec(name="c", predicates=[has_a]), sql_state, []).r == 1
    res = judge_checkpoint(CheckpointSpec(name="c", predicates=[has_a, has_b]), sql_state, [])
    assert res.r == 0 and res.reasons == [FailureReason.state_mismatch] and "has_b" in res.details[0]
    res = judge_checkpoint(CheckpointSpec(name="c", predicates=[raises]), sql_state, [])
    assert res.reasons == [FailureReason.infrastructure] and not res.policy_failure


def test_judge_gold_results_and_expected_returns(sql_state):
    spec = CheckpointSpec(name="c")
    outs = [out("f", {"id": 1, "v": "a"}), out("g", [1, 2, 3])]
    assert judge_checkpoint(spec, sql_state, outs, gold_results=[{"id": 1, "v": "a"}, [1, 2, 3]]).r == 1
    # gold results must each be returned exactly; one missing fails even if the other matches
    res = judge_checkpoint(spec, sql_state, outs, gold_results=[{"id": 1, "v": "a"}, [1, 2]])
    assert res.reasons == [FailureReason.response_mismatch]
    assert judge_checkpoint(spec.model_copy(update={"gold_results_contained": False}), sql_state, outs,
                            gold_results=[[9]]).r == 1
    # failed outcomes' results never count
    res = judge_checkpoint(spec, sql_state, [out("f", None, ErrorKind.execution_error)], gold_results=[None])
    assert res.r == 0
    er = spec.model_copy(update={"expected_returns": [{"id": 1}, [3]]})
    assert judge_checkpoint(er, sql_state, outs).r == 1
    er_partial = spec.model_copy(update={"expected_returns": [{"id": 1}, [4]]})  # one of two expected missing
    assert judge_checkpoint(er_partial, sql_state, outs).reasons == [FailureReason.response_mismatch]


def test_judge_call_evidence(sql_state):
    none_needed = CheckpointSpec(name="c", gold_calls=[])
    assert judge_checkpoint(none_needed, sql_state, []).r == 1
    res = judge_checkpoint(none_needed, sql_state, [out("f", 1)])
    assert res.reasons == [FailureReason.forbidden_call]
    allowed = none_needed.model_copy(update={"calls_allowed_without_gold": True})
    assert judge_checkpoint(allowed, sql_state, [out("f", 1)]).r == 1
    forb = CheckpointSpec(name="c", forbidden_tools=["drop"])
    assert judge_checkpoint(forb, sql_state, [out("f", 1)]).r == 1
    assert judge_checkpoint(forb, sql_state, [out("drop", None, ErrorKind.execution_error)]).reasons == [
        FailureReason.forbidden_call]  # a forbidden call counts even when it failed


def test_judge_interface_errors_and_attribution(sql_state):
    bad = out("nope", None, ErrorKind.unknown_tool)
    lax = CheckpointSpec(name="c")
    assert judge_checkpoint(lax, sql_state, [bad, out("f", 1)]).r == 1  # a recovered slip is not penalised alone
    strict = lax.model_copy(update={"strict_interface": True})
    assert judge_checkpoint(strict, sql_state, [bad]).reasons == [FailureReason.interface_error]
    res = judge_checkpoint(lax.model_copy(update={"expected_returns": [5]}), sql_state, [bad])
    assert res.reasons == [FailureReason.response_mismatch, FailureReason.interface_error]
    for kind, reason in ((ErrorKind.crash, FailureReason.infrastructure),
                         (ErrorKind.infrastructure, FailureReason.infrastructure),
                         (ErrorKind.timeout, FailureReason.timeout)):
        res = judge_checkpoint(lax, sql_state, [out("f", None, kind)])
        assert res.reasons == [reason] and not res.policy_failure
    res = judge_checkpoint(lax, sql_state, [], gold_error="f(): execution_error: boom")
    assert res.reasons == [FailureReason.infrastructure] and not res.policy_failure
    other = snapshot_from_sql(DDL)
    res = judge_checkpoint(lax, sql_state, [], expected_state=other, gold_reproducible=False)
    assert res.reasons == [FailureReason.state_mismatch, FailureReason.nondeterministic_environment]
    assert not res.policy_failure
    assert judge_checkpoint(lax, sql_state, [], gold_reproducible=False).r == 1


def test_trajectory_reward():
    r = [CheckpointResult(name=str(i), r=v) for i, v in enumerate([1, 0, 1, 1])]
    assert trajectory_reward(r) == 0.75 and trajectory_reward([]) == 0.0
    assert trajectory_reward(r[1:2]) == 0.0
    with pytest.raises(TypeError, match="CheckpointResult"):
        trajectory_reward([1])
