"""verify.py, value by value: merging per-server verdicts of one turn (issue 21: interface errors keep their
reason when a turn spans several servers) and the checks the mutation run found unguarded (issue 23)."""
import pytest

from treadle.weft.callparse import ToolCall
from treadle.weft.errors import ErrorKind
from treadle.weft.runtime import ToolOutcome
from treadle.weft.verify import CheckpointResult, FailureReason, merge_checkpoints

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
