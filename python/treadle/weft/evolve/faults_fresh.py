"""A second held-apart fault set (``fresh``): faults of the kinds WEFT attribution must tell apart, made with other
concrete mechanisms than the catalogue (:mod:`.faults`) and the first held-apart set, and written before the
attribution rules were read, so that its first score measures how the rules carry to faults they were not
written for.

Every case is one slot of the evolution loop over the native shop or CRM (a certified task, its reference
evidence, its generated verifier, its initial state, the server it runs on and the harness its calls go
through) with exactly one injected fault of a known component:

- **environment**: the current server's source is patched after certification: a bug off the reference's path
  (an input the schema allows and a correct agent sends, e.g. an empty catalogue query or a multi-word search,
  that the certified server handled), behaviour that contradicts the tool's description (units of a return,
  direction of a change, a read that writes), or *born broken* (the bug was already there at certification, so
  the evidence and the verifier carry it and the correct agent passes);
- **task**: the task itself is wrong: a gold value the request does not give and no tool result can supply (an
  enum, an id, an item), a request with two incompatible values, a gold contradicting a value the request
  quotes, or an initial state in which the certified plan cannot run (an entity in the wrong status, no stock,
  a change already made);
- **evaluator**: the verifier is over-strict (it forbids a tool the reference needs, compares free text byte
  for byte where the request does not quote it, requires a lookup's return the request makes needless, expects
  a number as text) or lenient (it passes a wrong agent: a row count, ignored tables, a lookup's return only,
  an unchecked extra write);
- **harness**: the primary harness's parser or prompt is wrong (keys renamed, only one call of several kept,
  arguments strings ignored, a prompt naming a key or label its own parser does not read, a multi-line input
  cut to its first line, calls dropped beside text); the correct agent writes what the harness asks;
- **policy**: a healthy system and a wrong agent (a wrong quantity, tool, entity or unit, a forbidden write or
  search, a duplicated create that shifts ids as if the environment were non-deterministic, an unparseable
  call under a consistent harness, an input the healthy server also rejects, an unrequested extra write).

Each case is run the way the loop runs a slot: a failed checkpoint goes to
:func:`~treadle.weft.evolve.loop.attribute_failure` with the harness and the cross-harness verdicts (the same
agent under every harness of :func:`~treadle.weft.evolve.loop.default_harnesses`, the primary one replaced by
the case's), a passing one to :func:`~treadle.weft.evolve.loop.audit_passing`. A passing case that the audit
does not flag is *observed*, with no attribution, and counted as blamed on the policy when its kind never fails
a checkpoint (:data:`SILENT_KINDS`: the trajectory's reward stands), and unobserved otherwise (the fault does not
show in this trajectory). A born-broken server whose task certification rejects by its expected effect is caught
there: an environment verdict. Each case also has a **control** (the same agent on the fault-free system: it
passes for a correct agent, it fails for a wrong one); a case whose control does not behave so is reported
unobserved, as a defect of the case, never scored.
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.weft.evolve.attribute import Attribution, Blame, generate_verifier, record_evidence
from treadle.weft.evolve.faults import CaseResult, EnvBug, patch_source
from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.runtime.verify import StateAssertion

__all__ = ["FRESH", "SILENT_KINDS", "FreshCase", "fresh_suite"]

SILENT_KINDS = frozenset({"born_broken", "lenient"})
"""Kinds whose fault fails no checkpoint by nature (a born-broken server agrees with its own evidence; a lenient
verifier passes the wrong agent): a passing case of them that the audit does not flag is a missed fault."""


@dataclass(frozen=True)
class FreshCase:
    """One fault: ``task`` names a candidate of the environment's task module or is ``(name, request, gold
    call strings, checkpoint keyword arguments)`` for a task of its own; ``calls`` are the agent's (call strings;
    None: the gold); ``control_calls`` what the same agent sends on the fault-free system when it differs
    (an agent that stops after an error the fault caused); ``bug`` patches the current server (``born``: the
    server it was certified on too); ``start_sql`` changes the initial state; ``verifier`` changes the generated
    verifier; ``harness`` builds the primary harness (None: Hermes); ``raw`` renders the agent's steps under a
    harness itself (a policy's format mistake); ``control`` False where the fault-free system is not at hand (the
    fault is the verifier the loop generates by default)."""

    id: str
    label: Blame
    kind: str
    env: str
    task: str | tuple
    calls: tuple[str, ...] | None = None
    control_calls: tuple[str, ...] | None = None
    bug: EnvBug | None = None
    born: bool = False
    start_sql: tuple[str, ...] = ()
    verifier: Callable[[Any], Any] | None = None
    harness: Callable[[], Any] | None = None
    raw: Callable[[Any, list[ToolCall]], list[Any]] | None = None
    control: bool = True


# ---- broken harnesses (parsers and prompts); the correct agent writes what each one asks -------------------------

def _camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(p.title() for p in rest)


def _hermes_camelcase():
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.records import ParsedCall, ParsedStep

    class CamelHermes(HermesHarness):
        def parse_text(self, out):
            step = super().parse_text(out)
            calls = tuple(ParsedCall(id=c.id, name=c.name, arguments={_camel(k): v for k, v in c.arguments.items()})
                          for c in step.calls)
            return ParsedStep(calls=calls, failures=step.failures, reply=step.reply)
    return CamelHermes()


def _hermes_last_block():
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.records import ParsedStep

    class LastBlockHermes(HermesHarness):
        def parse_text(self, out):
            step = super().parse_text(out)
            return ParsedStep(calls=step.calls[-1:], failures=step.failures, reply=step.reply)
    return LastBlockHermes()


def _hermes_prompt_args_key():
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.records import PolicyOutput

    class ArgsKeyHermes(HermesHarness):
        def instructions(self, tools):
            return ("To call a tool, write <tool_call>{\"name\": <tool>, \"args\": <object>}</tool_call>; "
                    "several blocks call several tools. Without a tool call, your text is the reply to the user.")

        def render(self, calls, text=""):  # what an agent following these instructions writes
            blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "args": c.arguments}) + "\n</tool_call>"
                               for c in calls)
            return PolicyOutput(text=(text + "\n" + blocks).strip() if blocks else text)
    return ArgsKeyHermes()


def _react_first_action():
    from treadle.weft.rollouts.harnesses import ReActHarness
    from treadle.weft.rollouts.records import ParsedStep

    class FirstActionReAct(ReActHarness):
        def parse_text(self, out):
            step = super().parse_text(out)
            return ParsedStep(calls=step.calls[:1], failures=step.failures, reply=step.reply)
    return FirstActionReAct()


def _react_prompt_tool_label():
    from treadle.weft.rollouts.harnesses import ReActHarness
    from treadle.weft.rollouts.records import PolicyOutput

    class ToolLabelReAct(ReActHarness):
        def instructions(self, tools):
            return ("Answer in this format: 'Thought: <reasoning>' then either 'Tool: <tool name>' and "
                    "'Tool Input: <JSON object>' (the result comes back as 'Observation: ...'), or "
                    "'Final Answer: <reply to the user>'.")

        def render(self, calls, text=""):
            if not calls:
                return PolicyOutput(text=f"Thought: done.\nFinal Answer: {text}")
            acts = "\n".join(f"Tool: {c.name}\nTool Input: {json.dumps(c.arguments)}" for c in calls)
            return PolicyOutput(text=f"Thought: I will call {', '.join(c.name for c in calls)}.\n{acts}")
    return ToolLabelReAct()


def _react_first_input_line():
    import re

    from treadle.weft.rollouts.harnesses import ReActHarness
    from treadle.weft.rollouts.records import ParsedCall, ParsedStep, ParseFailure, PolicyOutput

    class FirstLineReAct(ReActHarness):
        def render(self, calls, text=""):  # pretty-printed inputs, which the harness's format allows
            if not calls:
                return PolicyOutput(text=f"Thought: done.\nFinal Answer: {text}")
            acts = "\n".join(f"Action: {c.name}\nAction Input: {json.dumps(c.arguments, indent=2)}" for c in calls)
            return PolicyOutput(text=f"Thought: I will call {', '.join(c.name for c in calls)}.\n{acts}")

        def parse_text(self, out):
            calls, fails = [], []
            lines = out.text.split("\n")
            for i, ln in enumerate(lines):
                if ln.lstrip().lower().startswith("action:") and i + 1 < len(lines):
                    name = ln.split(":", 1)[1].strip()
                    raw = lines[i + 1].split(":", 1)[1] if ":" in lines[i + 1] else ""
                    try:
                        if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
                            raise ValueError(f"{name!r} is not a tool name")
                        args = json.loads(raw) if raw.strip() else {}
                        if not isinstance(args, dict):
                            raise ValueError("Action Input is not a JSON object")
                        calls.append(ParsedCall(id=f"call_{i}", name=name, arguments=args))
                    except (ValueError, TypeError) as err:
                        fails.append(ParseFailure(raw=ln[:500], message=str(err)))
            return ParsedStep(calls=tuple(calls), failures=tuple(fails), reply="")
    return FirstLineReAct()


def _native_string_args_ignored():
    from treadle.weft.rollouts.harnesses import NativeHarness
    from treadle.weft.rollouts.records import ParsedCall, ParsedStep

    class DictOnlyNative(NativeHarness):
        def parse(self, out):
            calls = tuple(ParsedCall(id=tc.id, name=tc.name,
                                     arguments=tc.arguments if isinstance(tc.arguments, dict) else {})
                          for tc in out.tool_calls)
            return ParsedStep(calls=calls, failures=(), reply=out.text.strip())
    return DictOnlyNative()


def _native_drops_calls_with_text():
    from treadle.weft.rollouts.harnesses import NativeHarness
    from treadle.weft.rollouts.records import ParsedStep

    class TextWinsNative(NativeHarness):
        def render(self, calls, text=""):  # a short preamble beside the calls, as chat models write
            return super().render(calls, text or ("On it." if calls else ""))

        def parse(self, out):
            if out.text.strip():
                return ParsedStep(calls=(), failures=(), reply=out.text.strip())
            return super().parse(out)
    return TextWinsNative()


def _hermes_single_quotes(harness: Any, calls: list[ToolCall]) -> list[Any]:
    """A policy that writes its last call as a Python dict (single quotes) inside the Hermes tags."""
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.rollouts.records import PolicyOutput

    if not isinstance(harness, HermesHarness) or not calls:
        return [harness.render(calls), harness.render([], "Done.")]
    good = harness.render(calls[:-1]).text if calls[:-1] else ""
    bad = "<tool_call>\n" + repr({"name": calls[-1].name, "arguments": calls[-1].arguments}) + "\n</tool_call>"
    return [PolicyOutput(text=(good + "\n" + bad).strip()), harness.render([], "Done.")]


# ---- environment bugs -----------------------------------------------------------------------------------------------

_LIST_CASES_HEAD = "    _contact(db, contact_id)\n    return [{\"id\": i, \"order_ref\""
_EMPTY_QUERY_CRASH = EnvBug(
    name="empty_query_crashes", tool="search_products", old='    q = f"%{query.strip().lower()}%"\n',
    new='    q = f"%{query.strip().lower()}%"\n    if not query.strip():\n        raise KeyError("query")\n')
_MULTIWORD_REJECTED = EnvBug(
    name="multiword_query_rejected", tool="search_products", old='    q = f"%{query.strip().lower()}%"\n',
    new='    if " " in query.strip():\n        raise ToolError(f"invalid query {query!r}")\n'
        '    q = f"%{query.strip().lower()}%"\n')
_NO_CASES_CRASH = EnvBug(
    name="no_cases_crashes", tool="list_cases", old=_LIST_CASES_HEAD,
    new="    _contact(db, contact_id)\n"
        "    db.execute(\"SELECT id FROM cases WHERE contact_id = ?\", (contact_id,)).fetchall()[0]\n"
        "    return [{\"id\": i, \"order_ref\"")
_CREDIT_RETURN_DOLLARS = EnvBug(
    name="credit_return_in_dollars", tool="issue_credit",
    old='return {"credit_id": cur.lastrowid, "amount_cents": amount_cents}',
    new='return {"credit_id": cur.lastrowid, "amount_cents": amount_cents / 100}')
_TIER_INVERTED = EnvBug(
    name="tier_inverted", tool="set_tier",
    old='db.execute("UPDATE contacts SET tier = ? WHERE id = ?", (tier, contact_id))',
    new='db.execute("UPDATE contacts SET tier = ? WHERE id = ?", ("standard" if tier == "vip" else "vip", contact_id))')
_LIST_CASES_WRITES = EnvBug(
    name="list_cases_marks_pending", tool="list_cases",
    old=_LIST_CASES_HEAD,
    new="    _contact(db, contact_id)\n"
        "    db.execute(\"UPDATE cases SET status = 'pending' WHERE contact_id = ? AND status = 'new'\",\n"
        "               (contact_id,))\n"
        "    return [{\"id\": i, \"order_ref\"")
_TICKET_BORN_CLOSED = EnvBug(
    name="ticket_born_closed", tool="open_ticket",
    old="VALUES (?, ?, ?, 'open')\",\n                     (customer_id, order_id, subject))",
    new="VALUES (?, ?, ?, 'closed')\",\n                     (customer_id, order_id, subject))")
_NOTE_TRUNCATED = EnvBug(
    name="note_truncated", tool="add_note",
    old='db.execute("INSERT INTO notes (case_id, body) VALUES (?, ?)", (case_id, body))',
    new='db.execute("INSERT INTO notes (case_id, body) VALUES (?, ?)", (case_id, body[:10]))')
_ESCALATE_NOOP = EnvBug(
    name="escalate_writes_normal", tool="escalate_case", old="UPDATE cases SET priority = 'high' WHERE id = ?",
    new="UPDATE cases SET priority = 'normal' WHERE id = ?")
_ORDER_KEEPS_STOCK = EnvBug(
    name="order_keeps_stock", tool="place_order",
    old='        db.execute("UPDATE products SET stock = stock - ? WHERE sku = ?", (qty, sku))\n', new="")


def _over(**update: Any) -> Callable[[Any], Any]:
    return lambda spec: spec.model_copy(update=update)


def _add(**extra: Any) -> Callable[[Any], Any]:
    def f(spec):
        return spec.model_copy(update={k: [*getattr(spec, k), *v] for k, v in extra.items()})
    return f


_ORDER_BY_NAME = ("shop-order-by-name", "I'm grace@example.com; please order one enamel mug for me.",
                  ['find_customer(email="grace@example.com")', 'search_products(query="mug")',
                   'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])'], {})

FRESH: tuple[FreshCase, ...] = (
    # -- environment --------------------------------------------------------------------------------------------------
    FreshCase("fresh/env/empty-catalogue-query-crashes", Blame.environment, "off_path", "shop", "shop-place-order",
              calls=('find_customer(email="grace@example.com")', 'search_products(query="")'),
              control_calls=('find_customer(email="grace@example.com")', 'search_products(query="")',
                             'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])'), bug=_EMPTY_QUERY_CRASH),
    FreshCase("fresh/env/multiword-search-rejected", Blame.environment, "off_path", "shop", _ORDER_BY_NAME,
              calls=('find_customer(email="grace@example.com")', 'search_products(query="enamel mug")'),
              control_calls=('find_customer(email="grace@example.com")', 'search_products(query="enamel mug")',
                             'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])'),
              bug=_MULTIWORD_REJECTED),
    FreshCase("fresh/env/contact-without-cases-crashes", Blame.environment, "off_path", "crm", "crm-vip",
              calls=('find_contact(email="grace@example.com")', 'list_cases(contact_id="C-003")'),
              control_calls=('find_contact(email="grace@example.com")', 'list_cases(contact_id="C-003")',
                             'set_tier(contact_id="C-003", tier="vip")'), bug=_NO_CASES_CRASH),
    FreshCase("fresh/env/credit-return-in-dollars", Blame.environment, "doc_behaviour", "crm", "crm-credit",
              bug=_CREDIT_RETURN_DOLLARS),
    FreshCase("fresh/env/tier-set-inverted", Blame.environment, "doc_behaviour", "crm", "crm-vip", bug=_TIER_INVERTED),
    FreshCase("fresh/env/case-listing-writes", Blame.environment, "doc_behaviour", "crm", "crm-escalate",
              bug=_LIST_CASES_WRITES),
    FreshCase("fresh/env/born-ticket-closed", Blame.environment, "born_broken", "shop", "shop-open-ticket",
              bug=_TICKET_BORN_CLOSED, born=True),
    FreshCase("fresh/env/born-note-truncated", Blame.environment, "born_broken", "crm", "crm-note",
              bug=_NOTE_TRUNCATED, born=True),
    FreshCase("fresh/env/born-escalation-no-op", Blame.environment, "born_broken", "crm", "crm-escalate",
              bug=_ESCALATE_NOOP, born=True),
    FreshCase("fresh/env/born-order-keeps-stock", Blame.environment, "born_broken", "shop", "shop-place-order",
              bug=_ORDER_KEEPS_STOCK, born=True),
    # -- task ---------------------------------------------------------------------------------------------------------
    FreshCase("fresh/task/priority-not-asked", Blame.task, "underivable_gold", "crm",
              ("crm-refund-case", "alan@example.com here: open a case about order 2, I want a refund.",
               ['find_contact(email="alan@example.com")',
                'open_case(contact_id="C-002", topic="Refund for order 2", order_ref=2, priority="high")'], {}),
              calls=('find_contact(email="alan@example.com")',
                     'open_case(contact_id="C-002", topic="Refund for order 2", order_ref=2)')),
    FreshCase("fresh/task/contact-named-only", Blame.task, "underivable_gold", "crm",
              ("crm-vip-by-name", "Make Katherine Johnson a VIP.", ['set_tier(contact_id="C-004", tier="vip")'], {}),
              calls=()),
    FreshCase("fresh/task/usual-item", Blame.task, "underivable_gold", "shop",
              ("shop-usual-item", "I'm grace@example.com; order my usual item again.",
               ['find_customer(email="grace@example.com")',
                'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])'], {}),
              calls=('find_customer(email="grace@example.com")', "list_orders(customer_id=3)")),
    FreshCase("fresh/task/two-amounts", Blame.task, "inconsistent_request", "crm",
              ("crm-goodwill-two-amounts", "Give contact C-002 a goodwill credit of 500 cents ($20).",
               ['issue_credit(contact_id="C-002", amount_cents=500, reason="Goodwill")'], {}),
              calls=('issue_credit(contact_id="C-002", amount_cents=2000, reason="Goodwill")',)),
    FreshCase("fresh/task/gold-contradicts-quoted-sku", Blame.task, "gold_contradicts_request", "shop",
              ("shop-tee-gold-mug", "I'm ada@example.com; order one cotton tee (TEE).",
               ['find_customer(email="ada@example.com")',
                'place_order(customer_id=1, items=[{"sku": "MUG", "qty": 1}])'],
               {}),
              calls=('find_customer(email="ada@example.com")',
                     'place_order(customer_id=1, items=[{"sku": "TEE", "qty": 1}])')),
    FreshCase("fresh/task/order-already-shipped", Blame.task, "precondition_status", "shop", "shop-ship-order",
              start_sql=("UPDATE orders SET status = 'shipped' WHERE id = 2",)),
    FreshCase("fresh/task/item-sold-out", Blame.task, "precondition_stock", "shop", "shop-reorder",
              start_sql=("UPDATE products SET stock = 0 WHERE sku = 'TEE'",)),
    FreshCase("fresh/task/already-vip", Blame.task, "precondition_done", "crm", "crm-vip",
              start_sql=("UPDATE contacts SET tier = 'vip' WHERE id = 'C-003'",)),
    FreshCase("fresh/task/order-already-credited", Blame.task, "precondition_done", "crm", "crm-credit",
              start_sql=("INSERT INTO credits (contact_id, order_ref, amount_cents, reason) "
                         "VALUES ('C-001', 1, 300, 'Late delivery')",)),
    FreshCase("fresh/task/case-already-resolved", Blame.task, "precondition_status", "crm", "crm-note",
              start_sql=("UPDATE cases SET status = 'resolved', resolution = 'Closed by phone' WHERE id = 1",)),
    # -- evaluator ----------------------------------------------------------------------------------------------------
    FreshCase("fresh/evaluator/forbids-needed-lookup", Blame.evaluator, "over_strict", "crm", "crm-vip",
              verifier=_over(forbidden_tools=["find_contact"])),
    FreshCase("fresh/evaluator/resolution-punctuation", Blame.evaluator, "over_strict", "crm", "crm-resolve",
              calls=('resolve_case(case_id=1, resolution="Replacement sent.")',), control=False),
    FreshCase("fresh/evaluator/needless-lookup-return", Blame.evaluator, "over_strict", "crm", "crm-credit",
              verifier=_add(expected_returns=[{"id": "C-001", "email": "ada@example.com"}])),
    FreshCase("fresh/evaluator/amount-as-text", Blame.evaluator, "over_strict", "crm", "crm-credit-again",
              verifier=_add(assertions=[StateAssertion(sql="SELECT amount_cents FROM credits ORDER BY id",
                                                       expected=[["500"]], description="credit amount")])),
    FreshCase("fresh/evaluator/counts-cases-only", Blame.evaluator, "lenient", "crm", "crm-open-case",
              calls=('find_contact(email="alan@example.com")',
                     'open_case(contact_id="C-002", topic="Question about my account")'),
              verifier=_over(compare_state=False, gold_results_contained=False, expected_returns=[],
                             assertions=[StateAssertion(sql="SELECT COUNT(*) FROM cases WHERE contact_id = 'C-002'",
                                                        expected=[[1]], description="alan has a case")])),
    FreshCase("fresh/evaluator/ignores-order-lines", Blame.evaluator, "lenient", "shop", "shop-place-order",
              calls=('find_customer(email="grace@example.com")',
                     'place_order(customer_id=3, items=[{"sku": "PEN", "qty": 1}])'),
              verifier=lambda s: s.model_copy(update={"ignore_tables": [*s.ignore_tables, "order_items", "products",
                                                                        "orders"],
                                                      "gold_results_contained": False, "expected_returns": [],
                                                      "assertions": [StateAssertion(
                                                          sql="SELECT customer_id, status FROM orders ORDER BY id",
                                                          expected=[[1, "shipped"], [2, "placed"], [3, "placed"]],
                                                          description="grace has a placed order")]})),
    FreshCase("fresh/evaluator/lookup-return-only", Blame.evaluator, "lenient", "crm", "crm-vip",
              calls=('find_contact(email="grace@example.com")',),
              verifier=_over(compare_state=False, gold_results_contained=False, expected_returns=[{"id": "C-003"}],
                             assertions=[])),
    FreshCase("fresh/evaluator/extra-write-unchecked", Blame.evaluator, "lenient", "shop", "shop-cancel-order",
              calls=('find_customer(email="alan@example.com")', "list_orders(customer_id=2)",
                     "cancel_order(order_id=2)",
                     'open_ticket(customer_id=2, subject="Order 2 cancelled", order_id=2)'),
              verifier=_over(compare_state=False, expected_returns=[],
                             assertions=[StateAssertion(sql="SELECT status FROM orders WHERE id = 2",
                                                        expected=[["cancelled"]], description="order 2 cancelled")])),
    # -- harness ------------------------------------------------------------------------------------------------------
    FreshCase("fresh/harness/hermes-camelcase-keys", Blame.harness, "harness_parser", "shop", "shop-ship-order",
              harness=_hermes_camelcase),
    FreshCase("fresh/harness/hermes-last-block-only", Blame.harness, "harness_parser", "crm", "crm-open-case",
              harness=_hermes_last_block),
    FreshCase("fresh/harness/react-first-action-only", Blame.harness, "harness_parser", "crm", "crm-escalate",
              harness=_react_first_action),
    FreshCase("fresh/harness/react-input-first-line", Blame.harness, "harness_parser", "crm", "crm-note",
              harness=_react_first_input_line),
    FreshCase("fresh/harness/native-string-arguments-ignored", Blame.harness, "harness_parser", "shop",
              "shop-cancel-order", harness=_native_string_args_ignored),
    FreshCase("fresh/harness/native-calls-dropped-beside-text", Blame.harness, "harness_parser", "shop",
              "shop-open-ticket", harness=_native_drops_calls_with_text),
    FreshCase("fresh/harness/hermes-prompt-args-key", Blame.harness, "harness_prompt", "shop", "shop-place-order",
              harness=_hermes_prompt_args_key),
    FreshCase("fresh/harness/react-prompt-tool-label", Blame.harness, "harness_prompt", "crm", "crm-credit",
              harness=_react_prompt_tool_label),
    # -- policy -------------------------------------------------------------------------------------------------------
    FreshCase("fresh/policy/quantity-doubled", Blame.policy, "wrong_value", "shop", "shop-place-order",
              calls=('find_customer(email="grace@example.com")',
                     'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 2}])')),
    FreshCase("fresh/policy/escalate-instead-of-resolve", Blame.policy, "wrong_tool", "crm", "crm-resolve",
              calls=("escalate_case(case_id=1)",)),
    FreshCase("fresh/policy/forbidden-note", Blame.policy, "forbidden_action", "crm",
              ("crm-resolve-no-notes", "Resolve case 1: replacement sent. Do not add notes to the case.",
               ['resolve_case(case_id=1, resolution="Replacement sent")'], {"forbidden_tools": ["add_note"]}),
              calls=('add_note(case_id=1, body="Replacement sent")',
                     'resolve_case(case_id=1, resolution="Replacement sent")')),
    FreshCase("fresh/policy/forbidden-catalogue-search", Blame.policy, "forbidden_action", "shop",
              ("shop-order-no-browsing",
               "I'm grace@example.com; order one enamel mug (MUG) for me, without searching the catalogue.",
               ['find_customer(email="grace@example.com")',
                'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])'],
               {"forbidden_tools": ["search_products"]}),
              calls=('find_customer(email="grace@example.com")', 'search_products(query="mug")',
                     'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])')),
    FreshCase("fresh/policy/duplicate-case-shifts-ids", Blame.policy, "looks_nondeterministic", "crm", "crm-open-case",
              calls=('find_contact(email="alan@example.com")', 'open_case(contact_id="C-002", topic="Refund")',
                     'open_case(contact_id="C-002", topic="Refund for order 2", order_ref=2)')),
    FreshCase("fresh/policy/note-on-resolved-case", Blame.policy, "wrong_entity", "crm", "crm-note",
              calls=("get_case(case_id=2)", 'add_note(case_id=2, body="Replacement mug on its way")')),
    FreshCase("fresh/policy/credit-in-dollars", Blame.policy, "wrong_units", "crm", "crm-credit",
              calls=('issue_credit(contact_id="C-001", amount_cents=12, reason="Chipped mug", order_ref=1)',)),
    FreshCase("fresh/policy/hermes-single-quotes", Blame.policy, "format_mistake", "shop", "shop-ship-order",
              raw=_hermes_single_quotes),
    FreshCase("fresh/policy/lowercase-sku", Blame.policy, "rejected_input", "shop", "shop-place-order",
              calls=('find_customer(email="grace@example.com")',
                     'place_order(customer_id=3, items=[{"sku": "mug", "qty": 1}])')),
    FreshCase("fresh/policy/credit-plus-escalation", Blame.policy, "extra_write", "crm", "crm-credit",
              calls=('issue_credit(contact_id="C-001", amount_cents=1200, reason="Chipped mug", order_ref=1)',
                     "escalate_case(case_id=1)")),
)


def _agent_calls(harness: Any, calls: list[ToolCall], raw: Callable | None) -> list[ToolCall]:
    """What reaches the server when an agent meaning ``calls`` writes them under ``harness`` (one step with every
    call, then the reply; ``raw`` renders the steps itself), parsed back by that harness."""
    steps = raw(harness, calls) if raw is not None else [harness.render(calls), harness.render([], "Done.")]
    return [ToolCall(name=c.name, arguments=dict(c.arguments)) for s in steps for c in harness.parse(s).calls]


def _with_sql(start: Any, sql: Sequence[str]) -> Any:
    from treadle.weft.evolve.grounding import freeze, open_copy

    con = open_copy(start)
    try:
        for q in sql:
            con.execute(q)
        return freeze(con)
    finally:
        con.close()


def _task(cands: dict[str, Any], spec: str | tuple) -> Any:
    if isinstance(spec, str):
        return next(t for t in cands() if t.name == spec)
    from treadle.weft.envs.atomic import candidate

    name, request, gold, kw = spec
    return candidate(name, request, list(gold), **kw)


async def _run(rt: Any, case: FreshCase, mods: dict[str, Any], cands: dict[str, Callable[[], list]]) -> CaseResult:
    from treadle.weft.evolve.certify import certify_server, play
    from treadle.weft.evolve.loop import TaskSlot, attribute_failure, audit_passing, default_harnesses

    mod = mods[case.env]
    task = _task(cands[case.env], case.task)
    healthy = rt.register(mod)
    current = rt.register(patch_source(inspect.getsource(mod), case.bug)) if case.bug is not None else healthy
    born = current if case.born else healthy
    certified_start = mod.initial_snapshot()

    def unobserved(why: str) -> CaseResult:
        return CaseResult(id=case.id, env=case.env, task=task.name, label=case.label, fault=f"{case.kind}: {why}",
                          observed=False)

    rep = await certify_server(rt, born, certified_start, [task])
    if not rep.kept:
        cert = rep.certificates[0] if rep.certificates else None
        if case.born and cert is not None and cert.checks.get("expected_effect") is False:
            # a born-broken server caught at certification, by the task's expected effect: an environment verdict
            att = Attribution(checkpoint=task.name, blame=Blame.environment, rule="certification_expected_effect",
                              detail="; ".join(cert.reasons)[:500])
            return CaseResult(id=case.id, env=case.env, task=task.name, label=case.label, fault=case.kind,
                              observed=True, attribution=att)
        return unobserved("the task does not certify (a defect of the case)")
    task = rep.kept[0]
    gold = list(task.checkpoint.gold_calls or [])
    ev = await record_evidence(rt, born, certified_start, task.name, gold)
    healthy_spec = generate_verifier(task.checkpoint, certified_start, ev)
    spec = case.verifier(healthy_spec) if case.verifier is not None else healthy_spec
    start = _with_sql(certified_start, case.start_sql) if case.start_sql else certified_start
    intent = [parse_call(c) for c in case.calls] if case.calls is not None else gold
    harnesses = default_harnesses()
    primary = case.harness() if case.harness is not None else harnesses["hermes"]
    primary_name = primary.name
    calls = _agent_calls(primary, intent, case.raw)
    # the control: the same agent on the fault-free system (healthy server, certified start, healthy verifier and
    # harness); it passes for a correct agent and fails for a wrong one
    ctrl_ev = ev if not case.born else await record_evidence(rt, healthy, certified_start, task.name, gold)
    ctrl_spec = healthy_spec if not case.born else generate_verifier(task.checkpoint, certified_start, ctrl_ev)
    ctrl_intent = [parse_call(c) for c in case.control_calls] if case.control_calls is not None else intent
    wrong_agent = case.label == Blame.policy or case.kind == "lenient"
    if case.control and (case.label != Blame.task or case.start_sql):  # a defective task has no fault-free version
        ctrl_calls = _agent_calls(harnesses["hermes"] if case.harness is not None else primary, ctrl_intent,
                                  case.raw)
        _, cv = await play(rt, healthy, certified_start, ctrl_spec, ctrl_calls)
        if (cv.r == 1) == wrong_agent:
            return unobserved(f"control {'passed' if cv.r else 'failed'} on the fault-free system "
                              f"(a defect of the case): {cv.details[:2]}")
    slot = TaskSlot(env=case.env, task=task, start=start, spec=spec, evidence=ev, certified_start=certified_start)
    outs, verdict = await play(rt, current, start, spec, calls)
    if verdict.r == 1:
        att = await audit_passing(rt, slot, current)
        if att is None and case.kind not in SILENT_KINDS:
            return unobserved("the checkpoint passes and the audit finds nothing (the fault does not show)")
    else:
        hv = {primary_name: 0}
        for name, h in harnesses.items():
            if name != primary_name:
                hv[name] = (await play(rt, current, start, spec, _agent_calls(h, intent, case.raw)))[1].r
        att = await attribute_failure(rt, slot, current, outs, verdict, harness=primary, harness_verdicts=hv)
    return CaseResult(id=case.id, env=case.env, task=task.name, label=case.label, fault=case.kind, observed=True,
                      attribution=att)


async def fresh_suite(rt: Any, cases: Sequence[FreshCase] = FRESH) -> list[CaseResult]:
    """Every case of ``cases`` (default :data:`FRESH`) run as the loop runs its slot (see the module docstring)."""
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic

    mods = {"shop": shop, "crm": crm}
    cands = {"shop": shop_atomic.candidates, "crm": crm_tasks.candidates}
    return [await _run(rt, c, mods, cands) for c in cases]
