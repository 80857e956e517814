"""``treadle weft groups``: atomic-turn groups of the tool policy into a run folder (resumable).

Run folder: ``config.json`` (what determines the groups), ``groups.jsonl`` (one
:class:`~treadle.weft.rl.sampling.TurnGroup` per line, written chunk by chunk and flushed), then
``rows.jsonl`` (:class:`~treadle.weft.rl.groups.GroupRow` per candidate, with advantages) and
``stats.json`` (:class:`~treadle.weft.rl.groups.GroupStats` + advantage settings), both written
atomically at the end. Chunk ``i`` covers turn starts ``[i * chunk, (i + 1) * chunk)`` and is
sampled with seed ``seed * 7919 + i``: a resumed run keeps the whole chunks already written, drops
a partial one, and produces exactly the groups an uninterrupted run produces.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from treadle.weft.rl.gold import TurnStart
from treadle.weft.rl.groups import group_stats, rows_of
from treadle.weft.rl.sampling import TurnGroup, sample_groups

__all__ = ["GROUPS", "ROWS", "read_groups", "groups_to_folder", "folder_config", "check_folder", "ConfigMismatchError"]

GROUPS, ROWS = "groups.jsonl", "rows.jsonl"


class ConfigMismatchError(ValueError):
    """The run folder holds groups of another config (resume would mix runs)."""


def read_groups(path: str | Path) -> list[TurnGroup]:
    """Groups of a ``groups.jsonl`` (a torn last line from a killed run is skipped)."""
    p = Path(path)
    out = []
    if p.exists():
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                out.append(TurnGroup.model_validate_json(line))
            except ValueError:
                break
    return out


def folder_config(config: dict, *, G: int, seed: int, chunk: int, max_steps: int) -> dict:
    """The JSON document ``config.json`` holds: ``config`` plus the sampling settings."""
    return json.loads(json.dumps({**config, "G": G, "seed": seed, "chunk": chunk, "max_steps": max_steps}))


def check_folder(run_dir: str | Path, doc: dict) -> None:
    """Raise :class:`ConfigMismatchError` when ``run_dir/config.json`` exists and differs from ``doc``
    (call it before any work; nothing is changed)."""
    cfg_path = Path(run_dir) / "config.json"
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigMismatchError(f"{cfg_path} is not a readable JSON config ({err}); use a new folder") from None
        if old != doc:
            diff = sorted(k for k in set(old) | set(doc) if not isinstance(old, dict) or old.get(k) != doc.get(k))
            raise ConfigMismatchError(f"{cfg_path} holds another config (differs in {diff}); use a new folder")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


async def groups_to_folder(rt, server_hash: str, starts: Sequence[TurnStart], G: int, sampler, tokenizer, harness,
                           run_dir: str | Path, *, config: dict, seed: int, chunk: int = 8, max_steps: int = 4,
                           estimator: str = "grpo", on_chunk=None) -> list[TurnGroup]:
    """Sample every chunk not yet in ``run_dir``; write rows and stats; return all groups.

    Raises:
        ConfigMismatchError: ``run_dir/config.json`` holds another config (nothing is changed).
        GroupSizeError: ``G < 2`` (before any work).
    """
    from treadle.weft.rl.sampling import GroupSizeError

    if not isinstance(G, int) or G < 2:
        raise GroupSizeError(f"G (candidates per group) must be an int >= 2, got {G!r}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    doc = folder_config(config, G=G, seed=seed, chunk=chunk, max_steps=max_steps)
    check_folder(run_dir, doc)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        _atomic_write(cfg_path, json.dumps(doc, indent=1))
    gpath = run_dir / GROUPS
    done = read_groups(gpath)
    keep = len(done) // chunk * chunk
    done = done[:keep]
    _atomic_write(gpath, "".join(g.model_dump_json() + "\n" for g in done))  # drop a partial chunk / torn line
    with gpath.open("a", encoding="utf-8") as fh:
        for i in range(keep // chunk, (len(starts) + chunk - 1) // chunk):
            part = await sample_groups(rt, server_hash, starts[i * chunk:(i + 1) * chunk], G, sampler, tokenizer,
                                       harness, seed=seed * 7919 + i, max_steps=max_steps, replay_check=False)
            for g in part:
                fh.write(g.model_dump_json() + "\n")
            fh.flush()
            done += part
            if on_chunk is not None:
                on_chunk(i, part)
    rows = rows_of(done, estimator=estimator)
    _atomic_write(run_dir / ROWS, "".join(r.model_dump_json() + "\n" for r in rows))
    stats = group_stats(done).model_dump()
    stats["estimator"] = estimator
    _atomic_write(run_dir / "stats.json", json.dumps(stats, indent=1))
    return done
