"""Tasks and verifiers for the shop environment (never imported by :mod:`treadle.weft.envs.shop`).

Each task is a list of atomic turns: the user's request, the gold calls that solve it, and the
checkpoint judged after it (state vs the gold state, gold results among the agent's results, SQL
assertions where the gold state has free text, no call on a closing turn).
"""
from __future__ import annotations

from pydantic import BaseModel

from treadle.weft.runtime.callparse import parse_call
from treadle.weft.runtime.verify import CheckpointSpec, StateAssertion


class Turn(BaseModel):
    """One atomic turn: what the user asks and how it is checked."""

    user: str
    checkpoint: CheckpointSpec

    @property
    def gold(self) -> list[str]:
        return [str(c) for c in self.checkpoint.gold_calls or []]


class Task(BaseModel):
    name: str
    turns: list[Turn]


def _turn(name: str, user: str, gold: list[str], **kw) -> Turn:
    return Turn(user=user, checkpoint=CheckpointSpec(name=name, gold_calls=[parse_call(g) for g in gold], **kw))


def tasks() -> list[Task]:
    """The shop's multi-turn tasks (fresh objects on every call)."""
    return [
        Task(name="ada-replacement", turns=[
            _turn("ada-1-lookup", "Hi, I'm ada@example.com. What have I ordered so far?",
                  ['find_customer(email="ada@example.com")', "list_orders(customer_id=1)"]),
            _turn("ada-2-order", "Please order two more mugs and one fountain pen for me.",
                  ['place_order(customer_id=1, items=[{"sku": "MUG", "qty": 2}, {"sku": "PEN", "qty": 1}])']),
            _turn("ada-3-close-ticket", "Close my chipped-mug ticket; the new order replaces the mug.",
                  ['close_ticket(ticket_id=1, resolution="Replacement mugs ordered in order 3")'],
                  compare_state=False, forbidden_tools=["cancel_order"],
                  assertions=[StateAssertion(sql="SELECT id, status FROM tickets ORDER BY id", expected=[[1, "closed"]],
                                             description="ticket 1 closed, no other ticket")]),
            _turn("ada-4-bye", "Thanks, that's all.", []),
        ]),
        Task(name="alan-cancel", turns=[
            _turn("alan-1-cancel", "alan@example.com here: cancel my order that hasn't shipped yet.",
                  ['find_customer(email="alan@example.com")', "list_orders(customer_id=2)",
                   "cancel_order(order_id=2)"]),
            _turn("alan-2-ticket", "Open a ticket about that order: the refund should go back to my card.",
                  ['open_ticket(customer_id=2, subject="Refund for cancelled order 2 to my card", order_id=2)'],
                  ignore_tables=["tickets"],
                  assertions=[StateAssertion(
                      sql="SELECT customer_id, order_id, status FROM tickets WHERE id > 1 ORDER BY id",
                      expected=[[2, 2, "open"]], description="one new open ticket for order 2")]),
        ]),
    ]
