"""``treadle.weft``: the WEFT environment runtime (seed: WEFT section 4.1, MegaMCP).

Stateful MCP tool environments with private per-session state cloned from immutable snapshots,
a content-addressed server registry with a static side-effect check, typed tool-call errors and
per-tool statistics, debounced checkpoints with generation fencing, and checkpoint verification
(``R(tau) = mean_k r_k``). Modules, each named for what it holds:

- :mod:`~treadle.weft.runtime.errors`: the closed set of tool-call error kinds and the runtime's exceptions.
- :mod:`~treadle.weft.runtime.state`, :mod:`~treadle.weft.runtime.sqlite_state`, :mod:`~treadle.weft.runtime.object_state`:
  state backends (snapshot, clone/fork, reset, diff, schema check).
- :mod:`~treadle.weft.runtime.isolation`: static AST check of a server module for process-global side effects and
  aliases of module/class-level mutables ("isolate unless proven safe").
- :mod:`~treadle.weft.runtime.determinism`: each session's deterministic clock and random source, carried by snapshots.
- :mod:`~treadle.weft.runtime.server`: ``WeftServer``, typed tool functions with contracts, served by the ``mcp`` SDK.
- :mod:`~treadle.weft.runtime.registry`: content-addressed server registry.
- :mod:`~treadle.weft.runtime.callparse`: call strings -> structured tool calls with ``ast`` (never ``eval``).
- :mod:`~treadle.weft.runtime.stats`: per-tool statistics.
- :mod:`~treadle.weft.runtime.checkpoint`: fsspec checkpoint store: create-only objects, generation fencing across
  processes, HMAC-authenticated records.
- :mod:`~treadle.weft.runtime`: sessions and tool dispatch (in-process, stdio, streamable HTTP); every call a
  transaction, abandoned at its time limit; ordered checkpoints; turn verification.
- :mod:`~treadle.weft.runtime.serve`: the subprocess entry point of stdio/HTTP sessions.
- :mod:`~treadle.weft.runtime.pool`: prefork worker pool (fork server with the runtime preloaded, concurrent sessions per
  worker, failover); :mod:`~treadle.weft.runtime.chaos`: the pool's chaos drill (random SIGKILLs, leak/loss counts).
- :mod:`~treadle.weft.runtime.verify`: per-checkpoint verification with typed failure reasons.
- :mod:`~treadle.weft.runtime.episode`: atomic-turn episodes (run, judge, checkpoint each turn; resume).
- :mod:`~treadle.weft.envs.shop`: a native SQLite environment (orders and tickets) and its tasks.
- :mod:`~treadle.weft.envs.bfcl`: BFCL v4 multi-turn classes as servers, entries run and judged per
  turn (needs ``pip install --no-deps bfcl-eval``); :mod:`~treadle.weft.envs.bfcl_schema`: BFCL docs -> JSON Schema.
- :mod:`~treadle.weft.cli`, :mod:`~treadle.weft.demo`: ``treadle weft ...`` and the ``weft-shop`` demo.

Nothing here is imported by ``import treadle``; submodules load on use.
"""
