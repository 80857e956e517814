"""A deterministic clock and random source per session, carried by snapshots;
non-reproducible gold replays are attributed to the environment, never to the policy."""
from pathlib import Path

import anyio
import pytest

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.checkpoint import CheckpointStore
from treadle.weft.runtime.determinism import DEFAULT_CLOCK_START, EnvState, SessionEnv, session_time
from treadle.weft.runtime.errors import WeftError
from treadle.weft.runtime import Runtime
from treadle.weft.runtime.sqlite_state import snapshot_from_sql
from treadle.weft.runtime.verify import CheckpointSpec, FailureReason

SERVERS = Path(__file__).parent / "servers"
DDL = "CREATE TABLE notes (id TEXT PRIMARY KEY, text TEXT NOT NULL, created REAL NOT NULL, lucky INTEGER);"


def rows(rt, sid):
    return rt.state(sid).execute("SELECT * FROM notes ORDER BY created").fetchall()


def test_session_env_is_deterministic_and_counter_based():
    a, b = SessionEnv(EnvState(seed=7)), SessionEnv(EnvState(seed=7))
    assert [a.random.random() for _ in range(5)] == [b.random.random() for _ in range(5)]
    assert [a.random.randint(0, 100) for _ in range(20)] == [b.random.randint(0, 100) for _ in range(20)]
    assert a.freeze() == b.freeze() and a.freeze().draws > 5
    c = SessionEnv(EnvState(seed=8))
    assert [c.random.random() for _ in range(3)] != [SessionEnv(EnvState(seed=7)).random.random() for _ in range(3)]
    # restoring the state replays the same draws and clock readings
    st = a.freeze()
    x = [a.random.random(), a.now(), a.now()]
    a.load(st)
    assert [a.random.random(), a.now(), a.now()] == x
    assert x[2] - x[1] == 1.0 and SessionEnv().now() == DEFAULT_CLOCK_START
    vals = [SessionEnv(EnvState(seed=s)).random.random() for s in range(2000)]
    assert all(0.0 <= v < 1.0 for v in vals) and 0.45 < sum(vals) / len(vals) < 0.55


def test_session_env_bad_input():
    with pytest.raises(WeftError, match="only available inside a WEFT tool call"):
        session_time()
    with pytest.raises(ValueError, match="clock_step must be > 0"):
        EnvState(clock_step=0)
    with pytest.raises(ValueError, match="draws must be an int >= 0"):
        EnvState(draws=-1)
    with pytest.raises(WeftError, match="seeded by its snapshot"):
        SessionEnv().random.seed(3)


def test_snapshots_carry_the_env_through_fork_reset_and_checkpoint(tmp_path):
    snap = snapshot_from_sql(DDL).with_env(seed=11)

    async def main():
        async with Runtime(checkpoint_store=CheckpointStore(tmp_path / "ck")) as rt:
            h = rt.register(SERVERS / "stamped.py")
            a = await rt.create_session(h, snap)
            first = (await rt.call_tool(a, "add_note", {"text": "x"})).result
            assert first["created"] == DEFAULT_CLOCK_START
            assert rt.snapshot(a).env.ticks == 1 and rt.snapshot(a).env.seed == 11
            f = await rt.fork(a)
            nxt_a = (await rt.call_tool(a, "add_note", {"text": "y"})).result
            nxt_f = (await rt.call_tool(f, "add_note", {"text": "y"})).result
            assert nxt_a == nxt_f and nxt_a["created"] == DEFAULT_CLOCK_START + 1  # the fork continues the clock
            await rt.reset(a)
            assert rt.snapshot(a) == snap
            assert (await rt.call_tool(a, "add_note", {"text": "x"})).result == first
            rec = await rt.checkpoint(a, turn=0)
            assert rec is not None and rec.env["ticks"] == 1
            await rt.close(a)
            await rt.restore_session(a)
            assert rt.snapshot(a).env == EnvState(seed=11, draws=rt.snapshot(a).env.draws, ticks=1)
            assert (await rt.call_tool(a, "add_note", {"text": "y"})).result == nxt_a
    anyio.run(main)


def test_gold_replay_with_session_clock_scores_the_gold_call():
    snap = snapshot_from_sql(DDL)
    spec = CheckpointSpec(name="add", gold_calls=[ToolCall(name="add_note", arguments={"text": "hello"})])

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "stamped.py")
            sid = await rt.create_session(h, snap)
            await rt.call_tool(sid, "add_note", {"text": "before"})
            start = rt.snapshot(sid)
            out = await rt.call(sid, 'add_note(text="hello")')
            res = await rt.verify_turn(sid, start, spec, [out])
            assert res.r == 1 and res.reasons == [], res.details
            bad = await rt.call(sid, 'add_note(text="other")')
            res = await rt.verify_turn(sid, rt.snapshot(sid), spec, [bad])
            assert res.r == 0 and res.policy_failure and FailureReason.nondeterministic_environment not in res.reasons
    anyio.run(main)


def test_non_reproducible_gold_is_an_environment_failure_not_a_policy_one():
    snap = snapshot_from_sql(DDL)
    spec = CheckpointSpec(name="add", gold_calls=[ToolCall(name="add_note_wallclock", arguments={"text": "hello"})])

    async def main():
        async with Runtime() as rt:
            h = rt.register(SERVERS / "stamped.py")
            sid = await rt.create_session(h, snap)
            start = rt.snapshot(sid)
            out = await rt.call(sid, 'add_note_wallclock(text="hello")')  # exactly the gold call
            res = await rt.verify_turn(sid, start, spec, [out])
            assert res.r == 0 and not res.policy_failure
            assert FailureReason.nondeterministic_environment in res.reasons
            assert FailureReason.state_mismatch in res.reasons
            res = await rt.verify_turn(sid, start, spec, [out], replay_check=False)
            assert res.r == 0 and res.policy_failure  # without the replay check it would blame the policy
            assert rt.sessions() == [sid] and not rt._hidden  # verifier sessions released
    anyio.run(main)
