"""Atomic-turn GRPO groups -> advantages -> rows a TRL or verl trainer consumes.

Seed: WEFT 4.1 (atomic-turn GRPO: candidates of one turn from one history and one state share a
baseline; turns failing a deterministic check never get a positive advantage).

Row format (:class:`GroupRow`, one JSON line per candidate of ``groups.jsonl``; schema_version 1):

- ``group_key``: hash of (task id, turn, prefix-token hash, state hash): the GRPO group id (verl's
  ``uid``). Rows of one key share ``prompt_ids`` exactly and started from one state.
- ``prompt_ids``: history + the turn's request + generation prompt (the shared prefix).
- ``response_ids``: the turn's segment as generated: policy steps, tool outputs, template glue.
- ``response_mask``: 1 on the policy's own tokens of this turn, 0 on tool outputs and glue. Token
  advantages are ``advantage * response_mask`` on the response and 0 on the whole prefix.
- ``reward``: the atomic task's binary verdict; ``flags``: the deterministic flags; ``valid``: False
  for environment failures (left out of every statistic, advantage 0).
- ``advantage``: from :func:`treadle.ops.grpo_advantages` (group ids = group keys, ``valid``,
  ``flags`` -> flagged rows get ``min(A, 0)``).

Hand-off: :func:`to_verl` gives verl's tensors (``prompts``, ``responses``, ``response_mask``,
``token_level_rewards`` with the reward on the last policy token, ``index`` = uids) for
``algorithm.adv_estimator=treadle_grpo`` (:mod:`treadle.grpo.verl_adapter`); :func:`to_trl` gives
TRL's layout (each group's G completions contiguous: ``prompt_ids``, ``completion_ids``,
``completion_mask``, ``rewards``) for :func:`treadle.grpo.trl_adapter.trl_advantages`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from treadle.weft.rl.sampling import TurnGroup

__all__ = ["token_advantages", "GroupRow", "GroupStats", "group_stats", "has_signal", "group_advantages", "rows_of",
           "to_verl", "to_trl"]


class GroupRow(BaseModel):
    """One candidate as a training row (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    schema_version: int = 1
    group_key: str
    task_id: str
    turn: int
    candidate: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    response_mask: tuple[int, ...]
    reward: float
    flags: tuple[str, ...] = ()
    valid: bool = True
    env_failure: str | None = None
    advantage: float = Field(description="Row advantage; token advantages are advantage * response_mask.")


class GroupStats(BaseModel):
    """Counts over a batch of groups (reported, never silently zeroed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    groups: int
    rows: int
    valid_rows: int
    env_failures: int
    singleton_groups: int = Field(description="Groups with fewer than 2 valid rows (no baseline: advantage 0).")
    all_equal_groups: int = Field(description="Groups whose valid rewards are all equal (advantage exactly 0).")
    all_pass_groups: int
    all_fail_groups: int
    flagged_rows: int
    flagged_successful_rows: int = Field(description="Flagged rows with reward 1 (clamped to advantage <= 0).")
    mean_reward: float


def has_signal(rewards: Sequence[float]) -> bool:
    """True when a group's valid rewards (environment failures left out) can give a non-zero advantage: at
    least two of them and not all equal (DAPO's dynamic sampling keeps only such groups)."""
    return len(rewards) >= 2 and len(set(rewards)) > 1


def group_stats(groups: Sequence[TurnGroup]) -> GroupStats:
    """:class:`GroupStats` of ``groups``."""
    single = equal = allp = allf = 0
    rows = valid = flagged = flagged_ok = 0
    total = 0.0
    for g in groups:
        rs = [c.r for c in g.candidates if c.env_failure is None]
        rows += len(g.candidates)
        valid += len(rs)
        total += sum(rs)
        flagged += sum(bool(c.flags) for c in g.candidates)
        flagged_ok += sum(bool(c.flags) and c.r == 1 and c.env_failure is None for c in g.candidates)
        if len(rs) < 2:
            single += 1
        elif len(set(rs)) == 1:
            equal += 1
            allp += rs[0] == 1
            allf += rs[0] == 0
    return GroupStats(groups=len(groups), rows=rows, valid_rows=valid, env_failures=rows - valid,
                      singleton_groups=single, all_equal_groups=equal, all_pass_groups=allp, all_fail_groups=allf,
                      flagged_rows=flagged, flagged_successful_rows=flagged_ok, mean_reward=total / max(valid, 1))


def _tensors(groups: Sequence[TurnGroup]):
    from treadle.grpo.grouping import group_ids_from_uids

    keys = [g.key for g in groups for _ in g.candidates]
    rewards = torch.tensor([float(c.r) for g in groups for c in g.candidates], dtype=torch.float32)
    valid = torch.tensor([c.env_failure is None for g in groups for c in g.candidates], dtype=torch.bool)
    flags = torch.tensor([bool(c.flags) for g in groups for c in g.candidates], dtype=torch.bool)
    return keys, group_ids_from_uids(keys), rewards, valid, flags


def group_advantages(groups: Sequence[TurnGroup], *, estimator: str = "grpo", **options) -> torch.Tensor:
    """``(N,)`` float32 advantages of every candidate (groups in order, candidates in order).

    Rows go through :func:`treadle.ops.grpo_advantages` with ``group_ids`` from the group keys,
    ``valid`` = not an environment failure, ``flags`` = any deterministic flag (flagged rows get
    ``min(A, 0)``). ``options`` are passed on (``std``, ``eps``, ``singleton``...).

    Raises:
        ValueError / TypeError: from the op (unknown estimator or option).
    """
    from treadle.ops import grpo_advantages

    _, ids, rewards, valid, flags = _tensors(groups)
    return grpo_advantages(rewards, ids, valid=valid, flags=flags, estimator=estimator, **options)


def rows_of(groups: Sequence[TurnGroup], advantages: torch.Tensor | None = None, **options) -> list[GroupRow]:
    """:class:`GroupRow` per candidate (advantages computed with :func:`group_advantages` when not given)."""
    adv = group_advantages(groups, **options) if advantages is None else advantages
    out, i = [], 0
    for g in groups:
        for c in g.candidates:
            out.append(GroupRow(group_key=g.key, task_id=g.task_id, turn=g.turn, candidate=c.index,
                                prompt_ids=g.prefix_ids, response_ids=c.response_ids, response_mask=c.policy_mask,
                                reward=float(c.r), flags=c.flags, valid=c.env_failure is None,
                                env_failure=c.env_failure, advantage=float(adv[i])))
            i += 1
    return out


def token_advantages(row: GroupRow) -> torch.Tensor:
    """``(len(prompt_ids) + len(response_ids),)`` float32 per-token advantages of a row: 0 on the whole
    prefix, ``advantage`` on the policy tokens of the turn, 0 on tool outputs and template glue
    (:func:`treadle.grpo.broadcast.broadcast_packed` with the prefix as no row)."""
    from treadle.grpo.broadcast import broadcast_packed

    n_p, n_r = len(row.prompt_ids), len(row.response_ids)
    seg = torch.cat([torch.full((n_p,), -1, dtype=torch.int64), torch.zeros(n_r, dtype=torch.int64)])
    pol = torch.cat([torch.zeros(n_p, dtype=torch.bool), torch.tensor(row.response_mask, dtype=torch.bool).reshape(-1)])
    return broadcast_packed(torch.tensor([row.advantage], dtype=torch.float32), seg, pol)


def _pad(seqs: Sequence[Sequence[int]], pad: int, left: bool) -> torch.Tensor:
    w = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), w), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            if left:
                out[i, w - len(s):] = torch.tensor(s)
            else:
                out[i, :len(s)] = torch.tensor(s)
    return out


def to_verl(rows: Sequence[GroupRow], pad_id: int) -> dict:
    """verl's batch fields: ``prompts (B, P)`` left-padded, ``responses (B, R)`` right-padded,
    ``response_mask (B, R)`` (policy tokens of this turn), ``token_level_rewards (B, R)`` float32 (the
    reward on the last policy token), ``index`` (np.ndarray of :class:`treadle.grpo.verl_adapter.RowUid`:
    the group keys, carrying each row's flag and validity; put it in ``non_tensor_batch["uid"]``), and
    ``flags`` / ``valid`` ``(B,)`` bool (the same masks, for a direct call of the estimator).

    verl's trainer passes the registered estimator only rewards, mask, config and ``uid``: the uids are
    what carries the flags and validity through it (tested with ``ray_trainer.compute_advantage``)."""
    import numpy as np

    from treadle.grpo.verl_adapter import RowUid

    mask = _pad([r.response_mask for r in rows], 0, left=False)
    tlr = torch.zeros(mask.shape, dtype=torch.float32)
    for i, r in enumerate(rows):
        pos = [j for j, m in enumerate(r.response_mask) if m]
        if pos:
            tlr[i, pos[-1]] = r.reward
    return {"prompts": _pad([r.prompt_ids for r in rows], pad_id, left=True),
            "responses": _pad([r.response_ids for r in rows], pad_id, left=False), "response_mask": mask,
            "token_level_rewards": tlr,
            "index": np.array([RowUid(r.group_key, bool(r.flags), r.valid) for r in rows], dtype=object),
            "flags": torch.tensor([bool(r.flags) for r in rows]), "valid": torch.tensor([r.valid for r in rows])}


def to_trl(rows: Sequence[GroupRow], pad_id: int) -> dict:
    """TRL's layout: rows sorted so that each group's completions are contiguous (``num_generations``
    = G, the same for every group), ``prompt_ids (B, P)`` left-padded, ``completion_ids (B, C)``,
    ``completion_mask (B, C)`` (policy tokens), ``rewards (B,)``, ``flags`` / ``valid`` ``(B,)``.

    Raises:
        ValueError: groups of different sizes (TRL needs one ``num_generations``).
    """
    order: dict[str, list[GroupRow]] = {}
    for r in rows:
        order.setdefault(r.group_key, []).append(r)
    sizes = {len(v) for v in order.values()}
    if len(sizes) > 1:
        raise ValueError(f"TRL needs one group size (num_generations); got sizes {sorted(sizes)}")
    flat = [r for v in order.values() for r in v]
    return {"prompt_ids": _pad([r.prompt_ids for r in flat], pad_id, left=True),
            "completion_ids": _pad([r.response_ids for r in flat], pad_id, left=False),
            "completion_mask": _pad([r.response_mask for r in flat], 0, left=False),
            "rewards": torch.tensor([r.reward for r in flat], dtype=torch.float32),
            "flags": torch.tensor([bool(r.flags) for r in flat]), "valid": torch.tensor([r.valid for r in flat]),
            "num_generations": sizes.pop() if sizes else 0, "group_keys": [r.group_key for r in flat]}
