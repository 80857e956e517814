"""Atomic-task candidates of the CRM environment (never imported by :mod:`treadle.weft.envs.crm`).

Candidates, not certified tasks: :func:`treadle.weft.evolve.certify.certify_server` keeps those that
pass by execution and beat the three baselines. Some are deliberately defective (a lookup only a
read-only agent needs, a near-duplicate tool chain) so that certification has something to reject.
"""
from __future__ import annotations

from treadle.weft.envs.atomic import candidate
from treadle.weft.tasks import AtomicTask


def candidates() -> list[AtomicTask]:
    """The CRM's atomic-task candidates (fresh objects on every call), all against :func:`crm.initial_snapshot`."""
    return [
        candidate("crm-open-case", "alan@example.com here: open a case about order 2, I want a refund.",
                  ['find_contact(email="alan@example.com")',
                   'open_case(contact_id="C-002", topic="Refund for order 2", order_ref=2)']),
        candidate("crm-note", "Add a note to case 1 that a replacement mug is on its way.",
                  ["get_case(case_id=1)", 'add_note(case_id=1, body="Replacement mug on its way")']),
        candidate("crm-escalate", "I'm ada@example.com and my open case needs urgent attention.",
                  ['find_contact(email="ada@example.com")', 'list_cases(contact_id="C-001")', "escalate_case(case_id=1)"]),
        candidate("crm-resolve", "Resolve case 1: replacement sent.",
                  ['resolve_case(case_id=1, resolution="Replacement sent")']),
        candidate("crm-credit", "Give contact C-001 a 1200 cent credit for the chipped mug of order 1.",
                  ['issue_credit(contact_id="C-001", amount_cents=1200, reason="Chipped mug", order_ref=1)']),
        candidate("crm-credit-again", "Give contact C-002 a 500 cent goodwill credit.",
                  ['issue_credit(contact_id="C-002", amount_cents=500, reason="Goodwill")']),
        candidate("crm-vip", "grace@example.com should be a VIP from now on.",
                  ['find_contact(email="grace@example.com")', 'set_tier(contact_id="C-003", tier="vip")']),
        candidate("crm-case-status", "What is the status of case 1?", ["get_case(case_id=1)"]),
    ]
