"""Business entities shared across servers, and where each server keeps them (seed: WEFT 4.1, entity bindings).

An :class:`EntityMap` says, for one server, which ``table.column`` holds which attribute of which
business entity. Two servers share an entity kind when both map it; the same business object is
recognised across servers by its *identity attribute* (a customer by e-mail, an order by the shop's
order number). Tool arguments are resolved to entities through the tool contracts' ``args_to_state``
(the first ``table.column`` of each entry).
"""
from __future__ import annotations

import re
import sqlite3
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict


class EntityKind(BaseModel):
    """How one server stores one kind of entity.

    Attributes:
        kind: the business entity (``customer``, ``order``, ``case``...).
        table, id_column: the rows that *are* the entity on this server (None: the server only refers
            to it, e.g. the CRM's ``order_ref``).
        identity: attribute that identifies the business object across servers (``email``) or
            ``id`` when the server's id is the shared key (the shop's order number).
        columns: ``table.column`` -> attribute of the entity it holds (``id``, ``email``, ``name``...).
        noun: the word requests use before an id ("order 2"): request texts are rewritten only there.
        history: SQL condition selecting rows in a finished state (grounding copies one as the bound
            customer's history; a finished record never makes a request ambiguous).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    table: str | None
    id_column: str | None = "id"
    identity: str = "id"
    columns: dict[str, str]
    noun: str = ""
    history: str | None = None


class EntityMap(BaseModel):
    """The entity kinds of one server (by kind); ``shared=False`` kinds are local (never bound across servers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    server: str
    kinds: dict[str, EntityKind]
    local: tuple[str, ...] = ()

    def attribute_of(self, column: str) -> tuple[str, str] | None:
        """``table.column`` -> (kind, attribute), or None."""
        for k in self.kinds.values():
            if column in k.columns:
                return k.kind, k.columns[column]
        return None


SHOP = EntityMap(server="shop", local=("ticket",), kinds={
    "customer": EntityKind(kind="customer", table="customers", identity="email", noun="customer",
                           columns={"customers.id": "id", "customers.email": "email", "customers.name": "name",
                                    "orders.customer_id": "id", "tickets.customer_id": "id"}),
    "order": EntityKind(kind="order", table="orders", identity="id", noun="order", history="status = 'shipped'",
                        columns={"orders.id": "id", "tickets.order_id": "id", "order_items.order_id": "id"}),
    "ticket": EntityKind(kind="ticket", table="tickets", identity="id", noun="ticket", columns={"tickets.id": "id"}),
})

CRM = EntityMap(server="crm", local=("case",), kinds={
    "customer": EntityKind(kind="customer", table="contacts", identity="email", noun="contact",
                           columns={"contacts.id": "id", "contacts.email": "email", "contacts.name": "name",
                                    "cases.contact_id": "id", "credits.contact_id": "id"}),
    "order": EntityKind(kind="order", table=None, id_column=None, identity="id", noun="order",
                        columns={"cases.order_ref": "id", "credits.order_ref": "id"}),
    "case": EntityKind(kind="case", table="cases", identity="id", noun="case", history="status = 'resolved'",
                       columns={"cases.id": "id", "notes.case_id": "id"}),
})

ENTITY_MAPS: dict[str, EntityMap] = {"shop": SHOP, "crm": CRM}
"""Entity maps of the native environments, by server name."""


def contract_column(args_to_state: Mapping[str, str], arg: str) -> str | None:
    """The first ``table.column`` of a contract's ``args_to_state[arg]`` (``"orders.id; ..."`` -> ``orders.id``)."""
    text = args_to_state.get(arg)
    if not text:
        return None
    m = re.match(r"\s*([A-Za-z_]\w*\.[A-Za-z_]\w*)", text)
    return m.group(1) if m else None


def identity_of(db: sqlite3.Connection, emap: EntityMap, kind: str, attribute: str, value: Any) -> Any:
    """The cross-server identity of the entity whose ``attribute`` is ``value`` on this server (None when the
    server holds no such row). For a kind the server only refers to (no table), ``value`` is the identity."""
    k = emap.kinds[kind]
    if attribute == k.identity or k.table is None:
        return value
    col = next((c.split(".")[1] for c, a in k.columns.items() if a == attribute and c.startswith(k.table + ".")),
               k.id_column)
    row = db.execute(f"SELECT {_identity_column(k)} FROM {k.table} WHERE {col} = ?", (value,)).fetchone()
    return row[0] if row else None


def _identity_column(k: EntityKind) -> str:
    return next(c.split(".")[1] for c, a in k.columns.items() if a == k.identity and c.startswith(f"{k.table}."))
