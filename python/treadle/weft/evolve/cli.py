"""``treadle weft reverify``: re-score a rollout run folder with a revised verifier (no new rollouts).

Bad input is one line naming the flag, exit code 2, before any work; the run folder is only read.
Writes ``reverify-<version>.jsonl`` (one :class:`~treadle.weft.evolve.reverify.Rescore` per trajectory)
into ``--out`` (default: the run folder) and prints old vs new rewards.
"""
from __future__ import annotations

from pathlib import Path

import typer

from treadle.cli_output import make_console

console = make_console()


def _fail(flag: str, msg: str) -> None:
    console.print(f"error: {flag}: {msg}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def reverify_cmd(run: Path = typer.Option(..., "--run", help="A `treadle weft sample` run folder."),
                 revision: Path = typer.Option(..., "--revision", help="Verifier revision JSON: "
                                               "{version, checkpoints: {name: {field: value}}}."),
                 out: Path = typer.Option(None, "--out", help="Where reverify-<version>.jsonl goes (default: --run).")
                 ) -> None:
    """Re-score stored rollouts with a revised verifier: recorded calls are replayed, no policy is called."""
    import anyio

    from treadle.weft.evolve.reverify import load_revision, reverify
    from treadle.weft.rollouts.batch import ENVS, TRAJECTORIES, read_trajectories
    from treadle.weft.rollouts.tasks import from_shop

    path = Path(run) / TRAJECTORIES
    if not path.is_file():
        _fail("--run", f"{str(run)!r} holds no {TRAJECTORIES} (expected a `treadle weft sample` run folder)")
    trajs = read_trajectories(path)
    if not trajs:
        _fail("--run", f"{str(path)!r} holds no readable trajectory")
    tasks = from_shop()
    try:
        rev = load_revision(revision, [a.name for t in tasks for a in t.atomic])
    except ValueError as err:
        _fail("--revision", str(err))
    dest = Path(out) if out is not None else Path(run)
    if dest.exists() and not dest.is_dir():
        _fail("--out", f"{str(dest)!r} is a file, expected a folder")
    rows = anyio.run(lambda: reverify(trajs, tasks, rev, ENVS))
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"reverify-{rev.version}.jsonl"
    tmp = target.with_suffix(".tmp")
    tmp.write_text("".join(r.model_dump_json() + "\n" for r in rows), encoding="utf-8")
    tmp.replace(target)
    from rich.table import Table

    t = Table(title=f"re-scored with verifier {rev.version} ({len(rows)} trajectories, no new rollouts)")
    for col in ("task", "old r_k", "new r_k", "old R", "new R"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.task, "".join(map(str, r.old_rewards)), "".join(map(str, r.new_rewards)), f"{r.old_reward:.2f}",
                  f"{r.new_reward:.2f}", style="bold" if r.changed else None)
    console.print(t)
    console.print(f"{sum(r.changed for r in rows)} trajectories changed; written to {target}", markup=False)
