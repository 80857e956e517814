"""On-disk content-addressed response cache (SQLite in WAL mode, shared safely by several processes).

The key is the SHA-256 of the canonical JSON of exactly the fields that change the output (see
:func:`request_key`); entries are JSON (a :class:`ChatResult` dump), never pickle. Each ``put`` is one
transaction, so a process killed mid-batch leaves only whole entries.
"""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Literal

from treadle.llm.records import ChatResult

__all__ = ["Cache", "CacheError", "CacheMode", "request_key", "canonical_json"]


class CacheError(ValueError):
    """The cache path cannot hold a cache: a folder, a file that is not a SQLite database, or unwritable.
    Raised by :class:`Cache` before anything is written; the file at the path is left untouched."""

CacheMode = Literal["use", "refresh", "off"]
"""``use``: read and write; ``refresh``: ignore stored entries, overwrite them; ``off``: neither."""


def canonical_json(obj) -> str:
    """Sorted keys, no whitespace, UTF-8 kept: the same request always gives the same string."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def request_key(payload: dict, *, kind: str, sample_index: int) -> str:
    """SHA-256 hex of the canonical request: ``kind`` (chat/completion), the wire payload (model, messages or
    prompt, tools, tool_choice, sampling parameters incl. seed, response_format, extra body) and the sample
    index. Timeouts, retries, base URL and keys are not part of it (they do not change the output)."""
    body = {"kind": kind, "sample_index": int(sample_index), "request": payload}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


class Cache:
    """``Cache(path)``: a SQLite file (created with its folder). Thread-safe; one connection per thread.

    Args:
        path: database file (e.g. ``runs/x/llm_cache.sqlite``).
        mode: default :data:`CacheMode` of clients using it.

    Raises:
        ValueError: an unknown ``mode``.
        CacheError: ``path`` is a folder, an existing file that is not a SQLite database, or cannot be created.
    """

    def __init__(self, path: str | os.PathLike, mode: CacheMode = "use"):
        if mode not in ("use", "refresh", "off"):
            raise ValueError(f"cache mode must be 'use', 'refresh' or 'off', got {mode!r}")
        self.path = Path(path)
        self.mode = mode
        if self.path.is_dir():
            raise CacheError(f"cache path {str(self.path)!r} is a folder; expected a SQLite file "
                             f"(e.g. {str(self.path / 'llm_cache.sqlite')!r})")
        if self.path.is_file() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                if f.read(16) != b"SQLite format 3\x00":
                    raise CacheError(f"cache path {str(self.path)!r} is not a SQLite database; "
                                     f"expected a cache file written by treadle (left untouched)")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CacheError(f"cache path {str(self.path)!r}: cannot create its folder: {err.strerror or err}") from None
        self._local = threading.local()
        try:
            con = self._con()
            con.execute("CREATE TABLE IF NOT EXISTS entries "
                        "(key TEXT PRIMARY KEY, value TEXT NOT NULL, created REAL NOT NULL)")
        except sqlite3.Error as err:
            raise CacheError(f"cache path {str(self.path)!r}: cannot open as a SQLite cache: {err}") from None

    def _con(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("PRAGMA busy_timeout=30000")
            self._local.con = con
        return con

    def get(self, key: str) -> ChatResult | None:
        """The stored result (``cached=True``, ``latency_s=0``) or None."""
        row = self._con().execute("SELECT value FROM entries WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return ChatResult.model_validate_json(row[0]).model_copy(update={"cached": True, "latency_s": 0.0})

    def put(self, result: ChatResult) -> None:
        """Store (or overwrite) ``result`` under ``result.key``; one transaction."""
        value = result.model_copy(update={"cached": False}).model_dump_json()
        self._con().execute("INSERT OR REPLACE INTO entries (key, value, created) VALUES (?, ?, ?)",
                            (result.key, value, time.time()))

    def __len__(self) -> int:
        return self._con().execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def keys(self) -> list[str]:
        return [r[0] for r in self._con().execute("SELECT key FROM entries ORDER BY created")]

    def check(self) -> bool:
        """SQLite's integrity check passes and every entry parses as a :class:`ChatResult`."""
        con = self._con()
        if con.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
            return False
        for (value,) in con.execute("SELECT value FROM entries"):
            ChatResult.model_validate_json(value)
        return True

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is not None:
            con.close()
            self._local.con = None
