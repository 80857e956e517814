"""Serve one WEFT session's server over stdio or streamable HTTP (a subprocess of the runtime).

    python -m treadle.weft.runtime.serve --server-file F.py --snapshot S.bin --kind sqlite \
        --session-id ID --transport stdio|http [--port P] [--env JSON]

The module is imported from ``F.py``, the session state is cloned from the snapshot bytes in
``S.bin`` (not schema-checked here: the runtime checked it), and one ``MCPServer`` serves it. HTTP
binds to 127.0.0.1 only. Used by :class:`treadle.weft.runtime.Runtime` for ``transport="stdio"``
and ``"http"``, and by the process-per-session baseline.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from treadle.weft.runtime.determinism import EnvState
from treadle.weft.runtime.registry import import_server_module
from treadle.weft.runtime.server import ToolError
from treadle.weft.runtime.state import Snapshot


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server-file", type=Path, required=True)
    p.add_argument("--snapshot", type=Path, required=True)
    p.add_argument("--kind", choices=("sqlite", "object"), required=True)
    p.add_argument("--session-id", required=True)
    p.add_argument("--transport", choices=("stdio", "http"), default="stdio")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--env", default="{}", help="the snapshot's session clock/random state (JSON of EnvState)")
    a = p.parse_args(argv)
    _, weft = import_server_module(a.server_file.read_text(encoding="utf-8"), str(a.server_file), tag="serve")
    state = weft.new_state(Snapshot(a.kind, a.snapshot.read_bytes(), EnvState(**json.loads(a.env))))

    def resolve(sid: str | None):
        if sid != a.session_id:
            raise ToolError(f"unknown session {sid!r}")
        return state.handle

    mcp = weft.build(resolve, lambda sid: state.env if sid == a.session_id else None)
    if a.transport == "stdio":
        mcp.run("stdio")
    else:
        if a.port <= 0:
            raise SystemExit("--port is required for --transport http")
        mcp.run("streamable-http", host="127.0.0.1", port=a.port)


if __name__ == "__main__":
    main()
