"""Per-tool statistics of a runtime: calls, errors by kind, latency p50/p99, linked to the server hash.

Seed: WEFT 4.1 (MegaMCP: per-tool error rate and crash statistics link back to the MCP definition to
drive re-validation). Latencies are in milliseconds; percentiles are nearest-rank over every
recorded call (memory grows by one float per call).
"""
from __future__ import annotations

import json
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from treadle.weft.runtime.errors import ErrorKind


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; None when empty.

    ``numpy.percentile(..., method="inverted_cdf")``: the smallest value whose empirical CDF reaches
    ``q``%, always one of the recorded values (the nearest-rank definition).
    """
    if not values:
        return None
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="inverted_cdf"))


class ToolStats:
    """Counters keyed by ``(server_hash, tool)``; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[tuple[str, str], int] = defaultdict(int)
        self._errors: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._lat: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._names: dict[str, str] = {}

    def record(self, server_hash: str, tool: str, latency_ms: float | None, error: ErrorKind | None,
               server_name: str = "") -> None:
        """Count one call (``error=None`` for success); ``latency_ms=None`` for calls never dispatched."""
        key = (server_hash, tool)
        with self._lock:
            self._calls[key] += 1
            if error is not None:
                self._errors[key][ErrorKind(error).value] += 1
            if latency_ms is not None:
                self._lat[key].append(float(latency_ms))
            if server_name:
                self._names[server_hash] = server_name

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (server, tool): ``server_hash, server, tool, calls, errors{kind: n}, error_rate,
        p50_ms, p99_ms``; sorted by server then tool."""
        with self._lock:
            out = []
            for key in sorted(self._calls):
                lat = self._lat.get(key, [])
                errs = dict(self._errors.get(key, {}))
                n = self._calls[key]
                out.append({"server_hash": key[0], "server": self._names.get(key[0], ""), "tool": key[1], "calls": n,
                            "errors": errs, "error_rate": sum(errs.values()) / n if n else 0.0,
                            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)})
            return out

    def get(self, server_hash: str, tool: str) -> dict[str, Any]:
        """The row of one tool (zero counts when it was never called)."""
        for r in self.rows():
            if r["server_hash"] == server_hash and r["tool"] == tool:
                return r
        return {"server_hash": server_hash, "server": self._names.get(server_hash, ""), "tool": tool, "calls": 0,
                "errors": {}, "error_rate": 0.0, "p50_ms": None, "p99_ms": None}

    def export_jsonl(self, path: str | Path) -> Path:
        """Write :meth:`rows` as JSON lines to ``path``; return the path."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(json.dumps(r) + "\n" for r in self.rows()), encoding="utf-8")
        return p
