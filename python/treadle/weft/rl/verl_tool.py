"""WEFT on verl: a ``verl.tools.base_tool.BaseTool`` serving the shop's tools per trajectory, the tool config
verl reads, the dataset rows, and the hand-off of WEFT flags to the atomic-turn estimator.

Seed: WEFT 4.1 (atomic-turn GRPO). verl's ``ToolAgentLoop`` calls ``create`` / ``execute`` / ``release``
around every single tool call (``create`` gets the row's ``tools_kwargs[name]["create_kwargs"]``), so a
trajectory's WEFT session cannot live in a tool instance: it is keyed by a trajectory key the first
``execute`` of a trajectory writes into ``agent_data.extra_fields["weft_trajectory"]`` (a fresh uuid; verl's
request id is not unique: ``full_determinism`` gives every trajectory of a priority the same one). That first
call forks the row's start state (copy-on-write, :class:`~treadle.weft.rl.trl_env.WeftBackend`); later calls
of the same trajectory, to any of the tools, run in that fork. Open trajectories beyond ``max_open`` (tool
config) are closed oldest first. ``release`` forgets the per-call instance only.

verl's agent loop never calls ``BaseTool.calc_reward``: the verdict reaches verl's reward through
:class:`treadle.weft.rl.verl_reward.WeftToolAgentLoop` (agent ``weft_tool_agent``), which ends each
trajectory with :func:`finish` (the verdict, then the fork is closed) and writes it into the trajectory's extra
fields, where verl's reward manager hands it to :func:`treadle.weft.rl.verl_reward.compute_score`.
``calc_reward`` does the same for a caller that asks the tool.

Each ``execute`` writes into ``agent_data.extra_fields`` (verl puts them into the batch's
``non_tensor_batch``): ``weft_flags`` (the deterministic flags so far), ``weft_env_failure`` (None or the
failure). :func:`tag_uids` turns them into :class:`~treadle.grpo.verl_adapter.RowUid` uids, which the
registered estimator ``treadle_grpo`` reads (flagged turns ``min(A, 0)``, environment failures left out).

Tool config: :func:`write_tool_config` writes the YAML verl's ``initialize_tools_from_config`` reads (one
entry per shop tool, ``class_name: treadle.weft.rl.verl_tool.WeftVerlTool``, the OpenAI schema from the MCP
server). Rows: :func:`verl_rows` (``prompt``, ``agent_name: weft_tool_agent``, ``extra_info.tools_kwargs``).
The launch command and the trainer config: :mod:`treadle.weft.rl.verl_reward`.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import json
import threading
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from treadle.weft.rl.trl_env import ROW_COLUMNS, WeftBackend, WeftRollout, default_backend

__all__ = ["WeftVerlTool", "openai_schema", "write_tool_config", "verl_rows", "tag_uids", "trajectories", "finish",
           "AGENT_NAME", "TRAJECTORY_KEY"]

AGENT_NAME = "weft_tool_agent"
"""verl's agent-loop name of :class:`treadle.weft.rl.verl_reward.WeftToolAgentLoop` (the rows' ``agent_name``)."""
TRAJECTORY_KEY = "weft_trajectory"
"""The extra field that keys a trajectory's fork (written by its first tool call)."""


def openai_schema(spec: dict) -> dict:
    """verl's OpenAI tool schema of a runtime tool (verl keeps ``type``, ``description`` and ``enum`` per
    property; the runtime still checks every call against the full JSON schema)."""
    props = {}
    for k, p in (spec.get("input_schema") or {}).get("properties", {}).items():
        if "anyOf" in p:
            kinds = [s.get("type", "object") for s in p["anyOf"]]
        else:
            kinds = p.get("type", "object" if "$ref" in p else "string")
        entry = {"type": kinds, "description": p.get("description") or p.get("title") or k}
        if "enum" in p:
            entry["enum"] = p["enum"]
        props[k] = entry
    return {"type": "function", "function": {
        "name": spec["name"], "description": spec.get("description") or spec["name"],
        "parameters": {"type": "object", "properties": props,
                       "required": list((spec.get("input_schema") or {}).get("required", []))}}}


def write_tool_config(path, *, backend: WeftBackend | None = None, max_open: int = 4096) -> list[str]:
    """Write verl's tool config YAML for every shop tool to ``path``; returns the tool names."""
    import yaml

    be = backend if backend is not None else default_backend()
    tools = [{"class_name": "treadle.weft.rl.verl_tool.WeftVerlTool",
              "config": {"type": "native", "max_open": max_open}, "tool_schema": openai_schema(spec)}
             for spec in be.tools()]
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump({"tools": tools}, fh, sort_keys=False)
    return [t["tool_schema"]["function"]["name"] for t in tools]


def verl_rows(episodes: int, split: str = "train", *, start: int = 0, backend: WeftBackend | None = None) -> list:
    """verl dataset rows, one per atomic-turn start: ``prompt`` (messages), ``data_source``, ``agent_name``
    (``weft_tool_agent``), ``reward_model``, and ``extra_info.tools_kwargs`` (every tool's ``create_kwargs`` = the
    row's state reference, :data:`~treadle.weft.rl.trl_env.ROW_COLUMNS`)."""
    from treadle.weft.rl.trl_env import weft_turn_dataset

    be = backend if backend is not None else default_backend()
    names = [s["name"] for s in be.tools()]
    out = []
    for r in weft_turn_dataset(episodes, split, start=start, backend=be):
        ref = {c: r[c] for c in ROW_COLUMNS}
        out.append({"prompt": r["prompt"], "data_source": "treadle-weft-shop", "agent_name": AGENT_NAME,
                    "reward_model": {"style": "rule", "ground_truth": json.dumps(ref)},
                    "extra_info": {**ref, "tools_kwargs": {n: {"create_kwargs": ref} for n in names}}})
    return out


class _Trajectories:
    """Open trajectories (trajectory key -> :class:`WeftRollout`), oldest first. Thread-safe: the agent loop
    runs tool calls of concurrent trajectories in executor threads."""

    def __init__(self):
        self.open: collections.OrderedDict[str, WeftRollout] = collections.OrderedDict()
        self.rollout_cls: type | None = None
        self._lock = threading.Lock()

    def new(self, row: dict, backend: WeftBackend) -> WeftRollout:
        """A rollout forked from the row's start state (not kept)."""
        with self._lock:
            if self.rollout_cls is None or self.rollout_cls.backend is not backend:
                self.rollout_cls = type("WeftVerlRollout", (WeftRollout,), {"backend": backend})
            cls = self.rollout_cls
        ro = cls()
        ro.reset(**row)
        return ro

    def get(self, key: str, row: dict, backend: WeftBackend, max_open: int) -> WeftRollout:
        with self._lock:
            if key in self.open:
                self.open.move_to_end(key)
                return self.open[key]
        ro = self.new(row, backend)
        evicted = []
        with self._lock:
            self.open[key] = ro
            while len(self.open) > max_open:
                evicted.append(self.open.popitem(last=False)[1])
        for old in evicted:
            old._close()
        return ro

    def pop(self, key: str | None) -> WeftRollout | None:
        with self._lock:
            return self.open.pop(key, None) if key is not None else None

    def finish(self, key: str) -> None:
        ro = self.pop(key)
        if ro is not None:
            ro._close()


trajectories = _Trajectories()
"""The process's open trajectories (shared by every :class:`WeftVerlTool`: one per tool name)."""


def finish(key: str | None, row: dict, backend: WeftBackend | None = None) -> dict:
    """End a trajectory: its verdict and flags, then its fork is closed. ``key``: its
    :data:`TRAJECTORY_KEY` (None or unknown: the trajectory made no tool call, and its verdict is that of the
    row's start state with no call, from a fresh fork). Synchronous (the runtime's own loop runs the work).

    Returns:
        ``{"weft_reward": 1.0 / 0.0, or None for an environment failure, "weft_flags": [...],
        "weft_env_failure": None or the failure}``.

    Raises:
        WeftRowError: ``row`` names no turn start (only read when the trajectory made no tool call).
    """
    ro = trajectories.pop(key)
    if ro is None:
        ro = trajectories.new(row, backend if backend is not None else default_backend())
    try:
        r = ro.get_reward()
        return {"weft_reward": None if r is None else float(r), "weft_flags": sorted(ro.flags),
                "weft_env_failure": ro.env_failure}
    finally:
        ro._close()


class WeftVerlTool(BaseTool):
    """One shop tool for verl's agent loop (see the module docstring). ``config``: ``type: native``,
    ``max_open`` (open trajectories kept, default 4096)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.backend = default_backend()
        if tool_schema is None:
            raise ValueError("WeftVerlTool needs its tool_schema (write_tool_config writes it)")
        super().__init__(config, tool_schema)
        self.max_open = int((config or {}).get("max_open", 4096))
        self._rows: dict[str, dict] = {}

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

    async def create(self, instance_id: str | None = None, create_kwargs: dict | None = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        """A per-call instance holding the row's state reference (``create_kwargs``).

        Raises:
            WeftRowError: the row names no turn start, or one that does not exist.
        """
        row = dict(create_kwargs or kwargs.get("create_kwargs") or {})
        WeftBackend.reference(row)
        iid = instance_id or uuid4().hex
        self._rows[iid] = row
        return iid, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run the tool in the trajectory's fork (forked from the row's start state on its first call)."""
        agent_data = kwargs.get("agent_data")
        row = self._rows.get(instance_id)
        if row is None:
            return ToolResponse(text="Error (environment): unknown tool instance (create was not called)"), 0.0, {}
        key = instance_id
        if agent_data is not None:
            key = agent_data.extra_fields.setdefault(TRAJECTORY_KEY, uuid4().hex)
        ro = await self._in_thread(trajectories.get, key, row, self.backend, self.max_open)
        text = await self._in_thread(ro._call, self.name, dict(parameters or {}))
        if agent_data is not None:
            agent_data.extra_fields["weft_flags"] = sorted(ro.flags)
            agent_data.extra_fields["weft_env_failure"] = ro.env_failure
        return ToolResponse(text=text), 0.0, {"weft_flags": sorted(ro.flags)}

    async def calc_reward(self, instance_id: str, trajectory: str | None = None, **kwargs) -> float:
        """The atomic task's verdict (1.0 / 0.0) of the trajectory keyed ``trajectory`` (its
        :data:`TRAJECTORY_KEY`; default: the instance id), then its fork is closed; an environment failure
        gives 0.0. verl's agent loop does not call it: :class:`~treadle.weft.rl.verl_reward.WeftToolAgentLoop`
        ends trajectories with :func:`finish`."""
        key = trajectory or instance_id
        if key not in trajectories.open:
            return 0.0
        out = await self._in_thread(finish, key, {}, self.backend)
        return 0.0 if out["weft_reward"] is None else out["weft_reward"]

    async def release(self, instance_id: str, **kwargs) -> None:
        """Forget the per-call instance (the trajectory's fork stays for its next call)."""
        self._rows.pop(instance_id, None)


def tag_uids(non_tensor_batch: dict) -> None:
    """Replace ``non_tensor_batch["uid"]`` by :class:`~treadle.grpo.verl_adapter.RowUid` uids carrying each row's
    WEFT flag (``weft_flags`` non-empty) and validity (no ``weft_env_failure``), in place; rows without those
    fields (no tool call) are unflagged and valid. Call it between the rollout and ``compute_advantage``."""
    import numpy as np

    from treadle.grpo.verl_adapter import RowUid

    uids = non_tensor_batch["uid"]
    n = len(uids)
    flags = non_tensor_batch.get("weft_flags", [None] * n)
    fails = non_tensor_batch.get("weft_env_failure", [None] * n)
    non_tensor_batch["uid"] = np.array([RowUid(str(u), bool(f), e is None) for u, f, e in zip(uids, flags, fails)],
                                       dtype=object)


def _main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m treadle.weft.rl.verl_tool",
                                 description="Write verl's WEFT tool config and a train parquet of atomic turns.")
    ap.add_argument("--write-config", required=True, help="tool config YAML to write")
    ap.add_argument("--write-data", help="parquet of atomic-turn rows to write")
    ap.add_argument("--episodes", type=int, default=512, help="episodes (two atomic turns each), >= 1")
    ap.add_argument("--split", default="train", choices=("train", "heldout"))
    args = ap.parse_args(argv)
    if args.episodes < 1:
        ap.error(f"--episodes must be >= 1, got {args.episodes}")
    names = write_tool_config(args.write_config)
    print(f"{args.write_config}: {len(names)} tools ({', '.join(names)})")
    if args.write_data:
        import pandas as pd

        rows = verl_rows(args.episodes, args.split)
        pd.DataFrame(rows).to_parquet(args.write_data)
        print(f"{args.write_data}: {len(rows)} atomic-turn rows")


if __name__ == "__main__":
    _main()
