"""Test server whose import fails."""
from treadle.weft.runtime.server import WeftServer

server = WeftServer("broken", backend="sqlite", schema="CREATE TABLE t (a);")
raise RuntimeError("missing dependency on purpose")
