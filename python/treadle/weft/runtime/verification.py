"""Atomic-turn verification inside the runtime: gold calls replayed on verifier-private sessions."""
from __future__ import annotations

import uuid
from typing import Any

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.runtime.registry import ServerSpec
from treadle.weft.runtime.records import ToolOutcome
from treadle.weft.runtime.sessions import _Session
from treadle.weft.runtime.state import Snapshot, StateBackend
from treadle.weft.runtime.verify import CheckpointResult, CheckpointSpec, filter_diff, judge_checkpoint


class VerificationMixin:
    """Verification methods of :class:`~treadle.weft.runtime.Runtime`."""

    async def verify_turn(self, session_id: str, start: Snapshot, spec: CheckpointSpec,
                          outcomes: list[ToolOutcome], *, replay_check: bool = True) -> CheckpointResult:
        """Judge one atomic turn of a session, inside the runtime (seed: WEFT 4.1 atomic-turn checks).

        The gold calls of ``spec`` are replayed through the same server on a verifier-private
        session cloned from ``start`` (the turn's start state, from :meth:`snapshot` before the
        turn); that session never appears in :meth:`sessions` or the statistics and is dropped
        afterwards. The agent's state is then compared with the gold state and the tool returns
        with the gold results (see :func:`~treadle.weft.runtime.verify.judge_checkpoint`).

        With ``replay_check`` (default) the gold is replayed twice from ``start``; when the two
        replays disagree (a tool reads the process clock or a global random source instead of
        :mod:`treadle.weft.runtime.determinism`), a failed check is attributed to the environment
        (``nondeterministic_environment``, not a policy failure). The session clock and random
        source travel with ``start``, so tools that use them replay exactly.

        Raises:
            TypeError: ``spec`` is not a CheckpointSpec or ``start`` not a Snapshot.
            UnsupportedOperationError: remote-transport session.
        """
        if not isinstance(spec, CheckpointSpec):
            raise TypeError(f"spec must be a CheckpointSpec, got {type(spec).__name__}")
        if not isinstance(start, Snapshot):
            raise TypeError(f"start must be a Snapshot, got {type(start).__name__}")
        s = self._session(session_id)
        state = self._local_state(s, "verification")
        if spec.gold_calls is None:
            return judge_checkpoint(spec, state, outcomes)
        first = await self._replay_gold(s.spec, start, spec.gold_calls)
        try:
            expected, gold_results, gold_error = first
            reproducible = True
            if expected is not None and replay_check:
                again, results2, error2 = await self._replay_gold(s.spec, start, spec.gold_calls)
                try:
                    # the replays need to agree on what the check observes (same tables, same privacy)
                    reproducible = (again is not None and error2 == gold_error and results2 == gold_results
                                    and filter_diff(expected.diff(again), spec.ignore_tables,
                                                    spec.compare_private).empty
                                    and expected.env.freeze() == again.env.freeze())
                finally:
                    if again is not None:
                        again.close()
            return judge_checkpoint(spec, state, outcomes, expected, gold_results, gold_error,
                                    gold_reproducible=reproducible)
        finally:
            if first[0] is not None:
                first[0].close()

    async def _replay_gold(self, spec: ServerSpec, start: Snapshot, calls: list[ToolCall]
                           ) -> tuple[StateBackend | None, list[Any], str]:
        """Replay ``calls`` on a verifier-private session cloned from ``start``: (its state, the results,
        the first failure or ""). The hidden session is released on every exit path; its state is
        returned open (the caller closes it)."""
        hid = f"verifier-{uuid.uuid4().hex[:16]}"
        self._hidden.add(hid)
        g: _Session | None = None
        gstate: StateBackend | None = None
        results: list[Any] = []
        error = ""
        try:
            binding, gstate = await self._bind_session(spec, hid, "inproc", start, None)
            g = _Session(id=hid, spec=spec, transport="inproc", initial=start, binding=binding, state=gstate)
            self._sessions[hid] = g
            for c in calls:
                out = await self.call_tool(hid, c.name, c.arguments)
                if not out.ok:
                    error = f"{c}: {out.error_kind.value}: {out.text[:200]}"
                    break
                results.append(out.result)
            return gstate, results, error
        except BaseException:
            if gstate is not None:
                gstate.close()
            raise
        finally:
            if g is not None:
                g.closed = True
                await self._unbind(g)
            self._sessions.pop(hid, None)
            self._hidden.discard(hid)
