"""The mechanical audit of BFCL gold answers: each kind of defect it must catch, the
honest derivations it must accept, and the committed exclusion table equals a fresh audit."""
import importlib.metadata

import pytest

pytest.importorskip("bfcl_eval")

from treadle.data.bfcl import load_bfcl_multi_turn  # noqa: E402
from treadle.weft.envs import bfcl, bfcl_audit  # noqa: E402


def _entry(category, number):
    return next(e for e in load_bfcl_multi_turn(category) if e["id"] == f"multi_turn_{category}_{number}")


@pytest.mark.parametrize("category,number,needle", [
    # the gold posts a sorted text that `sort` never returns (the file is one line)
    ("base", 4, "turn 2: gold post_tweet(content=...): text 'Initial report content More unsorted data Unsorted data'"),
    # the user dictates "...I'll update you soon" and the gold adds a full stop the user never typed
    ("base", 184, "turn 3: gold send_message(message=...): text \"Hi Sam, my travel plans have changed. I'll"),
    # "forward it exactly": the gold inserts a space the file does not have
    ("long_context", 41, 'turn 0: gold send_message(message=...): text "Meeting notes and project details. The company'),
    # the gold passes a str where the function doc declares an integer
    ("base", 173, "turn 3: gold close_ticket(...) violates the function doc's schema: 'ticket_001' is not of type"),
    # the gold calls a tool the entry withholds until a later turn
    ("miss_func", 49, "turn 1: gold calls tail, which the entry withholds until turn 3"),
])
def test_audit_catches_each_kind(category, number, needle):
    problems = bfcl_audit.audit_entry(_entry(category, number))
    assert any(p.startswith(needle) for p in problems), problems


@pytest.mark.parametrize("category,number", [
    ("base", 0),            # names and paths the user said
    ("base", 62),           # 'The distance ... is xxx km.': a template the user quoted, filled with a tool's number
    ("miss_param", 62),     # the same template, quoted a turn before the gold uses it
    ("base", 66),           # fuel: "40 gallons in total" minus the level the car shows
    ("base", 117),          # "10 times the price of OMEG rounded to nearest thousands" -> 5000
    ("miss_func", 180),     # 20,000 RMB in USD: the exchange tool (EXTRA_READS) returns 2857.14
    ("base", 156),          # free text whose value changes neither state nor output (contact_customer_support)
])
def test_audit_accepts_honest_derivations(category, number):
    assert bfcl_audit.audit_entry(_entry(category, number)) == []


def test_audit_leaves_the_entry_alone():
    e = _entry("base", 4)
    before = repr(e)
    bfcl_audit.audit_entry(e)
    assert repr(e) == before


def test_known_bad_gold_is_the_audited_table():
    assert bfcl.KNOWN_BAD_GOLD == bfcl_audit.AUDITED
    for key in ("multi_turn_base_4", "multi_turn_miss_func_4", "multi_turn_miss_param_4", "multi_turn_long_context_4"):
        assert key in bfcl.KNOWN_BAD_GOLD  # "the same entry in the other categories"
    assert all(isinstance(v, str) and v.startswith("turn ") for v in bfcl.KNOWN_BAD_GOLD.values())


def test_another_bfcl_eval_is_audited_live(monkeypatch):
    """An upgraded bfcl-eval is never scored against the stale table: its entries are audited on first use."""
    monkeypatch.setattr(bfcl_audit, "AUDITED_BFCL_EVAL", "0.0")
    monkeypatch.setattr(bfcl_audit, "audit_all", lambda: {"multi_turn_base_1": "turn 0: stub"})
    bfcl_audit._excluded.cache_clear()
    try:
        with pytest.warns(UserWarning, match="is not the audited 0.0"):
            assert bfcl.KNOWN_BAD_GOLD == {"multi_turn_base_1": "turn 0: stub"}
    finally:
        bfcl_audit._excluded.cache_clear()
    monkeypatch.undo()
    assert bfcl.KNOWN_BAD_GOLD == bfcl_audit.AUDITED


@pytest.mark.slow
def test_committed_table_equals_a_fresh_audit():
    if importlib.metadata.version("bfcl-eval") != bfcl_audit.AUDITED_BFCL_EVAL:
        pytest.skip("another bfcl-eval than the audited one: excluded() audits it live")
    assert bfcl_audit.audit_all() == bfcl_audit.AUDITED
