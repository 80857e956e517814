"""Arithmetic and small-algebra problems with difficulty knobs and verified answers.

A problem is built from a :class:`Difficulty` (digits per operand, number of operations, nesting
depth of parentheses, distractor clauses, ``kind`` = ``"arithmetic"`` or ``"linear"``) or from one of
the preset :data:`LEVELS` (1 = easiest). Every answer is *verified* at generation time by an
evaluator independent of the construction: the rendered text is parsed back with :mod:`ast` and
evaluated in exact rational arithmetic (for ``linear`` problems the solution is substituted back
into the rendered equation). Checking a model's answer is :mod:`treadle.data.verify`'s job
(``math-verify``), never a parser of ours.

Problems are frozen dataclasses; everything here is deterministic for a seed.
"""
from __future__ import annotations

import ast
import hashlib
import random
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = ["Difficulty", "LEVELS", "Problem", "ProblemGenerator", "difficulty", "generate_problems",
           "evaluate_expression", "problem_uid"]

_OPS = frozenset("+-*")
_KINDS = ("arithmetic", "linear")
_NAMES = ("Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Ivy")
_THINGS = ("pens", "cats", "books", "cups", "apples", "coins", "hats", "keys")
#: question phrasings; the held-out split is by prompt text, so a held-out prompt's arithmetic core
#: may appear in training under another phrasing (unavoidable for level 1: only 200 distinct sums).
_ASK = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "{e}=?")
_SOLVE = ("Solve {e} for x.", "Find x if {e}.", "{e}. What is x?")


@dataclass(frozen=True)
class Difficulty:
    """Knobs of one problem family.

    Attributes:
        digits: digits per operand, >= 1 (1: operands 0..9; d >= 2: operands 10^(d-1)..10^d - 1).
        ops: number of binary operations, >= 1 (for ``linear``: 1 -> ``x+b=c``, >= 2 -> ``a*x+b=c``).
        depth: nesting depth of parentheses, 0 <= depth <= ops - 1 (``arithmetic``) or <= 1 (``linear``).
        distractors: irrelevant clauses placed before the question, >= 0.
        operators: operators to draw from, a non-empty subset of ``"+-*"``.
        mul_digits: digits of a multiplication's right operand (keeps products short), >= 1.
        kind: ``"arithmetic"`` (evaluate an expression) or ``"linear"`` (solve a linear equation for x).
    """

    digits: int = 1
    ops: int = 1
    depth: int = 0
    distractors: int = 0
    operators: str = "+-"
    mul_digits: int = 1
    kind: str = "arithmetic"

    def __post_init__(self) -> None:
        for name in ("digits", "ops", "depth", "distractors", "mul_digits"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"Difficulty.{name} must be an int, got {type(v).__name__}")
        if not 1 <= self.digits <= 9:
            raise ValueError(f"Difficulty.digits must be in [1, 9], got {self.digits}")
        if not 1 <= self.ops <= 8:
            raise ValueError(f"Difficulty.ops must be in [1, 8], got {self.ops}")
        if not 1 <= self.mul_digits <= 9:
            raise ValueError(f"Difficulty.mul_digits must be in [1, 9], got {self.mul_digits}")
        if self.distractors < 0 or self.distractors > 8:
            raise ValueError(f"Difficulty.distractors must be in [0, 8], got {self.distractors}")
        if self.kind not in _KINDS:
            raise ValueError(f"Difficulty.kind must be one of {_KINDS}, got {self.kind!r}")
        max_depth = 1 if self.kind == "linear" else self.ops - 1
        if not 0 <= self.depth <= max_depth:
            raise ValueError(f"Difficulty.depth must be in [0, {max_depth}] for kind={self.kind!r} with "
                             f"ops={self.ops}, got {self.depth}")
        if not isinstance(self.operators, str) or not self.operators or not set(self.operators) <= _OPS:
            raise ValueError(f"Difficulty.operators must be a non-empty subset of '+-*', got {self.operators!r}")


#: Preset difficulty levels, ordered by how hard the tiny default model finds them (level n is
#: ``LEVELS[n - 1]``): it solves level 1 reliably, levels 2-4 partly, and fails 5-6.
LEVELS: tuple[Difficulty, ...] = (
    Difficulty(digits=1, ops=1, operators="+-"),                                   # 7+5
    Difficulty(digits=1, ops=2, operators="+-", kind="linear"),                    # 3*x+4=19
    Difficulty(digits=1, ops=2, operators="+-*"),                                  # 3*4-5
    Difficulty(digits=2, ops=1, operators="+-"),                                   # 47+38
    Difficulty(digits=2, ops=2, depth=1, operators="+-*"),                         # (47-18)*3
    Difficulty(digits=3, ops=3, depth=2, distractors=1, operators="+-*"),          # Ann has 7 pens. 2*(318-(45+...
)


def difficulty(level: int | Difficulty) -> Difficulty:
    """The :class:`Difficulty` of a preset level (1-based) or the Difficulty itself.

    Raises:
        ValueError: ``level`` outside ``[1, len(LEVELS)]``.
        TypeError: ``level`` neither an int nor a Difficulty.
    """
    if isinstance(level, Difficulty):
        return level
    if not isinstance(level, int) or isinstance(level, bool):
        raise TypeError(f"level must be an int in [1, {len(LEVELS)}] or a Difficulty, got {type(level).__name__}")
    if not 1 <= level <= len(LEVELS):
        raise ValueError(f"difficulty level must be in [1, {len(LEVELS)}], got {level}")
    return LEVELS[level - 1]


def known_levels(levels):
    """``levels`` (a non-empty sequence of preset level numbers) unchanged, for config validators.

    Raises:
        ValueError: an empty sequence, or a level outside ``[1, len(LEVELS)]`` (the message names the range).
        TypeError: a level that is not an int.
    """
    if not levels:
        raise ValueError("name at least one difficulty level")
    for lv in levels:
        difficulty(lv)
    return levels


@dataclass(frozen=True)
class Problem:
    """One problem with its verified answer.

    Attributes:
        uid: stable 63-bit id (hash of the prompt text): use it as the GRPO group id.
        prompt: the user's message, e.g. ``"What is 3*4-5?"`` (one of a few phrasings).
        answer: the verified answer as text, e.g. ``"7"`` (integers only).
        level: the preset level (1-based) or 0 for a custom Difficulty.
        difficulty: the knobs it was drawn with.
        expression: the bare expression or equation (no distractors).
        heldout: True if the prompt belongs to the held-out split (1 prompt text in 10, by hash).
    """

    uid: int
    prompt: str
    answer: str
    level: int
    difficulty: Difficulty = field(repr=False)
    expression: str = ""
    heldout: bool = False

    def messages(self) -> list[dict]:
        """The chat messages ``[{"role": "user", ...}, {"role": "assistant", ...}]`` (a fresh list)."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


def problem_uid(prompt: str) -> int:
    """Stable 63-bit non-negative id of a prompt text (blake2b), usable as an int64 group id."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little") >> 1


def _is_heldout(prompt: str) -> bool:
    return problem_uid(prompt) % 10 == 0


def evaluate_expression(text: str, x: Fraction | None = None) -> Fraction:
    """Evaluate an expression of integers, ``+ - *``, parentheses and optionally ``x`` exactly.

    Raises:
        ValueError: anything else in ``text`` (names other than ``x``, calls, division, floats...).
    """
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return Fraction(node.value)
        if isinstance(node, ast.Name) and node.id == "x" and x is not None:
            return x
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError(f"unsupported element {ast.dump(node)[:60]} in expression {text!r}")

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {text!r} ({err.msg})") from None
    return ev(tree)


class ProblemGenerator:
    """Deterministic stream of problems for a seed.

    Args:
        seed: any int; the same seed gives the same problems.

    Example::

        gen = ProblemGenerator(seed=0)
        p = gen.problem(3)           # preset level 3
        ps = gen.batch(2, 16, split="heldout")
    """

    def __init__(self, seed: int = 0) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.rng = random.Random(seed)

    # -- pieces -----------------------------------------------------------------------------
    def _number(self, digits: int) -> int:
        if digits == 1:
            return self.rng.randint(0, 9)
        return self.rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    def _chain(self, d: Difficulty, n_ops: int, depth: int) -> str:
        """An expression with ``n_ops`` operations and parentheses nested ``depth`` deep."""
        if depth == 0:
            parts = [str(self._number(d.digits))]
            for _ in range(n_ops):
                op = self.rng.choice(d.operators)
                parts += [op, str(self._number(d.mul_digits if op == "*" else d.digits))]
            return "".join(parts)
        inner_ops = self.rng.randint(depth, n_ops - 1)
        inner = "(" + self._chain(d, inner_ops, depth - 1) + ")"
        outer = n_ops - inner_ops
        slot = self.rng.randint(0, outer)  # where the parenthesised group sits among the outer operands
        ops = [self.rng.choice(d.operators) for _ in range(outer)]
        # a multiplication's right operand has mul_digits digits (unless it is the group)
        operands = [str(self._number(d.mul_digits if i > 0 and ops[i - 1] == "*" else d.digits))
                    for i in range(outer + 1)]
        operands[slot] = inner
        return operands[0] + "".join(op + operand for op, operand in zip(ops, operands[1:]))

    def _distractor(self) -> str:
        return f"{self.rng.choice(_NAMES)} has {self.rng.randint(2, 9)} {self.rng.choice(_THINGS)}."

    def _linear(self, d: Difficulty) -> tuple[str, str, str]:
        x = self._number(d.digits)
        b = self._number(d.digits)
        sign = self.rng.choice([s for s in "+-" if s in d.operators] or ["+"])
        if d.ops == 1:
            lhs = f"x{sign}{b}"
        else:
            a = self.rng.randint(2, 9)
            lhs = f"{a}*(x{sign}{b})" if d.depth else f"{a}*x{sign}{b}"
        c = evaluate_expression(lhs, Fraction(x))
        equation = f"{lhs}={int(c)}"
        # verification: substitute the solution back into the *rendered* equation
        left, right = equation.split("=")
        if evaluate_expression(left, Fraction(x)) != evaluate_expression(right):
            raise AssertionError(f"generator bug: x={x} does not solve {equation}")
        return equation, self.rng.choice(_SOLVE).format(e=equation), str(x)

    # -- public -----------------------------------------------------------------------------
    def problem(self, level: int | Difficulty, *, split: str = "any") -> Problem:
        """One problem at a preset level (1-based int) or a custom :class:`Difficulty`.

        Args:
            split: ``"any"``, ``"train"`` (never a held-out prompt) or ``"heldout"`` (only those:
                1 prompt in 10 by hash, so the split is stable across seeds and runs).

        Raises:
            ValueError: level out of range, unknown split.
        """
        d = difficulty(level)
        lvl = level if isinstance(level, int) else 0
        if split not in ("any", "train", "heldout"):
            raise ValueError(f"split must be 'any', 'train' or 'heldout', got {split!r}")
        for _ in range(10_000):
            if d.kind == "linear":
                expression, question, answer = self._linear(d)
            else:
                expression = self._chain(d, d.ops, d.depth)
                answer = str(int(evaluate_expression(expression)))  # exact; only + - * so an integer
                question = self.rng.choice(_ASK).format(e=expression)
            prompt = " ".join([self._distractor() for _ in range(d.distractors)] + [question])
            held = _is_heldout(prompt)
            if split == "any" or held == (split == "heldout"):
                return Problem(uid=problem_uid(prompt), prompt=prompt, answer=answer, level=lvl, difficulty=d,
                               expression=expression, heldout=held)
        raise RuntimeError(f"could not draw a {split!r} problem at {d} in 10000 tries")

    def batch(self, level: int | Difficulty, n: int, *, split: str = "any") -> list[Problem]:
        """``n`` problems at one level (see :meth:`problem`).

        Raises:
            ValueError: ``n < 0``, level out of range, unknown split.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        difficulty(level)
        return [self.problem(level, split=split) for _ in range(n)]

    def mixture(self, n: int, weights: dict[int, float], *, split: str = "any") -> list[Problem]:
        """``n`` problems with levels drawn from ``weights`` (level -> relative weight).

        Raises:
            ValueError: empty weights, a negative weight, a level out of range.
        """
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights must map levels to non-negative weights with a positive sum, got {weights}")
        for lv in weights:
            difficulty(lv)
        levels, ws = list(weights), list(weights.values())
        return [self.problem(self.rng.choices(levels, ws)[0], split=split) for _ in range(n)]


def generate_problems(level: int | Difficulty, n: int, *, seed: int = 0, split: str = "any") -> list[Problem]:
    """``n`` problems at ``level`` for ``seed`` (a fresh :class:`ProblemGenerator`). See :meth:`ProblemGenerator.problem`."""
    return ProblemGenerator(seed).batch(level, n, split=split)
