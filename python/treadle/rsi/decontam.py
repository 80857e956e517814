"""Seed hygiene (RSI sec. 4.2, seeds): deduplication with near-duplicate families kept in one split, and
decontamination against benchmark files by 13-gram overlap (the lm-eval method) plus containment.

Tokens are lower-cased words, digit runs and single punctuation marks, taken after canonicalising the
text (:func:`canonical`): Unicode compatibility forms (full-width digits), thousands separators
(``36,619``, ``36 619``, ``36'619``) and trailing zeros of decimals (``81.0`` -> ``81``), so that a
number written another way is the same token. A text is contaminated when it shares a 13-gram with a
benchmark item, when it is shorter than 13 tokens and occurs inside an item, or when a short item
(4 to 12 tokens) occurs inside it (containment: a benchmark problem with distractor clauses around it).
Near-duplicates: two seeds with the same *bag* of tokens (``3+4`` and ``4+3``; the same question with
its clauses reordered) form one family.

Embedding similarity lives in :mod:`treadle.rsi.embedding` (same benchmark files, via
:func:`read_benchmark_file`); an LLM paraphrase judge in :mod:`treadle.rsi.llm_roles`.
"""
from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from pathlib import Path

__all__ = ["BenchmarkIndex", "DecontaminationFileError", "canonical", "dedup", "family_key", "read_benchmark_file",
           "split_by_family", "tokens"]

_TOK = re.compile(r"\d+|[a-z]+|[^\s\w]")
# a digit group of 1-3 followed by groups of exactly 3 after one separator char: 1,234,567 / 36 619 / 36'619
_GROUPED = re.compile(r"(?<![\d.,])\d{1,3}(?:[,'_ \u00a0\u2009\u202f]\d{3})+(?!\d|,\d)")
_DECIMAL = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?![\d.])")
_SEPARATORS = re.compile(r"[,'_ \u00a0\u2009\u202f]")
MIN_CONTAINED = 4
"""Shortest benchmark item (in tokens) whose occurrence inside a text counts as contamination."""


def _decimal(m: re.Match) -> str:
    frac = m.group(2).rstrip("0")
    return m.group(1) + ("." + frac if frac else "")


def canonical(text: str) -> str:
    """``text`` with numbers written one way: NFKC (full-width digits, ``\u2212`` minus), no thousands
    separators, no trailing zeros after a decimal point. Linear in the length of ``text``."""
    t = unicodedata.normalize("NFKC", text).replace("\u2212", "-")
    t = _GROUPED.sub(lambda m: _SEPARATORS.sub("", m.group(0)), t)
    return _DECIMAL.sub(_decimal, t)
_FIELDS = ("problem", "question", "prompt", "text", "input")
_SOLUTION_FIELDS = ("solution", "answer", "output", "canonical_solution")


class DecontaminationFileError(ValueError):
    """A benchmark file that does not exist or does not parse (file and line named)."""


def tokens(text: str) -> list[str]:
    """Lower-cased word, digit-run and punctuation tokens of :func:`canonical` ``(text)``."""
    return _TOK.findall(canonical(text).lower())


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
        self.short: dict[int, set[tuple[str, ...]]] = {}  # items of MIN_CONTAINED..n-1 tokens, by length
        self.sources: list[str] = []

    def add(self, text: str) -> None:
        t = tokens(text)
        if not t:
            return
        self.joined.append(" " + " ".join(t) + " ")
        self.grams.update(tuple(t[i:i + self.n]) for i in range(max(1, len(t) - self.n + 1)))
        if MIN_CONTAINED <= len(t) < self.n:
            self.short.setdefault(len(t), set()).add(tuple(t))

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
        """Whether ``text`` shares an n-gram with the index, occurs inside an item (texts shorter than n
        tokens) or contains a short item (``MIN_CONTAINED`` to n-1 tokens) as a run of its tokens."""
        t = tokens(text)
        if not t:
            return False
        if any(tuple(t[i:i + k]) in items for k, items in self.short.items() for i in range(len(t) - k + 1)):
            return True
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
