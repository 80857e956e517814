"""The fixed solver of the difficulty measure: a small protocol, a programmatic solver with a known
capability limit (tests, ablations) and the embedded tiny model sampled ``n`` times (demo, CLI).

Difficulty ``A`` = mean accuracy over ``n = 4`` attempts per task (seed: RSI section 3.2). The solver
sees only the task text, never the specification or the reference answer.
"""
from __future__ import annotations

import hashlib
import random
import re
from typing import Protocol, runtime_checkable

import sympy

__all__ = ["CapacitySolver", "Solver", "SolverError", "TinyModelSolver", "text_features"]

_NUM = re.compile(r"\d+")


class SolverError(RuntimeError):
    """The solver could not produce attempts (a tool/endpoint failure: goes to repair, never to skills)."""


@runtime_checkable
class Solver(Protocol):
    """``attempt(texts, n, seed)`` -> ``n`` answer strings per text (deterministic for ``seed``)."""

    name: str

    def attempt(self, texts: list[str], n: int, seed: int) -> list[list[str]]: ...


def text_features(text: str) -> dict[str, int]:
    """Features the capacity solver reads from the text alone."""
    q = text.rsplit(". ", 1)[-1] if ". " in text else text
    body = q.split(" ", 1)[1].rsplit(" for x", 1)[0].rstrip(".")
    expr = body.split("=")[0]
    depth = d = 0
    for c in expr:
        d += (c == "(") - (c == ")")
        depth = max(depth, d)
    return {"ops": sum(expr.count(o) for o in "+-*/"), "digits": max((len(n) for n in _NUM.findall(expr)), default=0),
            "depth": depth, "distractors": text.count(" has "), "solve": int(q.startswith("Solve"))}


class CapacitySolver:
    """A deterministic programmatic solver with a known capability limit.

    It computes the exact answer with sympy, but each attempt succeeds only with probability
    ``success ** overshoot``, where ``overshoot`` = sum over features of ``max(0, feature - limit)``
    (``solve`` counts 1 for an equation); failed attempts answer ``truth + k`` for ``k`` in 1..3.

    Args:
        limits: per-feature limits (defaults: ops 3, digits 2, depth 1, distractors 1, solve 0).
        success: per-unit-of-overshoot success probability in (0, 1).
    """

    name = "capacity"

    def __init__(self, limits: dict[str, int] | None = None, success: float = 0.6):
        self.limits = {"ops": 3, "digits": 2, "depth": 1, "distractors": 1, "solve": 0, **(limits or {})}
        if not 0.0 < success < 1.0:
            raise ValueError(f"success must be in (0, 1), got {success!r}")
        self.success = success

    def overshoot(self, text: str) -> int:
        f = text_features(text)
        return sum(max(0, f[k] - v) for k, v in self.limits.items())

    def attempt(self, texts: list[str], n: int, seed: int) -> list[list[str]]:
        from treadle.rsi.verifier import check_task

        out = []
        for t in texts:
            truth = check_task(t, "0").answer
            p = self.success ** self.overshoot(t)
            row = []
            for i in range(n):
                h = hashlib.sha256(f"{seed}:{i}:{t}".encode()).digest()
                r = random.Random(h)
                if truth is None:
                    row.append("0")
                elif r.random() < p:
                    row.append(truth)
                else:
                    row.append(str(sympy.Rational(truth) + r.randint(1, 3)))
            out.append(row)
        return out


class TinyModelSolver:
    """The embedded tiny model (:func:`treadle.models.load_default_model`) sampled ``n`` times per task.

    Args:
        path: a local checkpoint, else the cached tiny model (trained on demand when missing).
        temperature: sampling temperature (> 0).
        max_new_tokens: answer length cap.
        model, tokenizer: an already loaded causal LM and its tokenizer (then ``path`` is ignored).
        quick: use the quick tiny model (``TinyTrainConfig.quick()``, cache ``tiny-qwen3-quick``).
    """

    name = "tiny-model"

    def __init__(self, path=None, temperature: float = 0.7, max_new_tokens: int = 12, batch_size: int = 64,
                 model=None, tokenizer=None, quick: bool = False):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        if model is None or tokenizer is None:
            from treadle.models import load_default_model

            if quick:  # the seconds-long quick tiny model (its own cache folder)
                from treadle.models.tiny import TinyTrainConfig

                model, tokenizer = load_default_model(path, config=TinyTrainConfig.quick(), name="tiny-qwen3-quick",
                                                      progress=False)
            else:
                model, tokenizer = load_default_model(path, progress=False)
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.max_new_tokens, self.batch_size = temperature, max_new_tokens, batch_size

    def attempt(self, texts: list[str], n: int, seed: int) -> list[list[str]]:
        from treadle.models.generation import generate

        out: list[list[str]] = []
        try:
            for i in range(0, len(texts), self.batch_size):
                chunk = texts[i:i + self.batch_size]
                g = generate(self.model, self.tokenizer, chunk, n=n, max_new_tokens=self.max_new_tokens,
                             do_sample=True, temperature=self.temperature, seed=seed + i)
                out.extend(g.texts[j * n:(j + 1) * n] for j in range(len(chunk)))
        except Exception as err:  # a model failure is a tool failure: recorded, never a skill
            raise SolverError(f"tiny-model solver failed: {type(err).__name__}: {err}") from err
        return out
