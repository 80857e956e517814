"""Seed hygiene (issue 16, stage 1): deduplication with near-duplicate families kept in one split, and
decontamination against benchmark files by 13-gram overlap (the lm-eval method).

Tokens are lower-cased words, digit runs and single punctuation marks. A text with fewer than 13
tokens is compared as a whole: it is contaminated when its token sequence occurs inside a benchmark
item's. Near-duplicates: two seeds with the same *bag* of tokens (``3+4`` and ``4+3``; the same
question with its clauses reordered) form one family.

Embedding similarity lives in :mod:`treadle.rsi.embedding` (same benchmark files, via
:func:`read_benchmark_file`); an LLM paraphrase judge in :mod:`treadle.rsi.llm_roles`.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

__all__ = ["BenchmarkIndex", "DecontaminationFileError", "dedup", "family_key", "read_benchmark_file", "split_by_family",
           "tokens"]

_TOK = re.compile(r"\d+|[a-z]+|[^\s\w]")
_FIELDS = ("problem", "question", "prompt", "text", "input")
_SOLUTION_FIELDS = ("solution", "answer", "output", "canonical_solution")


class DecontaminationFileError(ValueError):
    """A benchmark file that does not exist or does not parse (file and line named)."""


def tokens(text: str) -> list[str]:
    return _TOK.findall(text.lower())


class BenchmarkIndex:
    """n-grams of benchmark problems *and* solutions.

    Args:
        n: n-gram length (13, as lm-eval).
    """

    def __init__(self, n: int = 13):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.joined: list[str] = []
        self.sources: list[str] = []

    def add(self, text: str) -> None:
        t = tokens(text)
        if not t:
            return
        self.joined.append(" " + " ".join(t) + " ")
        self.grams.update(tuple(t[i:i + self.n]) for i in range(max(1, len(t) - self.n + 1)))

    def add_file(self, path) -> int:
        """Index a benchmark file (see :func:`read_benchmark_file`); returns the number of items.

        Raises DecontaminationFileError on a missing file, a line that is not JSON (``.jsonl``), or an
        object with none of the text fields.
        """
        items = read_benchmark_file(path)
        for texts in items:
            for t in texts:
                self.add(t)
        self.sources.append(str(path))
        return len(items)

    def contaminated(self, text: str) -> bool:
        """Whether ``text`` shares an n-gram with the index (short texts: occurs inside an item)."""
        t = tokens(text)
        if not t:
            return False
        if len(t) >= self.n:
            return any(tuple(t[i:i + self.n]) in self.grams for i in range(len(t) - self.n + 1))
        needle = " " + " ".join(t) + " "
        return any(needle in j for j in self.joined)


def read_benchmark_file(path) -> list[list[str]]:
    """The texts of each item of a benchmark file: a ``.jsonl`` (objects with one of the fields
    problem/question/prompt/text/input, and optionally solution/answer/output/canonical_solution) or a plain
    text file (one item per line). Problems *and* solutions are returned, so neither can leak.

    Raises:
        DecontaminationFileError: a missing file or a folder, a line that is not JSON (``.jsonl``), or an
            object with none of the text fields (file and line named).
    """
    p = Path(path)
    if p.is_dir():
        raise DecontaminationFileError(f"benchmark file {str(p)!r} is a folder; expected a .jsonl or text file")
    if not p.is_file():
        raise DecontaminationFileError(f"benchmark file {str(p)!r} does not exist")
    items = []
    for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise DecontaminationFileError(f"{p}:{i}: not JSON ({err.msg})") from None
            if not isinstance(rec, dict) or not any(isinstance(rec.get(f), str) for f in _FIELDS):
                raise DecontaminationFileError(f"{p}:{i}: expected an object with one of the fields {_FIELDS}")
            items.append([rec[f] for f in (*_FIELDS, *_SOLUTION_FIELDS) if isinstance(rec.get(f), str)])
        else:
            items.append([line])
    return items


def family_key(text: str) -> str:
    """Near-duplicate family: hash of the sorted token bag."""
    return hashlib.sha256(" ".join(sorted(tokens(text))).encode()).hexdigest()[:16]


def dedup(items: list, text=lambda x: x.text) -> tuple[list, list]:
    """Keep the first of each exact duplicate (same token sequence); returns ``(kept, dropped)``."""
    seen, kept, dropped = set(), [], []
    for it in items:
        k = tuple(tokens(text(it)))
        (dropped if k in seen else kept).append(it)
        seen.add(k)
    return kept, dropped


def split_by_family(items: list, heldout_fraction: float, seed: int = 0, text=lambda x: x.text) -> tuple[list, list]:
    """Split into ``(train, heldout)`` with every near-duplicate family wholly on one side (a family goes to
    held-out when the hash of ``(seed, family)`` falls below ``heldout_fraction``)."""
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction!r}")
    train, held = [], []
    for it in items:
        h = int(hashlib.sha256(f"{seed}:{family_key(text(it))}".encode()).hexdigest()[:8], 16) / 16 ** 8
        (held if h < heldout_fraction else train).append(it)
    return train, held
