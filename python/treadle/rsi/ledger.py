"""Cost ledger of an RSI run: per operator (Extend / Revise / Verify), per seed chain, with the
Director and skill-update overhead kept apart.

Offline costs are *work units*: one per primitive transformation applied, per Revise, per Director
decision, per validity check, per solver attempt. With LLM roles the same entries also carry tokens
and money (from :mod:`treadle.llm`'s usage). Totals are sums of the entries, nothing else.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["OPERATORS", "CostEntry", "CostLedger"]

OPERATORS = ("extend", "revise", "verify", "director", "skill_update", "init")
Operator = Literal["extend", "revise", "verify", "director", "skill_update", "init"]


class CostEntry(BaseModel):
    """One charged unit of work."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    round: int
    """Round index (0-based; -1 for initialisation)."""
    phase: Literal["online", "post_batch", "init", "transfer"]
    """Where the work happened (post-batch candidate evaluation is charged apart from the online round)."""
    operator: Operator
    seed_id: str | None = None
    """Seed chain charged (None for overhead that belongs to no chain)."""
    units: float = 1.0
    tokens: int = 0
    cost_usd: float = 0.0


class CostLedger:
    """Append-only list of :class:`CostEntry` with grouped totals."""

    def __init__(self, entries: list[CostEntry] | None = None):
        self.entries: list[CostEntry] = list(entries or [])

    def charge(self, round: int, phase: str, operator: str, seed_id: str | None = None, units: float = 1.0,
               tokens: int = 0, cost_usd: float = 0.0) -> None:
        self.entries.append(CostEntry(round=round, phase=phase, operator=operator, seed_id=seed_id, units=units,
                                      tokens=tokens, cost_usd=cost_usd))

    def total(self, **where) -> float:
        """Sum of units over entries whose fields equal ``where`` (e.g. ``phase="online"``)."""
        return float(sum(e.units for e in self.entries if all(getattr(e, k) == v for k, v in where.items())))

    def by(self, field: str, **where) -> dict:
        """Units grouped by ``field`` (``operator``, ``seed_id``, ``round``, ``phase``)."""
        out: dict = defaultdict(float)
        for e in self.entries:
            if all(getattr(e, k) == v for k, v in where.items()):
                out[getattr(e, field)] += e.units
        return dict(out)

    def summary(self) -> dict:
        """``total``, ``by_operator``, ``by_phase``, ``by_seed`` (online, per chain) and tokens / money."""
        return {"total": self.total(), "by_operator": self.by("operator"), "by_phase": self.by("phase"),
                "by_seed": self.by("seed_id", phase="online"),
                "tokens": sum(e.tokens for e in self.entries), "cost_usd": sum(e.cost_usd for e in self.entries)}

    def write_jsonl(self, path, mode: str = "a", entries: list[CostEntry] | None = None) -> None:
        with Path(path).open(mode) as f:
            f.writelines(e.model_dump_json() + "\n" for e in (self.entries if entries is None else entries))

    @classmethod
    def read_jsonl(cls, path) -> CostLedger:
        p = Path(path)
        return cls([CostEntry.model_validate(json.loads(line)) for line in p.read_text().splitlines() if line.strip()]
                   if p.exists() else [])
