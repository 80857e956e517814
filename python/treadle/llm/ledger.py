"""Append-only JSONL ledger of every model call (role, operator tag, tokens, latency, cache hit, cost).

One line per call, written with a single ``write`` and flushed, so a killed process leaves whole
lines (a torn last line, if the OS cut one, is skipped with a warning by :func:`read_ledger`).
API keys are never part of a record.
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LedgerRecord", "Ledger", "LedgerError", "Totals", "read_ledger", "totals"]


class LedgerRecord(BaseModel):
    """One model call as accounted."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: Literal[1] = 1
    time: float = Field(description="Unix time the call ended.")
    role: str = Field(description="Config role that made the call.")
    tag: str = Field(description="Operator tag given by the caller (e.g. 'rollout', 'repair', 'judge').")
    model: str
    kind: str = Field(description="'chat' or 'completion'.")
    key: str | None = Field(description="Cache key of the request.")
    tokens_in: int = Field(description="Prompt tokens (0 for cache hits: nothing was paid).")
    tokens_out: int = Field(description="Completion tokens (0 for cache hits).")
    latency_s: float
    cache_hit: bool
    recorded: bool = False
    cost_usd: float = Field(description="tokens x prices of the role (0 without prices or for cache hits).")
    ok: bool
    failure: str | None = Field(None, description="FailureKind value when not ok.")
    attempts: int = 1


class Totals(BaseModel):
    """Sums over a set of ledger records."""

    model_config = ConfigDict(extra="forbid")
    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0


def _sum(records: list[LedgerRecord]) -> Totals:
    return Totals(calls=len(records), cache_hits=sum(r.cache_hit for r in records),
                  failures=sum(not r.ok for r in records), tokens_in=sum(r.tokens_in for r in records),
                  tokens_out=sum(r.tokens_out for r in records), cost_usd=math.fsum(r.cost_usd for r in records),
                  latency_s=math.fsum(r.latency_s for r in records))


def totals(records: list[LedgerRecord]) -> dict:
    """``{"all": Totals, "role": {role: Totals}, "tag": {tag: Totals}, "role_tag": {"role/tag": Totals}}``."""
    groups: dict[str, dict[str, list]] = {"role": defaultdict(list), "tag": defaultdict(list),
                                          "role_tag": defaultdict(list)}
    for r in records:
        groups["role"][r.role].append(r)
        groups["tag"][r.tag].append(r)
        groups["role_tag"][f"{r.role}/{r.tag}"].append(r)
    out: dict = {"all": _sum(records)}
    for name, g in groups.items():
        out[name] = {k: _sum(v) for k, v in sorted(g.items())}
    return out


class LedgerError(ValueError):
    """A ledger path that is a folder or cannot be created, or a ledger file with a malformed line (named)."""


def _check_path(p: Path) -> None:
    if p.is_dir():
        raise LedgerError(f"ledger path {str(p)!r} is a folder; expected a JSONL file (e.g. {str(p / 'ledger.jsonl')!r})")


def read_ledger(path: str | os.PathLike) -> list[LedgerRecord]:
    """All whole records of a ledger file (a torn final line is skipped with a warning; a missing file is empty).

    Raises:
        LedgerError: ``path`` is a folder, is not UTF-8 text, or a line other than a torn last one is not a
            ledger record (file and line number named).
    """
    p = Path(path)
    _check_path(p)
    if not p.exists():
        return []
    out = []
    try:
        lines = p.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise LedgerError(f"{p}: not a JSONL ledger (not UTF-8 text: {err.reason})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(LedgerRecord.model_validate_json(line))
        except ValueError:
            if i == len(lines) - 1:  # last line without its newline: a write cut by a kill
                warnings.warn(f"{p}: skipping a torn last line")
                continue
            raise LedgerError(f"{p}:{i + 1}: not a ledger record (expected one JSON object per line as written "
                              f"by Ledger); got {line[:80]!r}") from None
    return out


class Ledger:
    """Appends :class:`LedgerRecord` lines to ``path`` (created with its folder); thread-safe.

    Raises:
        LedgerError: ``path`` is a folder, or its folder cannot be created (before anything is written).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        _check_path(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise LedgerError(f"ledger path {str(self.path)!r}: cannot create its folder: {err.strerror or err}") \
                from None
        self._lock = threading.Lock()
        self._f = None

    def append(self, record: LedgerRecord) -> None:
        """Write one whole line and flush it (the file is opened on first use and after :meth:`close`)."""
        line = record.model_dump_json() + "\n"
        with self._lock:
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")
            self._f.write(line)
            self._f.flush()

    def record(self, **fields) -> LedgerRecord:
        rec = LedgerRecord(time=time.time(), **fields)
        self.append(rec)
        return rec

    def records(self) -> list[LedgerRecord]:
        return read_ledger(self.path)

    def totals(self) -> dict:
        """See :func:`totals`."""
        return totals(self.records())

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
