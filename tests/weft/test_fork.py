"""Fork content and diffs between live sessions of isolated servers.

A fork must start from the parent's *current* state (not the server's initial snapshot): full state
equality of parent and fork (SQLite and object state, shared and isolated servers, after several
mutating calls, including the session clock and random source), then independent divergence.
"""
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime.registry import release_module
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


def _tree_snapshot(rt, h):
    """A Tree of the server's own classes (its Node objects travel as server classes)."""
    module, _ = rt.registry.load(h)
    try:
        return snapshot_from_object(module.Tree())
    finally:
        release_module(module)


CASES = {
    # server, initial snapshot, mutating calls, a read that shows the state
    "sqlite": ("notes.py", lambda: snapshot_from_sql(NOTES_DDL, "INSERT INTO notes (text) VALUES ('seed');"),
               [("add_note", {"text": f"n{i}", "tag": "t"}) for i in range(3)], ("list_notes", {})),
    "object": ("wallet_obj.py", lambda: snapshot_from_object(_wallet()),
               [("deposit", {"who": w, "amount": a}) for w, a in (("ann", 5), ("bob", 7), ("ann", 1))],
               ("balance", {"who": "ann"})),
}


def _wallet():
    from types import SimpleNamespace
    return SimpleNamespace(balances={"ann": 1}, history=[])


def _state_equal(rt, a, b):
    sa, sb = rt.snapshot(a), rt.snapshot(b)
    assert sa.kind == sb.kind and sa.env == sb.env
    assert rt.diff(a, b).empty and rt.diff(b, a).empty
    assert rt.diff(a, sb).empty and rt.diff(b, sa).empty
    if sa.kind == "sqlite":
        assert sa.data == sb.data  # byte-identical database images
        return
    assert vars(rt.state(a)) == vars(rt.state(b)) or rt.diff(a, b).empty


@pytest.mark.parametrize("isolation", ["shared", "isolated"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fork_copies_the_parents_current_state_then_diverges(case, isolation):
    server, make_snapshot, calls, read = CASES[case]

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / server, isolation=isolation)
            assert rt.registry.spec(h).isolation == isolation
            initial = make_snapshot()
            p = await rt.create_session(h, initial)
            for name, args in calls:
                assert (await rt.call_tool(p, name, args)).ok
            before_fork = rt.snapshot(p)
            assert before_fork.data != initial.data  # the parent has moved away from the initial state
            f = await rt.fork(p)
            _state_equal(rt, p, f)
            assert not rt.diff(f).empty  # the fork is not the initial state
            assert (await rt.call_tool(f, *read)).result == (await rt.call_tool(p, *read)).result
            # diverge: the fork's writes are invisible to the parent and vice versa
            name, args = calls[0]
            assert (await rt.call_tool(f, name, args)).ok
            assert rt.snapshot(p).data == before_fork.data
            assert not rt.diff(p, f).empty
            after_fork_write = rt.snapshot(f)
            assert (await rt.call_tool(p, name, args)).ok
            assert rt.snapshot(f).data == after_fork_write.data
            # same calls from the same state: equal again (also the session clock and random source)
            _state_equal(rt, p, f)
            await rt.reset(f)
            assert rt.snapshot(f) == initial  # reset of a fork returns to the original start
    anyio.run(main)


@pytest.mark.parametrize("isolation", ["shared", "isolated"])
def test_diff_between_live_sessions_with_server_classes(isolation):
    """State holding instances of the server module's own classes; two live sessions of an
    isolated server live in two module imports whose objects never compare equal."""
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "tree_obj.py", isolation=isolation)
            src = rt.registry.spec(h).source
            assert "class Node" in src
            p = await rt.create_session(h, _tree_snapshot(rt, h))
            for name in ("a", "b"):
                assert (await rt.call_tool(p, "mkdir", {"name": name})).ok
            f = await rt.fork(p)
            assert rt.diff(p, f).empty and rt.diff(f, p).empty
            assert rt.diff(p, rt.snapshot(f)).empty
            assert (await rt.call_tool(f, "mkdir", {"name": "c"})).ok
            d = rt.diff(p, f)
            assert d.counts() == {"attributes": {"added": 0, "changed": 1, "removed": 0}}
            assert list(d.tables["attributes"].changed) == ["root"]
    anyio.run(main)


def test_diff_between_live_bfcl_filesystem_sessions():
    bfcl = pytest.importorskip("treadle.weft.envs.bfcl")
    pytest.importorskip("bfcl_eval")

    async def main():
        async with Runtime() as rt:
            h = bfcl.register_class(rt, "GorillaFileSystem")
            assert rt.registry.spec(h).isolation == "isolated"
            entries, _ = bfcl.load_entries("base")
            entry = next(e for e in entries if "GorillaFileSystem" in e["involved_classes"])
            snap = bfcl.initial_snapshot(rt, h, "GorillaFileSystem", entry["initial_config"]["GorillaFileSystem"])
            p = await rt.create_session(h, snap)
            f = await rt.fork(p)
            assert rt.diff(p, f).empty and rt.diff(p, rt.snapshot(f)).empty
    anyio.run(main)
