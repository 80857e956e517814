"""verify.py, value by value: merging per-server verdicts of one turn and the checks the mutation run found unguarded."""
import pytest

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.errors import ErrorKind
from treadle.weft.runtime import ToolOutcome
from treadle.weft.runtime.verify import CheckpointResult, FailureReason, merge_checkpoints

F = FailureReason


def _out(name, kind=None, sid="a"):
    return ToolOutcome(session_id=sid, seq=0, call=ToolCall(name=name, arguments={}), ok=kind is None,
                       result=None if kind else {"ok": 1}, text="", error_kind=kind)


def _part(name, r=1, reasons=(), details=()):
    return CheckpointResult(name=name, r=r, reasons=list(reasons), details=list(details))


def test_merge_keeps_the_interface_error_recorded_by_a_session_that_passed():
    """The made-up tool was recorded by server A (its part passed); server B's part failed: the turn's
    verdict names both reasons, and the interface detail lists the call."""
    outcomes = [_out("made_up", ErrorKind.unknown_tool, "a"), _out("mkdir", None, "b")]
    parts = [_part("t/A"), _part("t/B", 0, [F.state_mismatch], ["state_mismatch: state differs from gold: x"])]
    m = merge_checkpoints("t", parts, outcomes)
    assert m.name == "t" and m.r == 0
    assert m.reasons == [F.state_mismatch, F.interface_error]
    assert m.details == ["state_mismatch: state differs from gold: x",
                         "interface_error: 1 call(s) with invalid arguments or unknown tools: ['made_up']"]
    assert m.policy_failure


def test_merge_counts_interface_errors_of_every_session_once():
    """Each part reported its own interface error: the merged verdict has one reason and one detail
    covering the whole turn, in call order."""
    outcomes = [_out("x", ErrorKind.invalid_args, "a"), _out("ok", None, "a"), _out("y", ErrorKind.unknown_tool, "b")]
    parts = [_part("t/A", 0, [F.forbidden_call, F.interface_error],
                   ["forbidden_call: f", "interface_error: 1 call(s) with invalid arguments or unknown tools: ['x']"]),
             _part("t/B", 0, [F.response_mismatch, F.interface_error],
                   ["response_mismatch: g", "interface_error: 1 call(s) with invalid arguments or unknown tools: ['y']"])]
    m = merge_checkpoints("t", parts, outcomes)
    assert m.reasons == [F.forbidden_call, F.response_mismatch, F.interface_error]
    assert m.details == ["forbidden_call: f", "response_mismatch: g",
                         "interface_error: 2 call(s) with invalid arguments or unknown tools: ['x', 'y']"]


def test_merge_of_passing_parts_passes_despite_interface_errors_unless_strict():
    outcomes = [_out("made_up", ErrorKind.unknown_tool)]
    m = merge_checkpoints("t", [_part("t/A"), _part("t/B")], outcomes)
    assert (m.r, m.reasons, m.details) == (1, [], [])
    m = merge_checkpoints("t", [_part("t/A"), _part("t/B")], outcomes, strict_interface=True)
    assert m.r == 0 and m.reasons == [F.interface_error] and m.policy_failure
    m = merge_checkpoints("t", [_part("t/A"), _part("t/B")], [_out("fine")], strict_interface=True)
    assert (m.r, m.reasons) == (1, [])


def test_merge_keeps_non_policy_reasons_and_order():
    parts = [_part("t/A", 0, [F.timeout], ["timeout: slow"]),
             _part("t/B", 0, [F.state_mismatch, F.timeout], ["state_mismatch: s", "timeout: slow2"])]
    m = merge_checkpoints("t", parts, [_out("slow", ErrorKind.timeout)])
    assert m.reasons == [F.timeout, F.state_mismatch] and not m.policy_failure
    assert m.details == ["timeout: slow", "state_mismatch: s", "timeout: slow2"]


def test_merge_of_no_part_passes_and_bad_parts_are_refused():
    assert merge_checkpoints("t", [], []).r == 1
    with pytest.raises(TypeError, match=r"parts\[1\] must be a CheckpointResult, got dict"):
        merge_checkpoints("t", [_part("a"), {"r": 1}], [])


# -- judge_checkpoint's details, word for word (what a reader of a failed verdict sees) ---------------------------

from treadle.weft.runtime.sqlite_state import SqliteState, snapshot_from_sql  # noqa: E402
from treadle.weft.runtime.verify import (CheckpointSpec, StateAssertion, filter_diff, contains,  # noqa: E402
                                 judge_checkpoint, trajectory_reward)

DDL = "CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT);"


@pytest.fixture
def db():
    s = SqliteState(snapshot_from_sql(DDL, "INSERT INTO t VALUES (1, 'a');"))
    yield s
    s.close()


def _o(name, result=None, kind=None, text=""):
    return ToolOutcome(session_id="s", seq=1, call=ToolCall(name=name), ok=kind is None, result=result,
                       error_kind=kind, text=text)


def test_judge_details_of_every_failure_path(db):
    long = "y" * 300
    outs = [_o("c", None, ErrorKind.crash, "c" * 300), _o("i", None, ErrorKind.infrastructure, "inf"),
            _o("t", None, ErrorKind.timeout, long), _o("drop", 7), _o("e", None, ErrorKind.execution_error, "e")]
    spec = CheckpointSpec(name="k", gold_calls=[], forbidden_tools=["drop", "e"], expected_returns=["z" * 300])
    res = judge_checkpoint(spec, db, outs, gold_error="g(): boom", gold_results=["w" * 300])
    assert res.name == "k" and res.r == 0 and res.diff is None
    assert res.reasons == [FailureReason.infrastructure, FailureReason.timeout, FailureReason.forbidden_call,
                           FailureReason.response_mismatch]
    assert res.details == [
        "infrastructure: gold replay failed: g(): boom",
        "infrastructure: c: crash: " + "c" * 200,
        "infrastructure: i: infrastructure: inf",
        "timeout: t: " + "y" * 200,
        "forbidden_call: turn needs no call, got ['c', 'i', 't', 'drop', 'e']",
        "forbidden_call: called forbidden tool drop",
        "forbidden_call: called forbidden tool e",
        "response_mismatch: gold result " + "w" * 200 + " not among the agent's results",
        "response_mismatch: expected return " + "z" * 200 + " not contained in any result",
    ]


def test_judge_details_of_state_assertions_and_predicates(db):
    other = snapshot_from_sql(DDL, "INSERT INTO t VALUES (1, 'b');")

    def false_pred(con):
        return 0

    def broken(con):
        raise KeyError("k")

    spec = CheckpointSpec(name="k", assertions=[
        StateAssertion(sql="SELECT v FROM t", expected=[["b"]], description="v is b"),
        StateAssertion(sql="SELECT id FROM t", expected=[]),
        StateAssertion(sql="SELECT nope FROM t", expected=[]),
        StateAssertion(sql="SELECT v FROM t", expected=[["a"]])], predicates=[false_pred, broken, lambda con: 1])
    res = judge_checkpoint(spec, db, [], expected_state=other)
    assert res.reasons == [FailureReason.state_mismatch, FailureReason.infrastructure]
    assert res.details == [
        "state_mismatch: state differs from gold: {'t': {'added': 0, 'changed': 1, 'removed': 0}}",
        "state_mismatch: v is b: got [['a']], expected [['b']]",
        "state_mismatch: SELECT id FROM t: got [[1]], expected []",
        "infrastructure: assertion query failed: no such column: nope: SELECT nope FROM t",
        "state_mismatch: predicate false_pred is false",
        "infrastructure: predicate broken raised KeyError('k')",
    ]
    assert res.diff.counts() == {"t": {"added": 0, "removed": 0, "changed": 1}}


def test_judge_needs_every_gold_result_and_uses_only_successful_results(db):
    spec = CheckpointSpec(name="k")
    outs = [_o("f", {"a": 1}), _o("g", None, ErrorKind.execution_error), _o("h", [1])]
    assert judge_checkpoint(spec, db, outs, gold_results=[[1], {"a": 1}]).r == 1
    assert judge_checkpoint(spec, db, outs, gold_results=[]).r == 1
    res = judge_checkpoint(spec, db, outs, gold_results=[{"a": 1}, {"a": 2}, [1]])
    assert res.details == ["response_mismatch: gold result {'a': 2} not among the agent's results"]
    res = judge_checkpoint(spec, db, outs, gold_results=[{"a": 1, "b": 2}])  # exact, not containment
    assert res.r == 0
    # expected returns: containment in ANY successful result; each expected value needed
    spec = CheckpointSpec(name="k", expected_returns=[{"a": 1}, [1]])
    assert judge_checkpoint(spec, db, outs).r == 1
    assert judge_checkpoint(spec, db, outs[:2]).details == [
        "response_mismatch: expected return [1] not contained in any result"]


def test_judge_interface_error_detail_and_strictness(db):
    bad = [_o("x", None, ErrorKind.invalid_args), _o("y", None, ErrorKind.unknown_tool),
           _o("z", None, ErrorKind.execution_error)]
    res = judge_checkpoint(CheckpointSpec(name="k", strict_interface=True), db, bad)
    assert res.r == 0 and res.reasons == [FailureReason.interface_error] and res.policy_failure
    assert res.details == ["interface_error: 2 call(s) with invalid arguments or unknown tools: ['x', 'y']"]
    assert judge_checkpoint(CheckpointSpec(name="k", strict_interface=True), db, bad[2:]).r == 1
    assert judge_checkpoint(CheckpointSpec(name="k"), db, bad).r == 1
    res = judge_checkpoint(CheckpointSpec(name="k", forbidden_tools=["z"]), db, bad)
    assert res.reasons == [FailureReason.forbidden_call, FailureReason.interface_error]


def test_judge_nondeterministic_gold_details(db):
    res = judge_checkpoint(CheckpointSpec(name="k", expected_returns=[1]), db, [], gold_reproducible=False)
    assert res.reasons == [FailureReason.response_mismatch, FailureReason.nondeterministic_environment]
    assert res.details[-1].startswith("nondeterministic_environment: two replays of the gold calls from the same "
                                      "start state disagree")
    assert not res.policy_failure


def test_judge_state_comparison_respects_ignore_and_private(db):
    from treadle.weft.runtime.object_state import ObjectState, snapshot_from_object

    class Box:
        def __init__(self, x, _p):
            self.x, self._p = x, _p

    a = ObjectState(snapshot_from_object(Box(1, 1)), Box)
    other_private = snapshot_from_object(Box(1, 2))
    other_public = snapshot_from_object(Box(2, 1))
    try:
        assert judge_checkpoint(CheckpointSpec(name="k"), a, [], expected_state=other_private).r == 0
        assert judge_checkpoint(CheckpointSpec(name="k", compare_private=False), a, [],
                                expected_state=other_private).r == 1
        res = judge_checkpoint(CheckpointSpec(name="k", compare_private=False), a, [], expected_state=other_public)
        assert res.r == 0 and res.reasons == [FailureReason.state_mismatch]
        assert judge_checkpoint(CheckpointSpec(name="k", ignore_tables=["attributes"]), a, [],
                                expected_state=other_public).r == 1
        assert judge_checkpoint(CheckpointSpec(name="k", compare_state=False), a, [],
                                expected_state=other_public).r == 1
    finally:
        a.close()


def test_filtered_keeps_public_paths_of_every_kind():
    from treadle.weft.runtime.state import RowChange, StateDiff, TableDiff

    d = StateDiff(tables={"attributes": TableDiff(
        added={"a": 1, "_a": 1}, removed={"b.c": 2, "b._c": 2},
        changed={"x.y": RowChange(before=1, after=2), "_x.y": RowChange(before=1, after=2)}),
        "gone": TableDiff(added={"_only": 1}), "t": TableDiff(added={"[1]": {}})})
    pub = filter_diff(d, ["t"], compare_private=False)
    assert pub.tables == {"attributes": TableDiff(added={"a": 1}, removed={"b.c": 2},
                                                  changed={"x.y": RowChange(before=1, after=2)})}
    assert filter_diff(d, ["t"]).tables == {k: v for k, v in d.tables.items() if k != "t"}
    assert filter_diff(d, ("t", "gone", "attributes")).tables == {}


def test_judge_detail_names_of_callables_without_a_name_and_sql_on_object_state():
    import functools

    from treadle.weft.runtime.object_state import ObjectState, snapshot_from_object

    class Box:
        pass

    box = Box()
    box.v = 1
    s = ObjectState(snapshot_from_object(box), Box)
    try:
        def check(obj, want):
            if want is None:
                raise ValueError("no want")
            return obj.v == want

        bad, wrong = functools.partial(check, want=None), functools.partial(check, want=2)
        res = judge_checkpoint(CheckpointSpec(name="k", predicates=[bad, wrong, functools.partial(check, want=1)],
                                              assertions=[StateAssertion(sql="SELECT 1", expected=[[1]])]), s, [])
        assert res.reasons == [FailureReason.infrastructure, FailureReason.state_mismatch]
        assert res.details == ["infrastructure: SQL assertion on non-SQLite state: SELECT 1",
                               f"infrastructure: predicate {bad!r} raised ValueError('no want')",
                               f"state_mismatch: predicate {wrong!r} is false"]
    finally:
        s.close()


def test_contains_and_trajectory_reward_values():
    assert contains({"a": [{"b": 1, "c": 2}]}, {"a": [{"b": 1}]})
    assert not contains({"a": [{"b": 2}]}, {"a": [{"b": 1}]})
    assert not contains({}, {"a": None})  # a missing key is not a None value
    r = [CheckpointResult(name="a", r=1), CheckpointResult(name="b", r=0), CheckpointResult(name="c", r=0)]
    assert trajectory_reward(r) == pytest.approx(1 / 3) and trajectory_reward(r[:1]) == 1.0
    with pytest.raises(TypeError, match=r"results\[1\] must be a CheckpointResult, got int"):
        trajectory_reward([r[0], 1])


def test_every_assertion_is_judged_after_a_broken_one(db):
    from treadle.weft.runtime.object_state import ObjectState, snapshot_from_object

    spec = CheckpointSpec(name="k", assertions=[StateAssertion(sql="SELECT nope FROM t", expected=[]),
                                                StateAssertion(sql="SELECT v FROM t", expected=[["b"]])])
    assert judge_checkpoint(spec, db, []).details == [
        "infrastructure: assertion query failed: no such column: nope: SELECT nope FROM t",
        "state_mismatch: SELECT v FROM t: got [['a']], expected [['b']]"]

    class Box:
        pass

    s = ObjectState(snapshot_from_object(Box()), Box)
    try:
        assert judge_checkpoint(spec, s, []).details == [
            "infrastructure: SQL assertion on non-SQLite state: SELECT nope FROM t",
            "infrastructure: SQL assertion on non-SQLite state: SELECT v FROM t"]
    finally:
        s.close()


def test_nondeterministic_environment_detail_word_for_word(db):
    res = judge_checkpoint(CheckpointSpec(name="k", expected_returns=[1]), db, [], gold_reproducible=False)
    assert res.details[-1] == (
        "nondeterministic_environment: two replays of the gold calls from the same start state disagree (a tool "
        "reads the process clock or a global random source): the check cannot tell the policy's mistakes from the "
        "environment's noise")
