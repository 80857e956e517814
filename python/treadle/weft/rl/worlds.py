"""Shop worlds with drawn entities, and the task templates of the tiny tool policy.

Each :class:`Episode` is a fresh shop database (the real :mod:`treadle.weft.envs.shop` schema, seeded
with drawn customers, products, orders and tickets) and a two-turn :class:`RolloutTask` whose atomic
turns carry gold calls with concrete ids (the ids the database will assign are known when it is
drawn). Templates:

- ``order-ship``: find the customer by e-mail and place an order; then ship that order (the new order
  id is only in the previous turn's tool output).
- ``lookup-cancel``: find the customer and list their orders; then cancel the placed one (its id is only
  in the listed orders).
- ``ticket``: open a ticket for a customer about an order; then close it (the ticket id is only in
  the previous tool output).

Split: ``heldout`` episodes draw customers' names, products' SKUs and order quantities from pools
disjoint from ``train`` (unseen customers, products and amounts), so held-out success measures
copying from the conversation rather than memorised values.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Literal

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.tasks import AtomicTask, RolloutTask
from treadle.weft.runtime.verify import CheckpointSpec

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
TEMPLATES = ("order-ship", "lookup-cancel", "ticket")

_FIRST = ["Ada", "Alan", "Grace", "Linus", "Barbara", "Edsger", "Donald", "Frances", "Ken", "Dennis", "Margaret",
          "John", "Radia", "Tim", "Sophie", "Guido", "Bjarne", "Anita", "Niklaus", "Leslie", "Hedy", "Claude",
          "Joan", "Robin", "Shafi", "Judea", "Yann", "Fei", "Ivan", "Carl"]
_LAST = ["Lovelace", "Turing", "Hopper", "Torvalds", "Liskov", "Dijkstra", "Knuth", "Allen", "Thompson", "Ritchie",
         "Hamilton", "Backus", "Perlman", "Lee", "Wilson", "Rossum", "Stroustrup", "Borg", "Wirth", "Lamport",
         "Lamarr", "Shannon", "Clarke", "Milner", "Goldwasser", "Pearl", "Lecun", "Li", "Sutherland", "Gauss"]
_DOMAINS = ["mail.io", "shop.net", "post.org"]
_SUBJECTS = ["late box", "wrong size", "broken lid", "bad color", "missing part", "torn bag", "no invoice"]
_RESOLUTIONS = ["refund sent", "item resent", "coupon given", "fixed now", "part shipped"]
_QTY = {"train": (1, 2, 3, 5, 6, 8), "heldout": (4, 7, 9)}


def _heldout_name(i: int) -> bool:
    return i % 5 == 4  # every fifth first and last name is held out


def _pool(names: list[str], split: Split) -> list[str]:
    return [n for i, n in enumerate(names) if _heldout_name(i) == (split == "heldout")]


def _sku(rng: random.Random, split: Split) -> str:
    first = rng.choice("ABCDEFGHIJKLMNOP" if split == "train" else "QRSTUVWXYZ")
    return first + "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(2))


@dataclass(frozen=True)
class Episode:
    """One drawn world and its task.

    Attributes:
        task: the two-turn rollout task (env ``"shop"``); gold calls carry concrete ids.
        seed_sql: INSERT statements of the world (run after :data:`treadle.weft.envs.shop.SCHEMA`).
        split: ``train`` or ``heldout``; template: the template name; seed: the draw's seed.
    """

    task: RolloutTask
    seed_sql: str
    split: Split
    template: str
    seed: int

    def snapshot(self):
        """The world's initial state (an immutable SQLite snapshot of the shop schema)."""
        from treadle.weft.envs import shop
        from treadle.weft.runtime.sqlite_state import snapshot_from_sql

        return snapshot_from_sql(shop.SCHEMA, self.seed_sql)

    @property
    def key(self) -> str:
        """Hash of the task and the world (a group key component)."""
        return hashlib.sha256(json.dumps([self.task.key, self.seed_sql]).encode()).hexdigest()[:16]


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


def _atomic(name: str, request: str, calls: list[ToolCall], prev: str | None, **kw) -> AtomicTask:
    return AtomicTask(name=name, request=request, depends_on=(prev,) if prev else (),
                      checkpoint=CheckpointSpec(name=name, gold_calls=calls, **kw))


def draw_episode(seed: int, split: Split = "train", template: str | None = None) -> Episode:
    """Draw one world and task (deterministic in ``(seed, split, template)``).

    Raises:
        ValueError: unknown ``split`` or ``template``.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rng = random.Random(f"shop-world|{split}|{seed}")
    template = template if template is not None else rng.choice(TEMPLATES)
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    firsts, lasts = _pool(_FIRST, split), _pool(_LAST, split)
    cids = rng.sample(range(10, 100), 3)
    customers = []
    used_emails = set()
    for cid in cids:
        while True:
            f, last = rng.choice(firsts), rng.choice(lasts)
            email = f"{f.lower()}{rng.randint(1, 99)}@{rng.choice(_DOMAINS)}"
            if email not in used_emails:
                used_emails.add(email)
                break
        customers.append((cid, f"{f} {last}", email))
    skus = []
    while len(skus) < 3:
        s = _sku(rng, split)
        if s not in skus:
            skus.append(s)
    products = [(s, rng.randrange(100, 5000, 50), rng.randint(10, 30)) for s in skus]
    me = customers[0]
    oid0 = rng.randint(100, 800)
    # two orders of the customer (one placed, one shipped, in random order) and one of another customer
    statuses = ["placed", "shipped"]
    rng.shuffle(statuses)
    orders = [(oid0, me[0], statuses[0], products[0]), (oid0 + 1, me[0], statuses[1], products[1]),
              (oid0 + 2, customers[1][0], "placed", products[2])]
    tid0 = rng.randint(10, 90)
    sql = ["INSERT INTO customers VALUES " + ", ".join(f"({c}, {_sql_str(n)}, {_sql_str(e)})" for c, n, e in customers) + ";",
           "INSERT INTO products VALUES " + ", ".join(f"({_sql_str(s)}, 'item {s.lower()}', {p}, {k})"
                                                      for s, p, k in products) + ";",
           "INSERT INTO orders VALUES " + ", ".join(f"({o}, {c}, '{st}', {p[1]})" for o, c, st, p in orders) + ";",
           "INSERT INTO order_items VALUES " + ", ".join(f"({o}, {_sql_str(p[0])}, 1, {p[1]})"
                                                         for o, _, _, p in orders) + ";",
           f"INSERT INTO tickets VALUES ({tid0}, {customers[2][0]}, NULL, 'old issue', 'closed', 'done');"]
    new_oid, new_tid = oid0 + 3, tid0 + 1
    name = f"{template}-{split}-{seed}"
    if template == "order-ship":
        sku = rng.choice(skus)
        qty = rng.choice(_QTY[split])
        t1 = _atomic("order", f"Hi, I'm {me[2]}. Please order {qty} {sku}.",
                     [_call("find_customer", email=me[2]),
                      _call("place_order", customer_id=me[0], items=[{"sku": sku, "qty": qty}])], None)
        t2 = _atomic("ship", "Now ship that order.", [_call("ship_order", order_id=new_oid)], "order")
    elif template == "lookup-cancel":
        placed = next(o for o in orders if o[1] == me[0] and o[2] == "placed")
        t1 = _atomic("lookup", f"I'm {me[2]}. What are my orders?",
                     [_call("find_customer", email=me[2]), _call("list_orders", customer_id=me[0])], None)
        t2 = _atomic("cancel", "Cancel the placed one.", [_call("cancel_order", order_id=placed[0])], "lookup")
    else:
        subject, resolution = rng.choice(_SUBJECTS), rng.choice(_RESOLUTIONS)
        oid = next(o[0] for o in orders if o[1] == me[0])
        t1 = _atomic("open", f"Customer {me[0]}: open a ticket '{subject}' about order {oid}.",
                     [_call("open_ticket", customer_id=me[0], subject=subject, order_id=oid)], None)
        t2 = _atomic("close", f"Close it: {resolution}.",
                     [_call("close_ticket", ticket_id=new_tid, resolution=resolution)], "open")
    task = RolloutTask(name=name, env="shop", atomic=(t1, t2))
    return Episode(task=task, seed_sql="\n".join(sql), split=split, template=template, seed=seed)


def episodes(n: int, split: Split = "train", *, start: int = 0) -> list[Episode]:
    """``n`` episodes with seeds ``start .. start + n - 1`` (templates cycle, so every template is present).

    Raises:
        ValueError: ``n < 0`` or a bad ``split``.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return [draw_episode(start + i, split, TEMPLATES[(start + i) % len(TEMPLATES)]) for i in range(n)]
