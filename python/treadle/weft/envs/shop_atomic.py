"""Atomic-task candidates of the shop environment (never imported by :mod:`treadle.weft.envs.shop`).

Candidates for :func:`treadle.weft.evolve.certify.certify_server`; a few are deliberately defective:
a lookup (a read-only agent passes it), a turn with nothing to do (a do-nothing agent passes it), a
gold that cannot execute (cancelling a shipped order) and a near-duplicate tool chain.
"""
from __future__ import annotations

from treadle.weft.envs.atomic import candidate
from treadle.weft.tasks import AtomicTask
from treadle.weft.runtime.verify import StateAssertion


def candidates() -> list[AtomicTask]:
    """The shop's atomic-task candidates (fresh objects on every call), all against :func:`shop.initial_snapshot`."""
    return [
        candidate("shop-place-order", "I'm grace@example.com; please order one enamel mug (MUG) for me.",
                  ['find_customer(email="grace@example.com")',
                   'place_order(customer_id=3, items=[{"sku": "MUG", "qty": 1}])']),
        candidate("shop-cancel-order", "alan@example.com here: cancel my order that hasn't shipped yet.",
                  ['find_customer(email="alan@example.com")', "list_orders(customer_id=2)", "cancel_order(order_id=2)"]),
        candidate("shop-ship-order", "Check order 2 and ship it.", ["get_order(order_id=2)", "ship_order(order_id=2)"]),
        candidate("shop-open-ticket", "Open a ticket for customer 1 about order 1: the mug handle is loose.",
                  ['open_ticket(customer_id=1, subject="Mug handle loose", order_id=1)']),
        candidate("shop-close-ticket", "Close ticket 1, the replacement was sent.",
                  ['close_ticket(ticket_id=1, resolution="Replacement sent")'], compare_state=False,
                  assertions=[StateAssertion(sql="SELECT id, status FROM tickets ORDER BY id",
                                             expected=[[1, "closed"]], description="ticket 1 closed")]),
        candidate("shop-reorder", "I'm ada@example.com; order one cotton tee (TEE).",
                  ['find_customer(email="ada@example.com")', 'place_order(customer_id=1, items=[{"sku": "TEE", "qty": 1}])']),
        candidate("shop-caps-in-stock", "Do you have caps in stock?", ['search_products(query="cap")']),
        candidate("shop-cancel-shipped", "Cancel order 1.", ["cancel_order(order_id=1)"]),
        candidate("shop-thanks", "Thanks, that's all.", []),
    ]
