"""A held-apart fault set: faults of kinds the catalogue (:mod:`.faults`, :mod:`.faults_bfcl`,
:mod:`.faults_composed`) does not inject, written before the attribution rules that decide them.

Each :class:`HeldoutFault` is one certified task of the shop or the CRM (a catalogue task, or one of
this module's) with exactly one fault and a known label, and the calls a policy means to make:

- **harness**: a parser bug (values lower-cased, list arguments dropped, arguments cut after the first,
  input truncated at a comma) or a prompt bug (the instructions teach another call format than the parser
  reads) in one harness; the policy's calls pass through that harness and through the healthy others;
- **environment**: bugs off the reference's path (another letter case or surrounding spaces in an
  e-mail, order lines in another order, an apostrophe in free text: inputs the schema allows and the
  healthy server accepts), tools whose behaviour contradicts their description (units, the direction
  of a change, a read-only tool that writes) and **born-broken** servers (the bug is present when the
  task is certified, so the reference evidence carries it; a wrong-row write);
- **task**: gold values the request, history and tool results do not give (an amount, a quantity, an
  order number), inconsistent requests (two actions that exclude each other), a gold that acts for
  another customer than the request's;
- **evaluator**: over-strict verifiers (free text asserted byte for byte: a faithful paraphrase
  fails) and lenient ones (a verifier that ignores a table, a value or a forbidden tool passes a wrong
  trajectory: such a fault is *silent*, no checkpoint fails);
- **policy**: wrong entity, value, tool or free text, a skipped or extra write, a tool the request
  forbids, calls in another harness's format, an e-mail that does not exist, a paraphrase of quoted text.

A case is *observed* when its checkpoint fails, or when it is silent (a lenient verifier or a born-broken
server rewards what it should not). :func:`heldout_suite` plays each case and attributes it through
``attributor`` (default: the evolution loop's own call, :func:`treadle.weft.evolve.loop.attribute_failure`),
so that the figures are those the loop would produce.
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.weft.runtime.callparse import ToolCall, parse_call
from treadle.weft.evolve.attribute import Blame
from treadle.weft.evolve.faults import CaseResult, EnvBug, patch_source
from treadle.weft.rollouts.harnesses import HermesHarness, NativeHarness, ReActHarness
from treadle.weft.runtime.verify import CheckpointSpec, StateAssertion

__all__ = ["HELDOUT", "HeldoutFault", "heldout_suite", "heldout_tasks"]


def _c(text: str) -> ToolCall:
    return parse_call(text)


# -- harnesses with one bug each (the policy's calls pass through them) ---------------------------------------
class LowercasingReAct(ReActHarness):
    """Parser bug: every string argument value is lower-cased (identifiers such as ``C-002`` break)."""

    def parse_text(self, out):
        step = super().parse_text(out)
        calls = tuple(c.model_copy(update={"arguments": {k: v.lower() if isinstance(v, str) else v
                                                         for k, v in c.arguments.items()}}) for c in step.calls)
        return step.model_copy(update={"calls": calls})


class ListDroppingHermes(HermesHarness):
    """Parser bug: list-valued arguments are dropped."""

    def parse_text(self, out):
        step = super().parse_text(out)
        calls = tuple(c.model_copy(update={"arguments": {k: v for k, v in c.arguments.items()
                                                         if not isinstance(v, list)}}) for c in step.calls)
        return step.model_copy(update={"calls": calls})


class FirstArgumentNative(NativeHarness):
    """Parser bug: only the first argument of each call is kept."""

    def parse(self, out):
        step = super().parse(out)
        calls = tuple(c.model_copy(update={"arguments": dict(list(c.arguments.items())[:1])}) for c in step.calls)
        return step.model_copy(update={"calls": calls})


class CommaCuttingReAct(ReActHarness):
    """Parser bug: the Action Input is cut at its first comma (multi-argument inputs no longer parse)."""

    def parse_text(self, out):
        from treadle.weft.rollouts.policies import PolicyOutput

        cut = "\n".join(line.split(",")[0] + ("}" if "," in line else "") if line.lstrip().startswith("Action Input")
                        else line for line in out.text.splitlines())
        return super().parse_text(PolicyOutput(text=cut))


class ArgsPromptReAct(ReActHarness):
    """Prompt bug: the instructions teach ``Action Args:``, the parser reads ``Action Input:`` (a policy that
    follows the prompt writes the former: :meth:`render` is what it writes)."""

    def instructions(self, tools):
        return ("Answer in this format: 'Thought: <reasoning>' then either 'Action: <tool name>' and "
                "'Action Args: <JSON object>' (the result comes back as 'Observation: ...'), or "
                "'Final Answer: <reply to the user>'.")

    def render(self, calls, text=""):
        out = super().render(calls, text)
        return out.model_copy(update={"text": out.text.replace("Action Input:", "Action Args:")})


class FunctionTagPromptHermes(HermesHarness):
    """Prompt bug: the instructions teach ``<function_call>`` blocks, the parser reads ``<tool_call>``."""

    def instructions(self, tools):
        return ("To call a tool, write <function_call>{\"name\": <tool>, \"arguments\": <object>}</function_call>; "
                "several blocks call several tools. Without a tool call, your text is the reply to the user.")

    def render(self, calls, text=""):
        out = super().render(calls, text)
        return out.model_copy(update={"text": out.text.replace("tool_call>", "function_call>")})




# -- the cases -------------------------------------------------------------------------------------------------
@dataclass
class HeldoutFault:
    """One held-apart case.

    Attributes:
        id, label, kind: name, the component at fault, the kind of fault.
        env: ``shop`` or ``crm``; task: the task's name (:func:`heldout_tasks` or the catalogue's candidates).
        calls: what the policy means to call (call strings; None: the task's gold calls).
        bug: a server patch: in the server as it is now, and also at certification when ``born`` is True.
        start_sql: SQL run on the environment's seed state to make the task's start state.
        verifier: the verifier as it is now, made from the generated one (None: the generated one).
        harness: the harness the policy's calls pass through (default Hermes); the healthy ``hermes``,
            ``react`` and ``native`` harnesses give the cross-harness verdicts, this one in place of its kind.
        writer: the format the policy writes its calls in under ``harness`` (default: the harness's own; a
            policy that does not adapt to the harness writes another's).
        silent: the fault rewards what it should not (no checkpoint fails).
    """

    id: str
    label: Blame
    kind: str
    env: str
    task: str
    calls: Sequence[str] | None = None
    bug: EnvBug | None = None
    born: bool = False
    start_sql: str = ""
    verifier: Callable[[CheckpointSpec], CheckpointSpec] | None = None
    harness: Any = None
    harness_kind: str = "hermes"
    writer: Any = None
    silent: bool = False
    notes: str = field(default="")


def _bug(tool: str, old: str, new: str, name: str = "") -> EnvBug:
    return EnvBug(name=name or f"{tool}-heldout", tool=tool, old=old, new=new)


_EMAIL_CASE = _bug("find_customer", 'WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()',
                   'WHERE email = ?", (email.strip(),)).fetchone()')
_EMAIL_SPACES = _bug("find_customer", 'WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()',
                     'WHERE lower(email) = lower(?)", (email,)).fetchone()')
_CRM_EMAIL_CASE = _bug("find_contact", 'WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()',
                       'WHERE email = ?", (email.strip(),)).fetchone()')
_ITEM_ORDER = _bug("place_order", "    skus = [line.sku for line in items]\n",
                   "    skus = [line.sku for line in items]\n    if skus != sorted(skus):\n"
                   "        raise KeyError(skus[0])\n")
_NOTE_QUOTING = _bug("add_note", 'db.execute("INSERT INTO notes (case_id, body) VALUES (?, ?)", (case_id, body))',
                     "db.execute(f\"INSERT INTO notes (case_id, body) VALUES ({case_id}, '{body}')\")")
_CREDIT_UNITS = _bug("issue_credit", "(contact_id, order_ref, amount_cents, reason))",
                     "(contact_id, order_ref, amount_cents * 100, reason))")
_RESTOCK_DIRECTION = _bug("cancel_order", 'UPDATE products SET stock = stock + ? WHERE sku = ?',
                          'UPDATE products SET stock = stock - ? WHERE sku = ?')
_GET_CASE_WRITES = _bug("get_case", "    return _case(db, case_id)\n\n\n@server.tool(reads=(\"contacts\",), "
                                    "writes=(\"cases\",)",
                        "    db.execute(\"UPDATE cases SET status = 'pending' WHERE id = ? AND status = 'new'\", "
                        "(case_id,))\n    return _case(db, case_id)\n\n\n@server.tool(reads=(\"contacts\",), "
                        "writes=(\"cases\",)")
_LIST_ORDERS_WRITES = _bug("list_orders", "    _customer(db, customer_id)\n    return [{\"id\": i, \"status\": s,",
                           "    _customer(db, customer_id)\n    db.execute(\"UPDATE orders SET status = 'shipped' "
                           "WHERE customer_id = ? AND status = 'placed'\", (customer_id,))\n"
                           "    return [{\"id\": i, \"status\": s,")
_TIER_WRONG_ROW = _bug("set_tier", 'WHERE id = ?", (tier, contact_id))',
                       'WHERE id = ?", (tier, "C-%03d" % (int(contact_id[2:]) + 1)))')
_CLOSE_WRONG_ROW = _bug("close_ticket", "resolution = ? WHERE id = ?\", (resolution, ticket_id))",
                        "resolution = ? WHERE customer_id = (SELECT customer_id FROM tickets WHERE id = ?)\", "
                        "(resolution, ticket_id))")
_TOTAL_UNITS = _bug("place_order", "VALUES (?, 'placed', ?)\",\n                     (customer_id, total))",
                    "VALUES (?, 'placed', ?)\",\n                     (customer_id, total // 100))")

_SECOND_TICKET = "INSERT INTO tickets VALUES (2, 1, 1, 'Wrong colour', 'open', NULL);"


def _lenient_no_credit_table(spec: CheckpointSpec) -> CheckpointSpec:
    return spec.model_copy(update={"compare_state": False, "gold_results_contained": False, "expected_returns": [],
                                   "assertions": [a for a in spec.assertions if "credits" not in a.sql]})


def _lenient_any_order(spec: CheckpointSpec) -> CheckpointSpec:
    return spec.model_copy(update={"compare_state": False, "gold_results_contained": False, "expected_returns": [],
                                   "assertions": [StateAssertion(sql="SELECT count(*) FROM orders", expected=[[3]],
                                                                 description="an order was placed")]})


def _lenient_forbidden(spec: CheckpointSpec) -> CheckpointSpec:
    return spec.model_copy(update={"compare_state": False, "forbidden_tools": [],
                                   "assertions": [StateAssertion(sql="SELECT id, priority FROM cases ORDER BY id",
                                                                 expected=[[1, "high"], [2, "low"]],
                                                                 description="case 1 escalated")]})


E, T, V, H, P = Blame.environment, Blame.task, Blame.evaluator, Blame.harness, Blame.policy

HELDOUT: tuple[HeldoutFault, ...] = (
    # environment: off the reference's path
    HeldoutFault("env/email-letter-case", E, "off_path", "shop", "ho-order-mixed-case",
                 calls=['find_customer(email="Grace@Example.com")'], bug=_EMAIL_CASE),
    HeldoutFault("env/crm-email-letter-case", E, "off_path", "crm", "ho-crm-case-upper",
                 calls=['find_contact(email="ALAN@example.com")'], bug=_CRM_EMAIL_CASE),
    HeldoutFault("env/email-spaces", E, "off_path", "shop", "ho-cancel-spaced",
                 calls=['find_customer(email="alan@example.com ")'], bug=_EMAIL_SPACES),
    HeldoutFault("env/order-lines-order", E, "off_path", "shop", "ho-two-lines",
                 calls=['find_customer(email="alan@example.com")',
                        'place_order(customer_id=2, items=[{"sku": "PEN", "qty": 1}, {"sku": "MUG", "qty": 2}])'],
                 bug=_ITEM_ORDER),
    HeldoutFault("env/apostrophe-in-note", E, "off_path", "crm", "crm-note",
                 calls=["get_case(case_id=1)", 'add_note(case_id=1, body="Replacement mug\'s on its way")'],
                 bug=_NOTE_QUOTING),
    # environment: behaviour against description, found on the reference's path
    HeldoutFault("env/read-only-lookup-writes", E, "doc_behaviour", "shop", "shop-cancel-order", bug=_LIST_ORDERS_WRITES),
    HeldoutFault("env/total-in-dollars", E, "doc_behaviour", "shop", "shop-place-order", bug=_TOTAL_UNITS),
    # environment: born broken (the reference evidence carries the bug)
    HeldoutFault("env/born-credit-units", E, "born_broken", "crm", "crm-credit", bug=_CREDIT_UNITS, born=True,
                 silent=True),
    HeldoutFault("env/born-restock-direction", E, "born_broken", "shop", "shop-cancel-order", bug=_RESTOCK_DIRECTION,
                 born=True, silent=True),
    HeldoutFault("env/born-read-only-writes", E, "born_broken", "crm", "crm-note", bug=_GET_CASE_WRITES, born=True,
                 silent=True),
    HeldoutFault("env/born-tier-wrong-row", E, "born_broken", "crm", "crm-vip", bug=_TIER_WRONG_ROW, born=True,
                 silent=True),
    HeldoutFault("env/born-close-wrong-row", E, "born_broken", "shop", "ho-close-two-tickets", bug=_CLOSE_WRONG_ROW,
                 born=True, start_sql=_SECOND_TICKET, silent=True),
    # task: gold values not derivable, inconsistent requests, another customer
    HeldoutFault("task/amount-not-given", T, "task_semantics", "crm", "ho-goodwill-unstated",
                 calls=['issue_credit(contact_id="C-002", amount_cents=500, reason="Goodwill")']),
    HeldoutFault("task/quantity-not-given", T, "task_semantics", "shop", "ho-tee-quantity",
                 calls=['find_customer(email="grace@example.com")',
                        'place_order(customer_id=3, items=[{"sku": "TEE", "qty": 1}])']),
    HeldoutFault("task/order-number-not-given", T, "task_semantics", "crm", "ho-refund-case",
                 calls=['find_contact(email="alan@example.com")', 'open_case(contact_id="C-002", topic="Refund")']),
    HeldoutFault("task/which-order", T, "task_semantics", "shop", "ho-ship-unnamed", calls=[]),
    HeldoutFault("task/cancel-and-ship", T, "inconsistent_request", "shop", "ho-cancel-and-ship",
                 calls=["ship_order(order_id=2)"]),
    HeldoutFault("task/other-customers-order", T, "other_customer", "shop", "ho-grace-cancels-2",
                 calls=['find_customer(email="grace@example.com")', "list_orders(customer_id=3)"]),
    HeldoutFault("task/other-contacts-case", T, "other_customer", "crm", "ho-katherine-note",
                 calls=['find_contact(email="katherine@example.com")', 'list_cases(contact_id="C-004")']),
    HeldoutFault("task/other-customers-ticket", T, "other_customer", "shop", "ho-alan-closes-1",
                 calls=['find_customer(email="alan@example.com")']),
    # evaluator: over-strict (free text byte for byte) and lenient (silent)
    HeldoutFault("evaluator/note-paraphrase", V, "over_strict", "crm", "crm-note",
                 calls=["get_case(case_id=1)", 'add_note(case_id=1, body="A replacement mug is on its way to the '
                                               'customer")']),
    HeldoutFault("evaluator/subject-paraphrase", V, "over_strict", "shop", "shop-open-ticket",
                 calls=['open_ticket(customer_id=1, subject="Loose handle on the mug", order_id=1)']),
    HeldoutFault("evaluator/resolution-paraphrase", V, "over_strict", "crm", "crm-resolve",
                 calls=['resolve_case(case_id=1, resolution="Replacement has been sent")']),
    HeldoutFault("evaluator/hand-written-resolution", V, "over_strict", "shop", "ho-close-with-note",
                 calls=['close_ticket(ticket_id=1, resolution="A replacement was sent")']),
    HeldoutFault("evaluator/ignores-credits", V, "lenient", "crm", "crm-credit",
                 calls=['issue_credit(contact_id="C-001", amount_cents=500, reason="Chipped mug", order_ref=1)'],
                 verifier=_lenient_no_credit_table, silent=True),
    HeldoutFault("evaluator/any-order-passes", V, "lenient", "shop", "shop-place-order",
                 calls=['find_customer(email="grace@example.com")',
                        'place_order(customer_id=3, items=[{"sku": "TEE", "qty": 1}])'],
                 verifier=_lenient_any_order, silent=True),
    HeldoutFault("evaluator/forbidden-not-checked", V, "lenient", "crm", "ho-escalate-no-note",
                 calls=["escalate_case(case_id=1)", 'add_note(case_id=1, body="Escalated")'],
                 verifier=_lenient_forbidden, silent=True),
    # harness: parser and prompt bugs in one harness
    HeldoutFault("harness/react-lowercases", H, "harness_parser", "crm", "crm-open-case", harness=LowercasingReAct(),
                 harness_kind="react"),
    HeldoutFault("harness/hermes-drops-lists", H, "harness_parser", "shop", "shop-place-order",
                 harness=ListDroppingHermes(), harness_kind="hermes"),
    HeldoutFault("harness/native-first-argument", H, "harness_parser", "crm", "crm-credit",
                 harness=FirstArgumentNative(), harness_kind="native"),
    HeldoutFault("harness/react-cuts-at-comma", H, "harness_parser", "shop", "shop-open-ticket",
                 harness=CommaCuttingReAct(), harness_kind="react"),
    HeldoutFault("harness/react-prompt-format", H, "harness_prompt", "shop", "shop-ship-order",
                 harness=ArgsPromptReAct(), harness_kind="react"),
    HeldoutFault("harness/hermes-prompt-tags", H, "harness_prompt", "crm", "crm-vip",
                 harness=FunctionTagPromptHermes(), harness_kind="hermes"),
    # policy: genuine errors
    HeldoutFault("policy/shipped-order-cancelled", P, "wrong_entity", "shop", "shop-cancel-order",
                 calls=['find_customer(email="alan@example.com")', "list_orders(customer_id=2)",
                        "cancel_order(order_id=1)"]),
    HeldoutFault("policy/double-credit-amount", P, "wrong_value", "crm", "crm-credit",
                 calls=['issue_credit(contact_id="C-001", amount_cents=2400, reason="Chipped mug", order_ref=1)']),
    HeldoutFault("policy/lookups-only", P, "skipped_write", "crm", "crm-escalate",
                 calls=['find_contact(email="ada@example.com")', 'list_cases(contact_id="C-001")']),
    HeldoutFault("policy/two-orders", P, "extra_write", "shop", "shop-place-order",
                 calls=['find_customer(email="grace@example.com")',
                        'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])',
                        'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])']),
    HeldoutFault("policy/forbidden-lookup", P, "forbidden_action", "shop", "ho-ship-no-lookup",
                 calls=["get_order(order_id=2)", "ship_order(order_id=2)"]),
    HeldoutFault("policy/forbidden-case-read", P, "forbidden_action", "crm", "ho-resolve-no-lookup",
                 calls=["get_case(case_id=1)", 'resolve_case(case_id=1, resolution="Replacement sent")']),
    HeldoutFault("policy/hermes-blocks-under-react", P, "interaction_adaptation", "crm", "crm-escalate",
                 harness=ReActHarness(), harness_kind="react", writer=HermesHarness()),
    HeldoutFault("policy/note-says-otherwise", P, "wrong_text", "crm", "crm-note",
                 calls=["get_case(case_id=1)", 'add_note(case_id=1, body="Refund issued to the card")']),
    HeldoutFault("policy/cancel-instead-of-ship", P, "wrong_tool", "shop", "shop-ship-order",
                 calls=["get_order(order_id=2)", "cancel_order(order_id=2)"]),
    HeldoutFault("policy/tier-of-another-contact", P, "wrong_entity", "crm", "crm-vip",
                 calls=['find_contact(email="grace@example.com")', 'set_tier(contact_id="C-002", tier="vip")']),
    HeldoutFault("policy/quoted-text-paraphrased", P, "wrong_text", "shop", "ho-close-quoted",
                 calls=['close_ticket(ticket_id=1, resolution="Sent a replacement")']),
    HeldoutFault("policy/unknown-email", P, "wrong_value", "shop", "shop-place-order",
                 calls=['find_customer(email="grace@example.org")']),
)


def heldout_tasks() -> dict[str, Any]:
    """This module's atomic tasks (fresh objects), by name; the others come from the catalogue's candidates."""
    from treadle.weft.envs.atomic import candidate

    tasks = [
        candidate("ho-order-mixed-case", "I'm Grace@Example.com; please order one enamel mug (MUG) for me.",
                  ['find_customer(email="grace@example.com")',
                   'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])']),
        candidate("ho-crm-case-upper", "ALAN@example.com here: open a case about order 2, I want a refund.",
                  ['find_contact(email="alan@example.com")',
                   'open_case(contact_id="C-002", topic="Refund for order 2", order_ref=2)']),
        candidate("ho-cancel-spaced", "Email: alan@example.com . Cancel my order that hasn't shipped yet.",
                  ['find_customer(email="alan@example.com")', "list_orders(customer_id=2)", "cancel_order(order_id=2)"]),
        candidate("ho-two-lines", "I'm alan@example.com; order two mugs (MUG) and one fountain pen (PEN).",
                  ['find_customer(email="alan@example.com")',
                   'place_order(customer_id=2, items=[{"sku": "MUG", "qty": 2}, {"sku": "PEN", "qty": 1}])']),
        candidate("ho-close-two-tickets", "Close ticket 1, the replacement was sent.",
                  ['close_ticket(ticket_id=1, resolution="Replacement sent")']),
        candidate("ho-goodwill-unstated", "Give contact C-002 a goodwill credit.",
                  ['issue_credit(contact_id="C-002", amount_cents=750, reason="Goodwill")']),
        candidate("ho-tee-quantity", "I'm grace@example.com; please order a cotton tee (TEE) for me.",
                  ['find_customer(email="grace@example.com")',
                   'place_order(customer_id=3, items=[{"sku": "TEE", "qty": 3}])']),
        candidate("ho-refund-case", "alan@example.com here: open a case about my refund.",
                  ['find_contact(email="alan@example.com")',
                   'open_case(contact_id="C-002", topic="Refund", order_ref=7)']),
        candidate("ho-ship-unnamed", "Ship the order.", ["ship_order(order_id=2)"]),
        candidate("ho-cancel-and-ship", "Cancel order 2 and ship order 2 today.", ["cancel_order(order_id=2)"]),
        candidate("ho-grace-cancels-2", "I'm grace@example.com; cancel order 2.",
                  ['find_customer(email="grace@example.com")', "cancel_order(order_id=2)"]),
        candidate("ho-katherine-note", "I'm katherine@example.com: add a note to my case saying I called back.",
                  ['find_contact(email="katherine@example.com")',
                   'add_note(case_id=1, body="Customer called back")']),
        candidate("ho-alan-closes-1", "alan@example.com here: close my ticket, it's sorted.",
                  ['find_customer(email="alan@example.com")', 'close_ticket(ticket_id=1, resolution="Sorted")']),
        candidate("ho-close-with-note", "Close ticket 1 and note that a replacement was sent.",
                  ['close_ticket(ticket_id=1, resolution="Replacement sent")'], compare_state=False,
                  assertions=[StateAssertion(sql="SELECT id, status, resolution FROM tickets ORDER BY id",
                                             expected=[[1, "closed", "Replacement sent"]],
                                             description="ticket 1 closed with its resolution")]),
        candidate("ho-escalate-no-note", "Escalate case 1; do not add notes to it.", ["escalate_case(case_id=1)"],
                  forbidden_tools=["add_note"]),
        candidate("ho-ship-no-lookup", "Ship order 2 right away; do not look the order up first.",
                  ["ship_order(order_id=2)"], forbidden_tools=["get_order"]),
        candidate("ho-resolve-no-lookup", "Resolve case 1: replacement sent. No need to look the case up.",
                  ['resolve_case(case_id=1, resolution="Replacement sent")'], forbidden_tools=["get_case"]),
        candidate("ho-close-quoted", 'Close ticket 1 with the resolution "Replacement sent".',
                  ['close_ticket(ticket_id=1, resolution="Replacement sent")']),
    ]
    return {t.name: t for t in tasks}


@dataclass
class Prepared:
    """A case made concrete: servers (now, certified), start, task, evidence, verifier as now, calls per harness,
    and ``refused``: the reasons certification gives when it refuses the task for its expected effect alone (a
    born-broken server caught before any rollout; the case is still played as if it had been certified)."""

    fault: HeldoutFault
    task: Any
    server_hash: str
    certified_hash: str
    certified_source: str
    source: str
    start: Any
    evidence: Any
    spec: CheckpointSpec
    calls: list[ToolCall]
    harness: Any
    harness_calls: dict[str, list[ToolCall]]
    refused: list[str] = field(default_factory=list)


def _through(harness: Any, calls: Sequence[ToolCall], writer: Any = None) -> list[ToolCall]:
    """``calls`` as a policy writes them under ``harness`` (its render, or ``writer``'s) and the harness reads back."""
    return [ToolCall(name=c.name, arguments=dict(c.arguments))
            for c in harness.parse((writer or harness).render(list(calls))).calls]


async def prepare(rt: Any, f: HeldoutFault) -> Prepared:
    """Register the servers of ``f``, certify its task there (ValueError when it does not certify), record the
    reference evidence and make the verifier as it is now."""
    from treadle.weft.envs import crm, crm_tasks, shop, shop_atomic
    from treadle.weft.evolve.attribute import generate_verifier, record_evidence
    from treadle.weft.evolve.certify import certify_task
    from treadle.weft.evolve.grounding import freeze, open_copy

    mod, cands = {"shop": (shop, shop_atomic.candidates), "crm": (crm, crm_tasks.candidates)}[f.env]
    tasks = {t.name: t for t in cands()} | heldout_tasks()
    task = tasks[f.task]
    healthy = inspect.getsource(mod)
    source = patch_source(healthy, f.bug) if f.bug is not None else healthy
    certified_source = source if f.born else healthy
    h_now, h_cert = rt.register(source), rt.register(certified_source)
    start = mod.initial_snapshot()
    if f.start_sql:
        con = open_copy(start)
        try:
            con.executescript(f.start_sql)
            start = freeze(con)
        finally:
            con.close()
    cert = await certify_task(rt, h_cert, start, task)
    refused = [k for k, ok in cert.checks.items() if not ok]
    if refused and refused != ["expected_effect"]:
        raise ValueError(f"held-apart case {f.id}: task {task.name} does not certify: {list(cert.reasons)}")
    gold = list(task.checkpoint.gold_calls or [])
    ev = await record_evidence(rt, h_cert, start, task.name, gold)
    spec = generate_verifier(task.checkpoint, start, ev)
    if f.verifier is not None:
        spec = f.verifier(spec)
    intended = [_c(s) for s in f.calls] if f.calls is not None else gold
    harness = f.harness or HermesHarness()
    healthy_h = {"hermes": HermesHarness(), "react": ReActHarness(), "native": NativeHarness()}
    healthy_h[f.harness_kind] = harness
    per = {k: _through(h, intended, f.writer) for k, h in healthy_h.items()}
    return Prepared(fault=f, task=task, server_hash=h_now, certified_hash=h_cert, certified_source=certified_source,
                    source=source, start=start, evidence=ev, spec=spec, calls=per[f.harness_kind], harness=harness,
                    harness_calls=per, refused=list(cert.reasons) if refused else [])


async def attribute_only(rt: Any, p: Prepared, outs: Sequence[Any], verdict: Any) -> Any:
    """``attribute`` with the slot's server, start, verifier and evidence alone (no request, harness or
    cross-harness verdicts; passing slots not audited): the reference-replay rules by themselves."""
    from treadle.weft.evolve.attribute import attribute

    if verdict.r == 1:
        return None
    return await attribute(rt, p.server_hash, p.start, p.spec, p.evidence, outs, verdict)


def slot_of(p: Prepared) -> Any:
    """The evolution loop's slot for a prepared case."""
    from treadle.weft.evolve.loop import TaskSlot

    return TaskSlot(env=p.fault.env, task=p.task, start=p.start, spec=p.spec, evidence=p.evidence,
                    certified_start=p.start)


async def loop_attributor(rt: Any, p: Prepared, outs: Sequence[Any], verdict: Any) -> Any:
    """What the evolution loop does with the slot: a failed checkpoint is attributed by
    :func:`~treadle.weft.evolve.loop.attribute_failure` with the harness the calls went through and the
    verdicts of the same calls under every harness; a passing one is audited
    (:func:`~treadle.weft.evolve.loop.audit_passing`)."""
    from treadle.weft.evolve.attribute import Attribution
    from treadle.weft.evolve.certify import play
    from treadle.weft.evolve.loop import attribute_failure, audit_passing

    if p.refused:  # certification refused the task: its server's effect is not the contract's
        return Attribution(checkpoint=p.spec.name, blame=Blame.environment, rule="certification_expected_effect",
                           detail="; ".join(p.refused)[:500])
    slot = slot_of(p)
    if verdict.r == 1:
        return await audit_passing(rt, slot, p.server_hash)
    hv = {}
    for name, calls in p.harness_calls.items():
        hv[name] = (await play(rt, p.server_hash, p.start, p.spec, calls))[1].r
    return await attribute_failure(rt, slot, p.server_hash, outs, verdict, harness=p.harness, harness_verdicts=hv)


async def heldout_suite(rt: Any, faults: Sequence[HeldoutFault] = HELDOUT, attributor: Any = None
                        ) -> list[CaseResult]:
    """Play every case (the policy's calls through its harness, on the server as it is now, judged by the
    verifier as it is now) and attribute it with ``attributor(rt, prepared, outcomes, verdict)`` (an
    Attribution, or None for "nothing found" on a passing run); see the module docstring."""
    from treadle.weft.evolve.certify import play

    attributor = attributor or loop_attributor
    out = []
    for f in faults:
        p = await prepare(rt, f)
        outs, verdict = await play(rt, p.server_hash, p.start, p.spec, p.calls)
        observed = verdict.r == 0 or f.silent
        att = await attributor(rt, p, outs, verdict) if observed else None
        out.append(CaseResult(id=f"heldout/{f.id}", env=f.env, task=f.task, label=f.label, fault=f.kind,
                              observed=observed, attribution=att))
    return out


def summary(cases: Sequence[CaseResult]) -> dict[str, Any]:
    """Per-component accuracy over observed cases, and the two cross-blames that corrupt training:
    ``blamed_on_policy`` (a non-policy fault blamed on the policy, or left rewarded: a silent fault nothing
    found) and ``policy_blamed_elsewhere``."""
    obs = [c for c in cases if c.observed]
    per: dict[str, list[int]] = {}
    for c in obs:
        row = per.setdefault(c.label.value, [0, 0])
        row[0] += c.correct
        row[1] += 1
    on_policy = [c.id for c in obs if c.label != Blame.policy
                 and (c.attribution is None or c.attribution.blame == Blame.policy)]
    elsewhere = [c.id for c in obs if c.label == Blame.policy and c.attribution is not None
                 and c.attribution.blame not in (Blame.policy, Blame.undecided)]
    return {"cases": len(cases), "observed": len(obs), "correct": sum(c.correct for c in obs),
            "accuracy": sum(c.correct for c in obs) / len(obs) if obs else 0.0,
            "per_component": {k: {"correct": v[0], "n": v[1]} for k, v in sorted(per.items())},
            "blamed_on_policy": on_policy, "policy_blamed_elsewhere": elsewhere,
            "undecided": [c.id for c in obs if c.attribution is not None and c.attribution.blame == Blame.undecided],
            "wrong": {c.id: (c.attribution.blame.value if c.attribution else "passed") for c in obs if not c.correct}}


def dumps(cases: Sequence[CaseResult]) -> str:
    return json.dumps(summary(cases), indent=1)
