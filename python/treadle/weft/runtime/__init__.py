"""``treadle.weft.runtime``: sessions over registered servers, typed tool dispatch, checkpoints.

Seed: WEFT section 4.1 (MegaMCP). A :class:`Runtime` holds a :class:`~treadle.weft.runtime.registry.Registry`
and open sessions; each session owns private state cloned from an immutable snapshot and talks to
its server through the official ``mcp`` client:

- ``transport="inproc"`` (default): the server runs in this process. A ``shared`` server is imported
  once and one ``MCPServer`` serves all its sessions (the session id travels in the request
  ``_meta``); an ``isolated`` server (see :mod:`treadle.weft.runtime.isolation`) gets its own module import
  per session. State can be reset, forked, diffed and checkpointed.
- ``transport="stdio"`` / ``"http"``: one server subprocess per session (``python -m
  treadle.weft.runtime.serve``), reached over stdio or streamable HTTP on 127.0.0.1. Tool calls, reset
  (restart from the initial snapshot) and close work; fork/diff/checkpoint need in-process state and
  raise :class:`~treadle.weft.runtime.errors.UnsupportedOperationError`.

Tool-call failures never raise: :meth:`Runtime.call_tool` returns a :class:`ToolOutcome` whose
``error_kind`` is one of :class:`~treadle.weft.runtime.errors.ErrorKind`, recorded in the session log and
the per-tool :class:`~treadle.weft.runtime.stats.ToolStats`; other sessions are unaffected. Mutating calls
(tools whose contract declares ``writes``) schedule a debounced asynchronous checkpoint when the
runtime has a :class:`~treadle.weft.runtime.checkpoint.CheckpointStore`.

Usage::

    async with Runtime() as rt:
        h = rt.register(Path("shop.py"))
        sid = await rt.create_session(h, snapshot)
        out = await rt.call(sid, 'place_order(customer_id=1, items=[{"sku": "MUG", "qty": 2}])')

Modules of the package, each named for what it holds:

- :mod:`~treadle.weft.runtime.records`: ``ToolOutcome`` and ``LogEntry``, what callers get back.
- :mod:`~treadle.weft.runtime.sessions`: a session's bookkeeping and its server binding.
- :mod:`~treadle.weft.runtime.core`: :class:`Runtime`: lifetime, bindings, sessions (create, fork, diff,
  reset, close) and tool dispatch (transactions, time limits).
- :mod:`~treadle.weft.runtime.checkpointing`: debounced, ordered checkpoints and restore.
- :mod:`~treadle.weft.runtime.verification`: atomic-turn verification (gold replays).
"""
from treadle.weft.runtime.core import Runtime, Transport
from treadle.weft.runtime.records import LogEntry, ToolOutcome

__all__ = ["LogEntry", "Runtime", "ToolOutcome", "Transport"]
