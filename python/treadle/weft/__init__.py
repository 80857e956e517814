"""``treadle.weft``: the WEFT environment runtime (seed: WEFT section 4.1, MegaMCP).

Stateful MCP tool environments with private per-session state cloned from immutable snapshots,
a content-addressed server registry with a static side-effect check, typed tool-call errors and
per-tool statistics, debounced checkpoints with generation fencing, and checkpoint verification
(``R(tau) = mean_k r_k``). Modules, each named for what it holds:

- :mod:`~treadle.weft.errors`: the closed set of tool-call error kinds and the runtime's exceptions.
- :mod:`~treadle.weft.state`, :mod:`~treadle.weft.sqlite_state`, :mod:`~treadle.weft.object_state`:
  state backends (snapshot, clone/fork, reset, diff, schema check).
- :mod:`~treadle.weft.isolation`: static AST check of a server module for process-global side effects.
- :mod:`~treadle.weft.server`: ``WeftServer``, typed tool functions with contracts, served by the ``mcp`` SDK.
- :mod:`~treadle.weft.registry`: content-addressed server registry.
- :mod:`~treadle.weft.callparse`: call strings -> structured tool calls with ``ast`` (never ``eval``).
- :mod:`~treadle.weft.stats`: per-tool statistics.
- :mod:`~treadle.weft.checkpoint`: fsspec checkpoint store with generation fencing.
- :mod:`~treadle.weft.runtime`: sessions and tool dispatch.
- :mod:`~treadle.weft.verify`: per-checkpoint verification with typed failure reasons.
- :mod:`~treadle.weft.envs.shop`: a native SQLite environment (orders and tickets).

Nothing here is imported by ``import treadle``; submodules load on use.
"""
