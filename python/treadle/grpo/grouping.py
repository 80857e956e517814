"""Group ids for GRPO: from verl-style uid arrays, and atomic-turn groups (WEFT sec. 4.1: turns that
share the task, the turn index and the environment state before the turn are one group)."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch


def group_ids_from_uids(uids, device: torch.device | str | None = None) -> torch.Tensor:
    """Map any hashable uids (verl's ``index`` array of uuid strings, prompt ids...) to ``(N,)`` int64
    ids, equal exactly where the uids are equal (numbered in first-appearance order).

    Raises:
        ValueError: ``uids`` is not one-dimensional.
    """
    arr = uids.detach().cpu().numpy() if isinstance(uids, torch.Tensor) else np.asarray(uids, dtype=object)
    if arr.ndim != 1:
        raise ValueError(f"uids must be one-dimensional, got shape {arr.shape}")
    first: dict = {}
    out = np.empty(len(arr), dtype=np.int64)
    for i, u in enumerate(arr.tolist()):
        out[i] = first.setdefault(u, len(first))
    return torch.from_numpy(out).to(device) if device is not None else torch.from_numpy(out)


def _key(x) -> int | str | bytes:
    if isinstance(x, (bytes, bytearray)):
        return bytes(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, str):
        return x
    raise TypeError(f"state hashes must be int, str or bytes, got {type(x).__name__}")


def atomic_turn_group_ids(task_ids: Sequence | torch.Tensor, turn_indices: Sequence | torch.Tensor,
                          state_hashes: Sequence | torch.Tensor) -> torch.Tensor:
    """``(N,)`` int64 group ids for atomic turns: rows with equal ``(task_id, turn_index, state_hash)``
    share a group (WEFT sec. 4.1). Ids are dense, numbered in first-appearance order.

    Args:
        task_ids: ``N`` task identifiers (ints or strings).
        turn_indices: ``N`` non-negative ints, the turn within the task.
        state_hashes: ``N`` hashes (int, str or bytes) of the environment state before the turn, so
            turns reached from different states never share a baseline.

    Raises:
        ValueError: lengths differ or a turn index is negative. TypeError: an unsupported hash type.
    """
    def as_list(x):
        return x.detach().cpu().tolist() if isinstance(x, torch.Tensor) else list(x)

    tasks, turns, states = as_list(task_ids), as_list(turn_indices), as_list(state_hashes)
    if not (len(tasks) == len(turns) == len(states)):
        raise ValueError(f"task_ids, turn_indices and state_hashes must have one length, got "
                         f"{len(tasks)}, {len(turns)}, {len(states)}")
    for t in turns:
        if int(t) != t or t < 0:
            raise ValueError(f"turn_indices must be non-negative integers, got {t!r}")
    keys = [(_key(a), int(b), _key(c)) for a, b, c in zip(tasks, turns, states)]
    return group_ids_from_uids(np.array([hashlib.blake2b(repr(k).encode(), digest_size=16).hexdigest() for k in keys],
                                        dtype=object))
