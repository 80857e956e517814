"""Runtime: sessions, typed tool errors, statistics, reset/fork/diff, isolation under concurrency."""
import types
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.errors import (
    ErrorKind,
    ServerImportError,
    SessionClosedError,
    SnapshotSchemaError,
    UnknownServerError,
    UnknownSessionError,
)
from treadle.weft.runtime.object_state import snapshot_from_object
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql

SERVERS = Path(__file__).parent / "servers"
NOTES_DDL = "CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT NOT NULL, tag TEXT);"


def run(fn):
    return anyio.run(fn)


@pytest.fixture
def notes_snapshot():
    return snapshot_from_sql(NOTES_DDL, "INSERT INTO notes (text, tag) VALUES ('seed', 'a');")


def test_sessions_private_and_tools_work(notes_snapshot):
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "notes.py")
            a = await rt.create_session(h, notes_snapshot)
            b = await rt.create_session(h, notes_snapshot)
            out = await rt.call_tool(a, "add_note", {"text": "hello"})
            assert out.ok and out.result == {"id": 2} and out.error_kind is None and out.latency_ms > 0
            out = await rt.call(a, 'add_note(text="again", tag="t")')
            assert out.ok and out.result == {"id": 3}
            la = (await rt.call_tool(a, "list_notes")).result
            lb = (await rt.call_tool(b, "list_notes")).result
            assert [n["text"] for n in la] == ["seed", "hello", "again"]
            assert [n["text"] for n in lb] == ["seed"]
            tools = await rt.list_tools(a)
            assert {t["name"] for t in tools} == {"add_note", "add_then_fail", "explode", "list_notes", "slow",
                                                  "slow_sync", "add_then_exit"}
            assert len(rt.sessions()) == 2 and rt._shared[h].states.keys() == {a, b}  # one shared server
    run(main)


def test_typed_errors_and_runtime_keeps_serving(notes_snapshot):
    async def main():
        async with Runtime(timeout_s=1.0) as rt:  # generous: a loaded CI machine must not time out normal calls
            h = rt.register(SERVERS / "notes.py")
            a = await rt.create_session(h, notes_snapshot)
            b = await rt.create_session(h, notes_snapshot)
            cases = [
                (("nope", {}), ErrorKind.unknown_tool, "unknown tool 'nope'"),
                (("add_note", {}), ErrorKind.invalid_args, "'text' is a required property"),
                (("add_note", {"text": 5}), ErrorKind.invalid_args, "is not of type 'string'"),
                (("add_note", {"text": ""}), ErrorKind.invalid_args, "should be non-empty"),
                (("add_note", {"text": "x", "zzz": 1}), ErrorKind.invalid_args, "Additional properties"),
                (("add_note", ["x"]), ErrorKind.invalid_args, "must be a JSON object"),
                (("add_then_fail", {"text": "x"}), ErrorKind.execution_error, "refusing note 'x'"),
                (("explode", {}), ErrorKind.execution_error, "Error executing tool explode"),
                (("add_then_exit", {"text": "x"}), ErrorKind.execution_error, "Error executing tool add_then_exit"),
                (("slow", {"seconds": 5}), ErrorKind.timeout, "exceeded 1 s"),
                (("slow_sync", {"seconds": 1.5}), ErrorKind.timeout, "exceeded 1 s"),
            ]
            for (name, args), kind, msg in cases:
                out = await rt.call_tool(a, name, args)
                assert not out.ok and out.error_kind == kind and msg in out.text, (name, out)
                assert (await rt.call_tool(b, "list_notes")).ok  # other sessions unaffected
            for text, msg in [("add_note(", "not a call"), ("add_note(text=open('x'))", "not a literal"),
                              ("1 + 2", "expected a call"), ("add_note(**kw)", "**kwargs")]:
                out = await rt.call(a, text)
                assert out.error_kind == ErrorKind.invalid_args and msg in out.text, (text, out.text)
            # the failed tool's insert was rolled back; the session still works
            assert [n["text"] for n in (await rt.call_tool(a, "list_notes")).result] == ["seed"]
            assert (await rt.call(a, 'add_note("positional")')).result == {"id": 2}
            log = rt.log(a)
            kinds = [e.error_kind for e in log if e.event == "call"]
            assert kinds.count(ErrorKind.invalid_args) == 9 and kinds.count(ErrorKind.timeout) == 2
            st = rt.stats.get(h, "add_note")
            assert st["calls"] == 6 and st["errors"] == {"invalid_args": 5} and st["server"] == "notes"
            assert st["p50_ms"] is not None and st["p99_ms"] >= st["p50_ms"]
            assert rt.stats.get(h, "slow")["errors"] == {"timeout": 1}
            assert rt.stats.get(h, "nope")["errors"] == {"unknown_tool": 1}
            rows = rt.stats.rows()
            assert all(r["server_hash"] == h for r in rows)
    run(main)


def test_bad_session_and_server_input(notes_snapshot, tmp_path):
    async def main():
        async with Runtime() as rt:
            with pytest.raises(ServerImportError):
                rt.register(SERVERS / "broken_import.py")
            assert rt.events[-1].error_kind == ErrorKind.infrastructure
            h = rt.register(SERVERS / "notes.py")
            with pytest.raises(UnknownServerError):
                await rt.create_session("f" * 64, notes_snapshot)
            with pytest.raises(SnapshotSchemaError, match="missing table 'notes'"):
                await rt.create_session(h, snapshot_from_sql("CREATE TABLE other (x);"))
            assert "SnapshotSchemaError" in rt.events[-1].message
            with pytest.raises(TypeError, match="Snapshot"):
                await rt.create_session(h, b"raw bytes")
            with pytest.raises(ValueError, match="session_id"):
                await rt.create_session(h, notes_snapshot, session_id="a/b")
            with pytest.raises(UnknownSessionError):
                await rt.call_tool("missing", "list_notes")
            sid = await rt.create_session(h, notes_snapshot, session_id="s1")
            with pytest.raises(ValueError, match="already open"):
                await rt.create_session(h, notes_snapshot, session_id="s1")
            await rt.close(sid, keep_log=True)
            with pytest.raises(SessionClosedError):
                await rt.call_tool(sid, "list_notes")
            assert rt.log(sid)[-1].event == "close"
            rt.forget(sid)
            with pytest.raises(UnknownSessionError):
                rt.log(sid)
            other = await rt.create_session(h, notes_snapshot)
            await rt.close(other)  # no keep_log: nothing stays
            with pytest.raises(UnknownSessionError, match="keep_log"):
                await rt.call_tool(other, "list_notes")
            ok = await rt.create_session(h, notes_snapshot)
            assert (await rt.call_tool(ok, "list_notes")).ok
        with pytest.raises(TypeError, match="registry"):
            Runtime(registry={})
        with pytest.raises(ValueError, match="timeout_s"):
            Runtime(timeout_s=0)
    run(main)


def test_reset_byte_identical_fork_and_diff(notes_snapshot):
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "notes.py")
            a = await rt.create_session(h, notes_snapshot)
            await rt.call_tool(a, "add_note", {"text": "one"})
            f = await rt.fork(a)
            await rt.call_tool(f, "add_note", {"text": "two", "tag": "x"})
            assert [n["text"] for n in (await rt.call_tool(a, "list_notes")).result] == ["seed", "one"]
            assert [n["text"] for n in (await rt.call_tool(f, "list_notes")).result] == ["seed", "one", "two"]
            d = rt.diff(a, f)
            assert d.counts() == {"notes": {"added": 1, "changed": 0, "removed": 0}}
            assert list(d.tables["notes"].added.values())[0]["text"] == "two"
            assert rt.diff(f).counts() == {"notes": {"added": 2, "changed": 0, "removed": 0}}
            rt.state(a).execute("UPDATE notes SET tag = 'b' WHERE id = 1")
            rt.state(a).commit()
            assert rt.diff(a).tables["notes"].changed["[1]"].after["tag"] == "b"
            assert rt.snapshot(a).data != notes_snapshot.data
            await rt.reset(a)
            assert rt.snapshot(a).data == notes_snapshot.data  # byte-identical
            assert rt.diff(a).empty
            await rt.reset(f)
            assert rt.snapshot(f).data == notes_snapshot.data
            assert [e.event for e in rt.log(f)][:2] == ["fork", "call"]
    run(main)


@pytest.mark.parametrize("isolation, leaks", [(None, False), ("shared", True)])
def test_class_attribute_env_isolated_under_concurrency(isolation, leaks):
    """Class-attribute state leaks between sessions when forced shared; the static check isolates it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ledger_for_snapshot", SERVERS / "ledger_classattr.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    snap = snapshot_from_object(mod.Ledger())

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "ledger_classattr.py", isolation=isolation)
            assert rt.registry.spec(h).isolation == ("shared" if leaks else "isolated")
            sids = [await rt.create_session(h, snap) for _ in range(4)]

            async def worker(i, sid):
                for _ in range(10):
                    out = await rt.call_tool(sid, "add", {"amount": i + 1})
                    assert out.ok
                    await anyio.sleep(0)
                await rt.call_tool(sid, "set_owner", {"owner": f"o{i}"})

            async with anyio.create_task_group() as tg:
                for i, sid in enumerate(sids):
                    tg.start_soon(worker, i, sid)
            results = [(await rt.call_tool(sid, "read")).result for sid in sids]
            for i, r in enumerate(results):
                assert r["owner"] == f"o{i}"  # instance attributes are always private
            private = all(r["total"] == 10 * (i + 1) and r["entries"] == [i + 1] * 10 for i, r in enumerate(results))
            assert private is (not leaks)
            if not leaks:
                await rt.reset(sids[0])  # isolated reset re-imports the module: class attributes start over
                assert (await rt.call_tool(sids[0], "read")).result == {"entries": [], "total": 0, "owner": "nobody"}
                assert (await rt.call_tool(sids[1], "read")).result["total"] == 20
                assert rt.snapshot(sids[0]).data == snap.data
    run(main)


def test_sqlite_sessions_private_under_concurrent_mutation(notes_snapshot):
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "notes.py")
            sids = [await rt.create_session(h, notes_snapshot) for _ in range(6)]

            async def worker(i, sid):
                for j in range(15):
                    assert (await rt.call_tool(sid, "add_note", {"text": f"s{i}-{j}", "tag": str(i)})).ok

            async with anyio.create_task_group() as tg:
                for i, sid in enumerate(sids):
                    tg.start_soon(worker, i, sid)
            for i, sid in enumerate(sids):
                notes = (await rt.call_tool(sid, "list_notes")).result
                assert [n["text"] for n in notes] == ["seed"] + [f"s{i}-{j}" for j in range(15)]
                assert rt.diff(sid).counts() == {"notes": {"added": 15, "changed": 0, "removed": 0}}
    run(main)


def test_object_state_server_shared_reset_fork_diff():
    import importlib.util

    spec = importlib.util.spec_from_file_location("wallet_for_snapshot", SERVERS / "wallet_obj.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    snap = snapshot_from_object(mod.Wallet(balances={"ann": 5}))

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "wallet_obj.py")
            assert rt.registry.spec(h).isolation == "shared"
            a = await rt.create_session(h, snap)
            b = await rt.create_session(h, snap)
            assert (await rt.call_tool(a, "deposit", {"who": "ann", "amount": 3})).result == {"balance": 8}
            assert (await rt.call_tool(b, "balance", {"who": "ann"})).result == {"balance": 5}
            bad = await rt.call_tool(a, "deposit", {"who": "ann", "amount": -1})
            assert bad.error_kind == ErrorKind.execution_error and "positive" in bad.text
            f = await rt.fork(a)
            await rt.call_tool(f, "deposit", {"who": "bob", "amount": 1})
            d = rt.diff(a, f).tables["attributes"]
            assert set(d.added) == {"balances.bob"} and set(d.changed) == {"history"}
            assert rt.diff(a).tables["attributes"].changed["balances.ann"].after == 8
            await rt.reset(a)
            assert rt.snapshot(a).data == snap.data
            assert (await rt.call_tool(f, "balance", {"who": "ann"})).result == {"balance": 8}
            with pytest.raises(SnapshotSchemaError, match="missing"):
                await rt.create_session(h, snapshot_from_object(type("Other", (), {})()))
    run(main)


def test_available_tools_restrict_the_agent(notes_snapshot):
    async def main():
        async with Runtime() as rt:
            sid = await rt.create_session(rt.register(SERVERS / "notes.py"), notes_snapshot)
            rt.set_available_tools(sid, ["list_notes"])
            assert rt.available_tools(sid) == ["list_notes"]
            assert [t["name"] for t in await rt.list_tools(sid)] == ["list_notes"]
            out = await rt.call_tool(sid, "add_note", {"text": "x"})
            assert out.error_kind == ErrorKind.unknown_tool and "available: ['list_notes']" in out.text
            assert (await rt.call_tool(sid, "list_notes")).ok
            with pytest.raises(ValueError, match="not tools of server"):
                rt.set_available_tools(sid, ["nope"])
            rt.set_available_tools(sid, None)
            assert (await rt.call_tool(sid, "add_note", {"text": "x"})).ok
    run(main)


@pytest.mark.parametrize("isolation", [None, "isolated"])
def test_object_state_with_module_classes_moves_between_imports(isolation):
    """Snapshots pickle instances of the server module's own classes; sessions (each possibly a separate
    import of the module) and restores resolve them in their own copy of the module."""
    from treadle.weft.runtime.registry import release_module

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "tree_obj.py", isolation=isolation)
            module, weft = rt.registry.load(h)
            t = module.Tree()
            t._load_scenario({"dirs": ["a", "b"]})
            snap = snapshot_from_object(t)
            release_module(module)  # the module the snapshot was pickled from is gone
            a = await rt.create_session(h, snap)
            assert (await rt.call_tool(a, "ls")).result == ["a", "b"]
            assert (await rt.call_tool(a, "mkdir", {"name": "c"})).result == {"dirs": ["a", "b", "c"]}
            assert type(rt.state(a).root).__module__ == type(rt.state(a)).__module__
            f = await rt.fork(a)
            await rt.call_tool(f, "mkdir", {"name": "d"})
            assert (await rt.call_tool(a, "ls")).result == ["a", "b", "c"]
            assert rt.diff(a, f).touched() == {"attributes"}
            await rt.reset(a)
            assert rt.snapshot(a).data == snap.data
            assert (await rt.call_tool(a, "ls")).result == ["a", "b"]
    run(main)


def test_servers_writing_globals_are_serialised_across_sessions():
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("gc_for_snapshot", SERVERS / "global_counter.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    snap = snapshot_from_object(mod.Box())

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "global_counter.py")
            assert "global_write" in rt.registry.spec(h).report.kinds()
            sids = [await rt.create_session(h, snap) for _ in range(4)]
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(rt.call_tool, sid, "bump", {"sleep_s": 0.1})
            wall = time.perf_counter() - t0
            assert wall >= 0.38, wall  # one at a time (4 x 0.1 s), not concurrent
            for sid in sids:
                assert (await rt.call_tool(sid, "bump", {"sleep_s": 0})).result == {"n": 2}
    run(main)


def test_no_session_observes_another_sessions_writes():
    """A class-level default aliased into instance state must not leak across sessions."""
    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "vpn_obj.py")
            spec = rt.registry.spec(h)
            assert spec.isolation == "isolated"
            assert [(f.kind, f.line) for f in spec.report.findings] == [("class_mutable_attribute", 6)]
            snap = snapshot_from_object(types.SimpleNamespace(vpn=None))
            a = await rt.create_session(h, snap)
            b = await rt.create_session(h, snap)
            out = await rt.call_tool(a, "connect_vpn", {"name": "vpn-a"})
            assert out.ok and out.result == {"connected": False, "server": "vpn-a"}
            assert (await rt.call_tool(b, "default_vpn")).result == {"connected": False, "server": None}
            out = await rt.call_tool(b, "connect_vpn", {"name": "vpn-b"})
            assert out.result == {"connected": False, "server": "vpn-b"}
            assert (await rt.call_tool(a, "default_vpn")).result == {"connected": False, "server": "vpn-a"}
    run(main)
