"""Environments of one or several servers, and the group of runtime sessions a rollout acts in.

A task's environment may span several servers (a BFCL entry involving a file system and a messaging
API; seed: WEFT 4.1 cross-MCP tasks): the model sees the union of their tools, each call is routed to
the session of the server that owns the tool (the first server wins a name clash; a name no server
has goes to the first, which answers ``unknown_tool``), and a turn's checkpoint is judged per server
on that server's share of the gold calls, the verdicts merged (``r`` = min, reasons united), as
:func:`treadle.weft.envs.bfcl.run_entry` does. With one server everything is passed through unchanged.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.weft.runtime import Runtime, ToolOutcome
from treadle.weft.runtime.state import Snapshot
from treadle.weft.runtime.verify import CheckpointResult, CheckpointSpec, FailureReason


@dataclass(frozen=True)
class Server:
    """One more server of an environment: registered hash, initial snapshot, tools (runtime form)."""

    server_hash: str
    snapshot: Snapshot
    tools: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Env:
    """An environment: its first server (``server_hash``, ``snapshot``, ``tools``) and any ``more`` servers."""

    server_hash: str
    snapshot: Snapshot
    tools: tuple[dict[str, Any], ...]
    more: tuple[Server, ...] = ()

    @property
    def servers(self) -> tuple[Server, ...]:
        return (Server(self.server_hash, self.snapshot, self.tools), *self.more)

    @property
    def all_tools(self) -> tuple[dict[str, Any], ...]:
        """Every tool the model is offered (first owner of a name only)."""
        seen: dict[str, dict[str, Any]] = {}
        for s in self.servers:
            for t in s.tools:
                seen.setdefault(t["name"], t)
        return tuple(seen.values())

    def offered(self, names: Sequence[str] | None) -> tuple[dict[str, Any], ...]:
        """The tools of :attr:`all_tools` named in ``names`` (None: all), in the environment's order."""
        if names is None:
            return self.all_tools
        keep = set(names)
        return tuple(t for t in self.all_tools if t["name"] in keep)

    def owner(self) -> dict[str, int]:
        """Tool name -> index of the server that owns it."""
        out: dict[str, int] = {}
        for i, s in enumerate(self.servers):
            for t in s.tools:
                out.setdefault(t["name"], i)
        return out


async def env_of(rt: Runtime, server: Any, snapshot: Snapshot) -> Env:
    """Register ``server`` (a module, a path or module source, see :meth:`Runtime.register`; or the hash of a server
    ``rt`` already has) and read its tools: the one-server :class:`Env` starting from ``snapshot``."""
    h = server if isinstance(server, str) and server in rt.registry else rt.register(server)
    sid = await rt.create_session(h, snapshot)
    try:
        tools = tuple(await rt.list_tools(sid))
    finally:
        await rt.close(sid)
    return Env(server_hash=h, snapshot=snapshot, tools=tools)


class SessionGroup:
    """One open session per server of ``env`` (index-aligned with ``env.servers``)."""

    def __init__(self, rt: Runtime, env: Env, sids: list[str]):
        self.rt, self.env, self.sids, self._owner = rt, env, sids, env.owner()

    @classmethod
    async def open(cls, rt: Runtime, env: Env) -> "SessionGroup":
        sids: list[str] = []
        try:
            for s in env.servers:
                sids.append(await rt.create_session(s.server_hash, s.snapshot))
        except BaseException:
            for sid in sids:
                await rt.close(sid)
            raise
        return cls(rt, env, sids)

    async def fork(self) -> "SessionGroup":
        """A group whose sessions are copies of these sessions' current states (no replay)."""
        sids: list[str] = []
        try:
            for sid in self.sids:
                sids.append(await self.rt.fork(sid))
        except BaseException:
            for sid in sids:
                await self.rt.close(sid)
            raise
        return SessionGroup(self.rt, self.env, sids)

    def set_available_tools(self, names: Sequence[str] | None) -> None:
        """Offer only ``names`` (tools of any server of the group) from now on; None: every tool.

        Raises:
            ValueError: a name is no tool of any server (nothing is changed then).
        """
        if names is None:
            for sid in self.sids:
                self.rt.set_available_tools(sid, None)
            return
        unknown = sorted(set(names) - set(self._owner))
        if unknown:
            raise ValueError(f"tools {unknown} are offered but no server of the environment has them "
                             f"(tools: {sorted(self._owner)})")
        for i, sid in enumerate(self.sids):
            mine = {t["name"] for t in self.env.servers[i].tools}
            self.rt.set_available_tools(sid, sorted(n for n in names if self._owner[n] == i and n in mine))

    def snapshot(self) -> list[Snapshot]:
        return [self.rt.snapshot(sid) for sid in self.sids]

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> tuple[int, ToolOutcome]:
        """``(server index, outcome)`` of a call routed by tool name (never raises for tool-level failures)."""
        i = self._owner.get(name, 0)
        return i, await self.rt.call_tool(self.sids[i], name, arguments)

    async def verify_turn(self, start: list[Snapshot], spec: CheckpointSpec,
                          outcomes: list[tuple[int, ToolOutcome]]) -> CheckpointResult:
        """Judge a turn on every server (its share of the gold calls and of the outcomes); merged verdict."""
        if len(self.sids) == 1:
            return await self.rt.verify_turn(self.sids[0], start[0], spec, [o for _, o in outcomes])
        parts = []
        for i, sid in enumerate(self.sids):
            share = spec.model_copy(update={"name": f"{spec.name}/{i}", "gold_calls": [
                g for g in spec.gold_calls or [] if self._owner.get(g.name, 0) == i]})
            parts.append(await self.rt.verify_turn(sid, start[i], share, [o for j, o in outcomes if j == i]))
        reasons: list[FailureReason] = []
        for p in parts:
            reasons += [r for r in p.reasons if r not in reasons]
        return CheckpointResult(name=spec.name, r=min(p.r for p in parts), reasons=reasons,
                                details=[d for p in parts for d in p.details])

    async def close(self) -> None:
        for sid in self.sids:
            await self.rt.close(sid)
