"""Offline math backend, part 1: tasks as symbolic specifications and skills as composable
transformations (seed: RSI section 4.2, "programmatic backend").

A :class:`MathTask` holds an expression tree (``int`` leaves, the variable ``"x"``, and
``[op, left, right]`` nodes with ``op`` in ``+-*/``), a kind (``eval``: compute the expression;
``solve``: solve ``lhs = rhs`` for x), distractor clauses, and the generator's reference answer.
Primitive transformations (:data:`PRIMITIVES`) each make a task harder in one measurable way; a
skill's ``method`` is a sequence of primitive names. Some primitives can produce invalid tasks (a
non-integer answer, a huge value, an equation without a unique solution): that is what Verify and
Revise are for. Everything here is deterministic for a :class:`random.Random`.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "PRIMITIVES",
    "MathTask",
    "NotApplicable",
    "SeedError",
    "apply_method",
    "evaluate_tree",
    "load_seed_file",
    "make_seeds",
    "parse_seed_expression",
    "render_expr",
]

_NAMES = ("Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Ivy")
_THINGS = ("pens", "cats", "books", "cups", "apples", "coins", "hats", "keys")
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


class SeedError(ValueError):
    """A seed file or seed list that cannot be used (empty, duplicated ids, unparsable expression)."""


class NotApplicable(Exception):
    """A primitive does not apply to this task (e.g. ``to_equation`` on an equation)."""


class MathTask(BaseModel):
    """One synthesised task in a seed chain (frozen)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    seed_id: str
    """Id of the seed this chain started from."""
    kind: Literal["eval", "solve"] = "eval"
    """``eval``: compute the expression; ``solve``: solve ``tree = rhs`` for x."""
    tree: Any
    """Expression tree (JSON: ints, ``"x"``, ``[op, left, right]``)."""
    x_value: int | None = None
    """The generator's value of x (``solve`` only)."""
    distractors: tuple[str, ...] = ()
    """Irrelevant clauses placed before the question."""
    answer: str
    """The generator's reference answer (checked independently by the verifier)."""
    skills_used: tuple[str, ...] = ()
    """Skill names applied since the seed, in order."""

    @property
    def text(self) -> str:
        """The problem as the solver sees it."""
        pre = " ".join(self.distractors) + (" " if self.distractors else "")
        if self.kind == "eval":
            return f"{pre}Compute {render_expr(self.tree)}."
        try:
            rhs = _frac(evaluate_tree(self.tree, Fraction(self.x_value)))
        except ZeroDivisionError:
            rhs = "undefined"  # the verifier rejects it
        return f"{pre}Solve {render_expr(self.tree)}={rhs} for x."

    @property
    def key(self) -> str:
        """sha256 (16 hex) of the canonical task content (kind, tree, distractors, answer)."""
        body = json.dumps([self.kind, self.tree, self.x_value, list(self.distractors), self.answer])
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def features(self) -> dict[str, int]:
        """Size features: operations, max operand digits, parenthesis depth, distractors, is-equation."""
        return {"ops": _count_ops(self.tree), "digits": _max_digits(self.tree),
                "depth": _paren_depth(render_expr(self.tree)), "distractors": len(self.distractors),
                "solve": int(self.kind == "solve")}


def _frac(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def evaluate_tree(tree, x: Fraction | None = None) -> Fraction:
    """Exact value of a tree (ZeroDivisionError on division by zero; ValueError for x without a value)."""
    if isinstance(tree, bool):
        raise TypeError("booleans are not expression leaves")
    if isinstance(tree, int):
        return Fraction(tree)
    if tree == "x":
        if x is None:
            raise ValueError("the tree contains x but no value was given")
        return x
    op, a, b = tree
    va, vb = evaluate_tree(a, x), evaluate_tree(b, x)
    if op == "+":
        return va + vb
    if op == "-":
        return va - vb
    if op == "*":
        return va * vb
    if vb == 0:
        raise ZeroDivisionError("division by zero in the expression")
    return va / vb


def render_expr(tree, parent: str | None = None, right: bool = False) -> str:
    """Infix text with the parentheses precedence needs (no spaces), e.g. ``48-(63+43)``."""
    if isinstance(tree, (int, str)):
        return str(tree)
    op, a, b = tree
    s = f"{render_expr(a, op, False)}{op}{render_expr(b, op, True)}"
    if parent is not None and (_PREC[op] < _PREC[parent] or (right and _PREC[op] == _PREC[parent]
                                                              and parent in "-/")):
        s = f"({s})"
    return s


def _count_ops(t) -> int:
    return 0 if not isinstance(t, list) else 1 + _count_ops(t[1]) + _count_ops(t[2])


def _max_digits(t) -> int:
    if isinstance(t, int):
        return len(str(abs(t)))
    if isinstance(t, str):
        return 0
    return max(_max_digits(t[1]), _max_digits(t[2]))


def _paren_depth(s: str) -> int:
    d = best = 0
    for c in s:
        d += (c == "(") - (c == ")")
        best = max(best, d)
    return best


def _leaves(t, path=()):
    if isinstance(t, list):
        yield from _leaves(t[1], path + (1,))
        yield from _leaves(t[2], path + (2,))
    else:
        yield path, t


def _replace(t, path, new):
    if not path:
        return new
    t = list(t)
    t[path[0]] = _replace(t[path[0]], path[1:], new)
    return t


def _with(task: MathTask, tree=None, **kw) -> MathTask:
    tree = task.tree if tree is None else tree
    kind = kw.pop("kind", task.kind)
    xv = kw.pop("x_value", task.x_value)
    if kind == "eval":
        try:
            ans = _frac(evaluate_tree(tree))
        except ZeroDivisionError:
            ans = "undefined"
    else:
        ans = str(xv)
    return task.model_copy(update={"tree": tree, "kind": kind, "x_value": xv, "answer": ans, **kw})


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0, 9) if digits <= 1 else rng.randint(10 ** (digits - 1), 10 ** digits - 1)


# --- primitives: (task, rng) -> harder task ------------------------------------------------------------
def add_term(task: MathTask, rng: random.Random) -> MathTask:
    """``E`` -> ``E ± k`` with k as wide as the widest operand (one more operation)."""
    return _with(task, [rng.choice("+-"), task.tree, _operand(rng, max(1, _max_digits(task.tree)))])


def widen_digits(task: MathTask, rng: random.Random) -> MathTask:
    """One integer operand gets one more digit."""
    ints = [(p, v) for p, v in _leaves(task.tree) if isinstance(v, int)]
    if not ints:
        raise NotApplicable("no integer operand to widen")
    p, v = rng.choice(ints)
    return _with(task, _replace(task.tree, p, _operand(rng, len(str(abs(v))) + 1)))


def multiply(task: MathTask, rng: random.Random) -> MathTask:
    """``E`` -> ``(E)*k`` with k in 2..9 (one more operation, usually one more parenthesis level)."""
    return _with(task, ["*", task.tree, rng.randint(2, 9)])


def expand_leaf(task: MathTask, rng: random.Random) -> MathTask:
    """An operand n -> ``a*b-m`` (or ``a*b+m``) with the same value (two more operations)."""
    ints = [(p, v) for p, v in _leaves(task.tree) if isinstance(v, int)]
    if not ints:
        raise NotApplicable("no integer operand to expand")
    p, n = rng.choice(ints)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    m = a * b - n
    node = ["-", ["*", a, b], m] if m >= 0 else ["+", ["*", a, b], -m]
    return _with(task, _replace(task.tree, p, node))


def divide(task: MathTask, rng: random.Random) -> MathTask:
    """``E`` -> ``(E)/k`` with k in 2..9 (may leave a non-integer answer: an invalid task)."""
    return _with(task, ["/", task.tree, rng.randint(2, 9)])


def to_equation(task: MathTask, rng: random.Random) -> MathTask:
    """Hide one operand as x: ``E`` with value v -> ``E[x] = v``, solve for x (a zero factor next to x
    leaves no unique solution: an invalid task)."""
    if task.kind != "eval":
        raise NotApplicable("already an equation")
    ints = [(p, v) for p, v in _leaves(task.tree) if isinstance(v, int)]
    if not ints:
        raise NotApplicable("no operand to hide")
    p, v = rng.choice(ints)
    return _with(task, _replace(task.tree, p, "x"), kind="solve", x_value=v)


def add_distractor(task: MathTask, rng: random.Random) -> MathTask:
    """One more irrelevant clause before the question."""
    clause = f"{rng.choice(_NAMES)} has {rng.randint(2, 9)} {rng.choice(_THINGS)}."
    return task.model_copy(update={"distractors": (*task.distractors, clause)})


PRIMITIVES: dict[str, Callable[[MathTask, random.Random], MathTask]] = {
    f.__name__: f for f in (add_term, widen_digits, multiply, expand_leaf, divide, to_equation, add_distractor)}


def apply_method(task: MathTask, method: tuple[str, ...], rng: random.Random, skill: str) -> MathTask:
    """Apply the primitives of ``method`` in order and record ``skill`` in ``skills_used``.

    Raises:
        KeyError: an unknown primitive name. NotApplicable: a primitive does not apply.
    """
    for name in method:
        if name not in PRIMITIVES:
            raise KeyError(f"unknown primitive {name!r}; known: {sorted(PRIMITIVES)}")
        task = PRIMITIVES[name](task, rng)
    return task.model_copy(update={"skills_used": (*task.skills_used, skill)})


# --- seeds -----------------------------------------------------------------------------------------------
def parse_seed_expression(text: str):
    """An integer expression (``+ - * /``, parentheses) -> tree; SeedError if it is anything else."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise SeedError(f"seed expression {text!r} does not parse: {err.msg}") from None
    ops = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}

    def conv(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return [ops[type(n.op)], conv(n.left), conv(n.right)]
        raise SeedError(f"seed expression {text!r}: only non-negative integers, + - * / and parentheses allowed")
    return conv(node)


def make_seeds(n: int, seed: int = 0, prefix: str = "s") -> list[MathTask]:
    """``n`` easy seed tasks (``a±b`` with one-digit operands), deterministic for ``seed``."""
    if n < 1:
        raise SeedError(f"need at least one seed, got n={n}")
    rng = random.Random(f"seeds:{seed}")
    return [_with(MathTask(seed_id=f"{prefix}{i}", tree=[rng.choice("+-"), rng.randint(0, 9), rng.randint(0, 9)],
                           answer="0"))
            for i in range(n)]


def load_seed_file(path) -> list[MathTask]:
    """Seeds from JSONL lines ``{"id": str, "expression": "3+4"}``.

    Raises:
        SeedError: missing/empty/unreadable file or a folder, a line that is not such an object, an expression
            that is not an integer expression or divides by zero, duplicated ids (file and line named).
    """
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        raise SeedError(f"seed file {str(p)!r} is a folder; expected a JSONL file")
    if not p.is_file():
        raise SeedError(f"seed file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SeedError(f"seed file {str(p)!r} cannot be read as UTF-8 JSONL: {err}") from None
    tasks, seen = [], {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise SeedError(f"{p}:{i}: not JSON ({err.msg}); expected {{\"id\": ..., \"expression\": ...}}") from None
        if not (isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(rec.get("expression"), str)):
            raise SeedError(f"{p}:{i}: expected an object with string fields 'id' and 'expression', got {line[:80]!r}")
        if rec["id"] in seen:
            raise SeedError(f"{p}:{i}: duplicated seed id {rec['id']!r} (first on line {seen[rec['id']]})")
        seen[rec["id"]] = i
        try:
            tree = parse_seed_expression(rec["expression"])
            evaluate_tree(tree)
        except SeedError as err:
            raise SeedError(f"{p}:{i}: {err}") from None
        except ZeroDivisionError:
            raise SeedError(f"{p}:{i}: seed expression {rec['expression']!r} divides by zero") from None
        tasks.append(_with(MathTask(seed_id=rec["id"], tree=tree, answer="0")))
    if not tasks:
        raise SeedError(f"seed file {str(p)!r} has no seeds")
    return tasks
