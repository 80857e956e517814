"""A small shop over SQLite: customers, products, orders and support tickets (native WEFT environment).

The pattern synthesised environments follow (seed: WEFT 4.1, "stateful environment synthesis": a
shared database schema, tool definitions, and contracts = argument -> state mapping, reads, writes,
returns). Tool errors the agent must handle (unknown customer, out of stock, wrong order status)
raise ``ToolError``; every tool is atomic (the runtime commits on return, rolls back on error).

Register with ``Runtime.register(treadle.weft.envs.shop)``; the initial state is
:func:`initial_snapshot`. Tasks and verifiers: :mod:`treadle.weft.envs.shop_tasks`.
"""
from __future__ import annotations

import sqlite3
from typing import Annotated

from pydantic import BaseModel, Field

from treadle.weft.runtime.server import ToolError, WeftServer

SCHEMA = """
CREATE TABLE customers (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    email TEXT NOT NULL UNIQUE
);
CREATE TABLE products (
    sku TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    price_cents INTEGER NOT NULL CHECK (price_cents >= 0),
    stock INTEGER NOT NULL CHECK (stock >= 0)
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(id),
    status TEXT NOT NULL CHECK (status IN ('placed', 'shipped', 'cancelled')),
    total_cents INTEGER NOT NULL
);
CREATE TABLE order_items (
    order_id INTEGER NOT NULL REFERENCES orders(id),
    sku TEXT NOT NULL REFERENCES products(sku),
    qty INTEGER NOT NULL CHECK (qty > 0),
    price_cents INTEGER NOT NULL,
    PRIMARY KEY (order_id, sku)
);
CREATE TABLE tickets (
    id INTEGER PRIMARY KEY,
    customer_id INTEGER NOT NULL REFERENCES customers(id),
    order_id INTEGER REFERENCES orders(id),
    subject TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('open', 'closed')),
    resolution TEXT
);
"""

SEED = """
INSERT INTO customers VALUES (1, 'Ada Lovelace', 'ada@example.com'), (2, 'Alan Turing', 'alan@example.com'),
                             (3, 'Grace Hopper', 'grace@example.com');
INSERT INTO products VALUES ('MUG', 'Enamel mug', 1200, 10), ('TEE', 'Cotton tee', 2500, 3),
                            ('CAP', 'Canvas cap', 1800, 0), ('PEN', 'Fountain pen', 4500, 5);
INSERT INTO orders VALUES (1, 1, 'shipped', 2400), (2, 2, 'placed', 2500);
INSERT INTO order_items VALUES (1, 'MUG', 2, 1200), (2, 'TEE', 1, 2500);
INSERT INTO tickets VALUES (1, 1, 1, 'Mug arrived chipped', 'open', NULL);
"""

server = WeftServer("shop", backend="sqlite", schema=SCHEMA,
                    instructions="A small shop: look up customers and products, place, ship and cancel orders, "
                                 "open and close support tickets.")


class OrderLine(BaseModel):
    """One line of an order."""

    sku: str = Field(description="product SKU, e.g. 'MUG'")
    qty: int = Field(ge=1, le=100, description="quantity, 1..100")


def _customer(db: sqlite3.Connection, customer_id: int) -> dict:
    row = db.execute("SELECT id, name, email FROM customers WHERE id = ?", (customer_id,)).fetchone()
    if row is None:
        raise ToolError(f"no customer with id {customer_id}")
    return {"id": row[0], "name": row[1], "email": row[2]}


def _order(db: sqlite3.Connection, order_id: int) -> dict:
    row = db.execute("SELECT id, customer_id, status, total_cents FROM orders WHERE id = ?", (order_id,)).fetchone()
    if row is None:
        raise ToolError(f"no order with id {order_id}")
    items = [{"sku": s, "qty": q, "price_cents": p} for s, q, p in
             db.execute("SELECT sku, qty, price_cents FROM order_items WHERE order_id = ? ORDER BY sku", (order_id,))]
    return {"id": row[0], "customer_id": row[1], "status": row[2], "total_cents": row[3], "items": items}


@server.tool(reads=("customers",), returns="{id, name, email}", args_to_state={"email": "customers.email"})
def find_customer(db: sqlite3.Connection, email: Annotated[str, Field(description="customer e-mail")]) -> dict:
    """Find a customer by e-mail address."""
    row = db.execute("SELECT id FROM customers WHERE lower(email) = lower(?)", (email.strip(),)).fetchone()
    if row is None:
        raise ToolError(f"no customer with e-mail {email!r}")
    return _customer(db, row[0])


@server.tool(reads=("products",), returns="[{sku, name, price_cents, stock}] matching the query, by SKU")
def search_products(db: sqlite3.Connection,
                    query: Annotated[str, Field(description="substring of name or SKU; '' lists all")] = "") -> list:
    """Search products by name or SKU."""
    q = f"%{query.strip().lower()}%"
    rows = db.execute("SELECT sku, name, price_cents, stock FROM products "
                      "WHERE lower(name) LIKE ? OR lower(sku) LIKE ? ORDER BY sku", (q, q)).fetchall()
    return [{"sku": s, "name": n, "price_cents": p, "stock": k} for s, n, p, k in rows]


@server.tool(reads=("orders", "order_items"), returns="{id, customer_id, status, total_cents, items}",
             args_to_state={"order_id": "orders.id"})
def get_order(db: sqlite3.Connection, order_id: int) -> dict:
    """Get an order with its items."""
    return _order(db, order_id)


@server.tool(reads=("customers", "orders"), returns="[{id, status, total_cents}] of the customer, by id",
             args_to_state={"customer_id": "orders.customer_id"})
def list_orders(db: sqlite3.Connection, customer_id: int) -> list:
    """List a customer's orders."""
    _customer(db, customer_id)
    return [{"id": i, "status": s, "total_cents": t} for i, s, t in
            db.execute("SELECT id, status, total_cents FROM orders WHERE customer_id = ? ORDER BY id", (customer_id,))]


@server.tool(reads=("customers", "products"), writes=("orders", "order_items", "products"),
             returns="{order_id, total_cents}",
             args_to_state={"customer_id": "orders.customer_id",
                            "items": "order_items(sku, qty); products.stock -= qty"})
def place_order(db: sqlite3.Connection, customer_id: int,
                items: Annotated[list[OrderLine], Field(min_length=1, max_length=20)]) -> dict:
    """Place an order; stock is reserved immediately. Fails if a SKU is unknown or out of stock."""
    _customer(db, customer_id)
    skus = [line.sku for line in items]
    if len(set(skus)) != len(skus):
        raise ToolError(f"each SKU may appear once per order, got {skus}")
    total = 0
    priced = []
    for line in items:
        row = db.execute("SELECT price_cents, stock FROM products WHERE sku = ?", (line.sku,)).fetchone()
        if row is None:
            raise ToolError(f"no product with SKU {line.sku!r}")
        if row[1] < line.qty:
            raise ToolError(f"only {row[1]} of {line.sku} in stock, {line.qty} requested")
        total += row[0] * line.qty
        priced.append((line.sku, line.qty, row[0]))
    cur = db.execute("INSERT INTO orders (customer_id, status, total_cents) VALUES (?, 'placed', ?)",
                     (customer_id, total))
    oid = cur.lastrowid
    for sku, qty, price in priced:
        db.execute("INSERT INTO order_items VALUES (?, ?, ?, ?)", (oid, sku, qty, price))
        db.execute("UPDATE products SET stock = stock - ? WHERE sku = ?", (qty, sku))
    return {"order_id": oid, "total_cents": total}


@server.tool(reads=("orders", "order_items"), writes=("orders", "products"), returns="{order_id, status}",
             args_to_state={"order_id": "orders.id; orders.status := 'cancelled'; products.stock += qty"})
def cancel_order(db: sqlite3.Connection, order_id: int) -> dict:
    """Cancel a placed (not yet shipped) order and return its items to stock."""
    order = _order(db, order_id)
    if order["status"] != "placed":
        raise ToolError(f"order {order_id} is {order['status']}; only placed orders can be cancelled")
    db.execute("UPDATE orders SET status = 'cancelled' WHERE id = ?", (order_id,))
    for it in order["items"]:
        db.execute("UPDATE products SET stock = stock + ? WHERE sku = ?", (it["qty"], it["sku"]))
    return {"order_id": order_id, "status": "cancelled"}


@server.tool(reads=("orders",), writes=("orders",), returns="{order_id, status}",
             args_to_state={"order_id": "orders.id; orders.status := 'shipped'"})
def ship_order(db: sqlite3.Connection, order_id: int) -> dict:
    """Mark a placed order as shipped."""
    order = _order(db, order_id)
    if order["status"] != "placed":
        raise ToolError(f"order {order_id} is {order['status']}; only placed orders can be shipped")
    db.execute("UPDATE orders SET status = 'shipped' WHERE id = ?", (order_id,))
    return {"order_id": order_id, "status": "shipped"}


@server.tool(reads=("customers", "orders"), writes=("tickets",), returns="{ticket_id}",
             args_to_state={"customer_id": "tickets.customer_id", "order_id": "tickets.order_id",
                            "subject": "tickets.subject"})
def open_ticket(db: sqlite3.Connection, customer_id: int, subject: Annotated[str, Field(min_length=3, max_length=200)],
                order_id: int | None = None) -> dict:
    """Open a support ticket for a customer, optionally about one of their orders."""
    _customer(db, customer_id)
    if order_id is not None and _order(db, order_id)["customer_id"] != customer_id:
        raise ToolError(f"order {order_id} does not belong to customer {customer_id}")
    cur = db.execute("INSERT INTO tickets (customer_id, order_id, subject, status) VALUES (?, ?, ?, 'open')",
                     (customer_id, order_id, subject))
    return {"ticket_id": cur.lastrowid}


@server.tool(reads=("tickets",), writes=("tickets",), returns="{ticket_id, status}",
             args_to_state={"ticket_id": "tickets.id; tickets.status := 'closed'", "resolution": "tickets.resolution"})
def close_ticket(db: sqlite3.Connection, ticket_id: int,
                 resolution: Annotated[str, Field(min_length=3, max_length=500)]) -> dict:
    """Close an open ticket with a resolution note."""
    row = db.execute("SELECT status FROM tickets WHERE id = ?", (ticket_id,)).fetchone()
    if row is None:
        raise ToolError(f"no ticket with id {ticket_id}")
    if row[0] != "open":
        raise ToolError(f"ticket {ticket_id} is already {row[0]}")
    db.execute("UPDATE tickets SET status = 'closed', resolution = ? WHERE id = ?", (resolution, ticket_id))
    return {"ticket_id": ticket_id, "status": "closed"}


def initial_snapshot():
    """The shop's seed state as an immutable SQLite snapshot (3 customers, 4 products, 2 orders, 1 ticket)."""
    from treadle.weft.runtime.sqlite_state import snapshot_from_sql

    return snapshot_from_sql(SCHEMA, SEED)
