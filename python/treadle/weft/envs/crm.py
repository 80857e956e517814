"""A customer-support CRM over SQLite: contacts, cases, case notes and store credits (native WEFT environment).

The second native environment: its entities overlap the shop's (:mod:`treadle.weft.envs.shop`), so
cross-server composition, entity binding and grounding run offline on real environments (seed:
WEFT 4.1, "composition across servers"). The shared business objects are keyed the way two real
systems would share them: a CRM *contact* is the shop *customer* with the same e-mail (the CRM has
its own ids, ``C-001``...), and a case or credit names a shop order by its number (``order_ref``;
the CRM cannot read the shop's database, so the reference is only as good as the grounding).

Tool errors the agent must handle raise ``ToolError``; every tool is atomic (the runtime commits on
return, rolls back on error). Register with ``Runtime.register(treadle.weft.envs.crm)``; the seed
state is :func:`initial_snapshot`. Atomic tasks: :mod:`treadle.weft.envs.crm_tasks`.
"""
from __future__ import annotations

import sqlite3
from typing import Annotated, Literal

from pydantic import Field

from treadle.weft.runtime.server import ToolError, WeftServer

SCHEMA = """
CREATE TABLE contacts (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    email TEXT NOT NULL UNIQUE,
    tier TEXT NOT NULL CHECK (tier IN ('standard', 'vip'))
);
CREATE TABLE cases (
    id INTEGER PRIMARY KEY,
    contact_id TEXT NOT NULL REFERENCES contacts(id),
    order_ref INTEGER,
    topic TEXT NOT NULL,
    priority TEXT NOT NULL CHECK (priority IN ('low', 'normal', 'high')),
    status TEXT NOT NULL CHECK (status IN ('new', 'pending', 'resolved')),
    resolution TEXT
);
CREATE TABLE notes (
    id INTEGER PRIMARY KEY,
    case_id INTEGER NOT NULL REFERENCES cases(id),
    body TEXT NOT NULL
);
CREATE TABLE credits (
    id INTEGER PRIMARY KEY,
    contact_id TEXT NOT NULL REFERENCES contacts(id),
    order_ref INTEGER,
    amount_cents INTEGER NOT NULL CHECK (amount_cents > 0),
    reason TEXT NOT NULL
);
"""

SEED = """
INSERT INTO contacts VALUES ('C-001', 'Ada Lovelace', 'ada@example.com', 'vip'),
                            ('C-002', 'Alan Turing', 'alan@example.com', 'standard'),
                            ('C-003', 'Grace Hopper', 'grace@example.com', 'standard'),
                            ('C-004', 'Katherine Johnson', 'katherine@example.com', 'standard');
INSERT INTO cases VALUES (1, 'C-001', 1, 'Mug arrived chipped', 'normal', 'new', NULL),
                         (2, 'C-004', NULL, 'Newsletter sign-up', 'low', 'resolved', 'Subscribed');
INSERT INTO notes VALUES (1, 1, 'Customer sent a photo of the chipped mug.');
"""

MAX_CREDIT_CENTS = 10_000
"""Largest store credit one call may issue (cents)."""

server = WeftServer("crm", backend="sqlite", schema=SCHEMA,
                    instructions="A customer-support CRM: look up contacts, open, annotate, escalate and resolve "
                                 "support cases about shop orders, and issue store credits.")


def _contact(db: sqlite3.Connection, contact_id: str) -> dict:
    row = db.execute("SELECT id, name, email, tier FROM contacts WHERE id = ?", (contact_id,)).fetchone()
    if row is None:
        raise ToolError(f"no contact with id {contact_id!r}")
    return {"id": row[0], "name": row[1], "email": row[2], "tier": row[3]}


def _case(db: sqlite3.Connection, case_id: int) -> dict:
    row = db.execute("SELECT id, contact_id, order_ref, topic, priority, status, resolution FROM cases WHERE id = ?",
                     (case_id,)).fetchone()
    if row is None:
        raise ToolError(f"no case with id {case_id}")
    notes = [b for (b,) in db.execute("SELECT body FROM notes WHERE case_id = ? ORDER BY id", (case_id,))]
    return dict(zip(("id", "contact_id", "order_ref", "topic", "priority", "status", "resolution"), row),
                notes=notes)


def _open_case(db: sqlite3.Connection, case_id: int) -> dict:
    case = _case(db, case_id)
    if case["status"] == "resolved":
        raise ToolError(f"case {case_id} is resolved; reopen it by opening a new case")
    return case


@server.tool(reads=("contacts",), returns="{id, name, email, tier}", args_to_state={"email": "contacts.email"})
def find_contact(db: sqlite3.Connection, email: Annotated[str, Field(description="contact e-mail")]) -> dict:
    """Find a contact by e-mail address."""
    row = db.execute("SELECT id FROM contacts WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()
    if row is None:
        raise ToolError(f"no contact with e-mail {email!r}")
    return _contact(db, row[0])


@server.tool(reads=("contacts", "cases"), returns="[{id, order_ref, topic, priority, status}] of the contact, by id",
             args_to_state={"contact_id": "cases.contact_id"})
def list_cases(db: sqlite3.Connection, contact_id: str) -> list:
    """List a contact's support cases."""
    _contact(db, contact_id)
    return [{"id": i, "order_ref": o, "topic": t, "priority": p, "status": s} for i, o, t, p, s in
            db.execute("SELECT id, order_ref, topic, priority, status FROM cases WHERE contact_id = ? ORDER BY id",
                       (contact_id,))]


@server.tool(reads=("cases", "notes"), returns="{id, contact_id, order_ref, topic, priority, status, resolution, notes}",
             args_to_state={"case_id": "cases.id"})
def get_case(db: sqlite3.Connection, case_id: int) -> dict:
    """Get a case with its notes."""
    return _case(db, case_id)


@server.tool(reads=("contacts",), writes=("cases",), returns="{case_id}",
             args_to_state={"contact_id": "cases.contact_id", "order_ref": "cases.order_ref",
                            "topic": "cases.topic", "priority": "cases.priority"})
def open_case(db: sqlite3.Connection, contact_id: str, topic: Annotated[str, Field(min_length=3, max_length=200)],
              order_ref: Annotated[int | None, Field(description="the shop order number, if any")] = None,
              priority: Literal["low", "normal", "high"] = "normal") -> dict:
    """Open a support case for a contact, optionally about a shop order."""
    _contact(db, contact_id)
    cur = db.execute("INSERT INTO cases (contact_id, order_ref, topic, priority, status) VALUES (?, ?, ?, ?, 'new')",
                     (contact_id, order_ref, topic, priority))
    return {"case_id": cur.lastrowid}


@server.tool(reads=("cases",), writes=("notes", "cases"), returns="{case_id, status}",
             args_to_state={"case_id": "notes.case_id; cases.status := 'pending'", "body": "notes.body"})
def add_note(db: sqlite3.Connection, case_id: int, body: Annotated[str, Field(min_length=3, max_length=1000)]) -> dict:
    """Add a note to an unresolved case (a new case becomes pending)."""
    _open_case(db, case_id)
    db.execute("INSERT INTO notes (case_id, body) VALUES (?, ?)", (case_id, body))
    db.execute("UPDATE cases SET status = 'pending' WHERE id = ? AND status = 'new'", (case_id,))
    return {"case_id": case_id, "status": _case(db, case_id)["status"]}


@server.tool(reads=("cases",), writes=("cases",), returns="{case_id, priority}",
             args_to_state={"case_id": "cases.id; cases.priority := 'high'"})
def escalate_case(db: sqlite3.Connection, case_id: int) -> dict:
    """Raise an unresolved case's priority to high."""
    case = _open_case(db, case_id)
    if case["priority"] == "high":
        raise ToolError(f"case {case_id} is already high priority")
    db.execute("UPDATE cases SET priority = 'high' WHERE id = ?", (case_id,))
    return {"case_id": case_id, "priority": "high"}


@server.tool(reads=("cases",), writes=("cases",), returns="{case_id, status}",
             args_to_state={"case_id": "cases.id; cases.status := 'resolved'", "resolution": "cases.resolution"})
def resolve_case(db: sqlite3.Connection, case_id: int,
                 resolution: Annotated[str, Field(min_length=3, max_length=500)]) -> dict:
    """Resolve an open case with a resolution note."""
    _open_case(db, case_id)
    db.execute("UPDATE cases SET status = 'resolved', resolution = ? WHERE id = ?", (resolution, case_id))
    return {"case_id": case_id, "status": "resolved"}


@server.tool(reads=("contacts", "credits"), writes=("credits",), returns="{credit_id, amount_cents}",
             args_to_state={"contact_id": "credits.contact_id", "order_ref": "credits.order_ref",
                            "amount_cents": "credits.amount_cents", "reason": "credits.reason"})
def issue_credit(db: sqlite3.Connection, contact_id: str,
                 amount_cents: Annotated[int, Field(ge=1, description="store credit in cents")],
                 reason: Annotated[str, Field(min_length=3, max_length=200)],
                 order_ref: Annotated[int | None, Field(description="the shop order number, if any")] = None) -> dict:
    """Issue a store credit to a contact (at most MAX_CREDIT_CENTS per call; once per order)."""
    _contact(db, contact_id)
    if amount_cents > MAX_CREDIT_CENTS:
        raise ToolError(f"a credit is at most {MAX_CREDIT_CENTS} cents, got {amount_cents}")
    if order_ref is not None and db.execute("SELECT 1 FROM credits WHERE order_ref = ?", (order_ref,)).fetchone():
        raise ToolError(f"order {order_ref} already has a credit")
    cur = db.execute("INSERT INTO credits (contact_id, order_ref, amount_cents, reason) VALUES (?, ?, ?, ?)",
                     (contact_id, order_ref, amount_cents, reason))
    return {"credit_id": cur.lastrowid, "amount_cents": amount_cents}


@server.tool(reads=("contacts",), writes=("contacts",), returns="{id, tier}",
             args_to_state={"contact_id": "contacts.id; contacts.tier := tier", "tier": "contacts.tier"})
def set_tier(db: sqlite3.Connection, contact_id: str, tier: Literal["standard", "vip"]) -> dict:
    """Set a contact's service tier."""
    c = _contact(db, contact_id)
    if c["tier"] == tier:
        raise ToolError(f"contact {contact_id} is already {tier}")
    db.execute("UPDATE contacts SET tier = ? WHERE id = ?", (tier, contact_id))
    return {"id": contact_id, "tier": tier}


def initial_snapshot():
    """The CRM's seed state as an immutable SQLite snapshot (4 contacts, 2 cases, 1 note, no credits)."""
    from treadle.weft.runtime.sqlite_state import snapshot_from_sql

    return snapshot_from_sql(SCHEMA, SEED)
