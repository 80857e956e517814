"""The build and batch layers: names and config -> objects; concurrent rollouts into a run folder.

Run folder: ``config.json`` (the resolved :class:`SampleConfig`), ``trajectories.jsonl`` (one
:class:`~treadle.weft.rollouts.records.Trajectory` per line, appended and flushed per record).
A rerun skips the keys already saved and refuses to mix runs whose config differs. A rollout that
raises (an infrastructure failure: the runtime, the user simulator's endpoint) or whose policy endpoint
failed is written as a failed trajectory (``failure`` set); it never cancels its siblings, and a rerun redoes it (appending the new
record; :func:`read_trajectories` keeps the last record of each key).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from treadle.weft.rollouts.config import ENVS, Component, SampleConfig, build_setup, env_builder, shop_env
from treadle.weft.rollouts.records import Trajectory
from treadle.weft.rollouts.rollout import ROLLOUTS, endpoint_failure, trajectory_key
from treadle.weft.rollouts.tasks import RolloutTask
from treadle.untrusted import clip

__all__ = ["ENVS", "TRAJECTORIES", "Component", "ConfigMismatchError", "RunDirError", "SampleConfig",
           "build_setup", "check_run_dir", "env_builder", "read_trajectories", "sample", "sample_async", "shop_env"]

TRAJECTORIES = "trajectories.jsonl"


class ConfigMismatchError(ValueError):
    """The run folder holds a different config (resume would mix runs)."""


_NOT_IDENTITY = frozenset({"concurrency"})
"""SampleConfig fields that do not change any trajectory: a resume may change them."""


class RunDirError(ValueError):
    """The run folder cannot be one: an existing file, an unwritable or uncreatable path, or a folder whose
    ``config.json`` is not a JSON object (raised before any rollout; nothing in the folder is changed)."""


def check_run_dir(run_dir: str | Path) -> Path:
    """``Path(run_dir)`` if it can be (or already is) a run folder; raises :class:`RunDirError` otherwise."""
    from treadle.run_dirs import check_out_dir

    try:
        p = check_out_dir(run_dir, "run folder")
    except ValueError as err:
        raise RunDirError(str(err)) from None
    cfg_path = p / "config.json"
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RunDirError(f"{cfg_path} is not a readable JSON config ({err}); fix it or use a new run folder") \
                from None
        if not isinstance(old, dict):
            raise RunDirError(f"{cfg_path} is not a JSON object; fix it or use a new run folder")
    return p


def read_trajectories(path: str | Path) -> list[Trajectory]:
    """Trajectories of a JSONL file, one per key (the last record of a key wins: a rollout that failed for
    an infrastructure reason and was redone by a rerun); a torn last line from a killed run is skipped."""
    out: dict[str, Trajectory] = {}
    p = Path(path)
    if not p.exists():
        return []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            t = Trajectory.model_validate_json(line)
        except ValueError:
            continue
        out[t.key] = t
    return list(out.values())


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a write cut by a kill), so that appends start on a line of their
    own; that rollout is redone on resume."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        f.truncate(data.rfind(b"\n") + 1)


async def sample_async(run_dir: str | Path, tasks: Sequence[RolloutTask], cfg: SampleConfig, *, client: Any = None,
                       console: Any = None, ray_address: str | None = None, ray_workers: int | None = None,
                       llm_config: Any = None) -> list[Trajectory]:
    """Run every (task, method, k) rollout not yet in ``run_dir``; return all trajectories of the run.

    With ``ray_address`` (``auto``, ``local``, ``ray://HOST:PORT``, ``HOST:PORT``) the rollouts run on
    ``ray_workers`` Ray actors (:mod:`treadle.weft.rollouts.ray_driver`; same trajectories; components that
    need an LLM client are rebuilt in each actor from ``llm_config``).

    Raises (before any rollout): :class:`RunDirError` (``run_dir`` cannot be a run folder),
    :class:`ConfigMismatchError` (it holds another config), TypeError / ValueError (bad tasks or components,
    a malformed ``ray_address``), :class:`~treadle.ray_cluster.RayUnavailableError` / ConnectionError (Ray
    missing / no cluster at ``ray_address``; a ``HOST:PORT`` that does not answer takes Ray's own GCS
    connection timeout, minutes, to fail).
    """
    if ray_address is not None:
        from treadle.ray_cluster import check_address
        from treadle.weft.rollouts.ray_driver import needs_llm_client

        check_address(ray_address)
        if ray_workers is not None and (not isinstance(ray_workers, int) or ray_workers < 1):
            raise ValueError(f"ray_workers must be an int >= 1, got {ray_workers!r}")
        if needs_llm_client(cfg) and llm_config is None:
            raise ValueError("with Ray, the llm policy / simuser-llm view need llm_config (CLI: --llm-config): "
                             "each actor opens its own client")
    from treadle.weft.runtime import Runtime

    setup = build_setup(cfg, client=client)
    for t in tasks:  # typed errors before the batch
        if not isinstance(t, RolloutTask):
            raise TypeError(f"tasks must be RolloutTask, got {type(t).__name__}")
        t.ordered()
        try:
            env_builder(t.env)
        except ValueError as err:
            raise ValueError(f"task {t.name!r}: {err}") from None
    run_dir = check_run_dir(run_dir)
    if ray_address is not None:  # connect before the run folder is touched (ConnectionError: no cluster there)
        from treadle.ray_cluster import ensure_ray

        await anyio.to_thread.run_sync(ensure_ray, ray_address)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.json"
    doc = cfg.model_dump(mode="json")
    if cfg_path.exists():
        old = json.loads(cfg_path.read_text(encoding="utf-8"))
        diff = sorted(k for k in set(old) | set(doc) if old.get(k) != doc.get(k) and k not in _NOT_IDENTITY)
        if diff:
            raise ConfigMismatchError(f"{cfg_path} holds another config (differs in {diff}); use a new run folder")
    else:
        tmp = cfg_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
        tmp.replace(cfg_path)
    out_path = run_dir / TRAJECTORIES
    _drop_torn_tail(out_path)
    done = {t.key for t in read_trajectories(out_path)  # failed rollouts are redone (endpoint failures of
            if t.failure is None and not any(map(endpoint_failure, t.attempts))}  # records from before too)
    jobs = [(t, m, k) for t in tasks for m in cfg.methods for k in cfg.ks
            if trajectory_key(t, m, k, setup) not in done]
    lock = anyio.Lock()
    limiter = anyio.CapacityLimiter(cfg.concurrency)
    progress = None
    if console is not None:
        from rich.progress import Progress

        progress = Progress(console=console, transient=True)
        bar = progress.add_task("rollouts", total=len(jobs))
        progress.start()
    try:
        async with Runtime() as rt:
            envs = {name: await env_builder(name)(rt) for name in sorted({t.env for t in tasks})}
            with out_path.open("a", encoding="utf-8") as fh:
                if ray_address is not None:
                    from treadle.weft.rollouts.ray_driver import run_on_ray

                    def write(tr: Trajectory) -> None:  # lanes write from the event loop: one at a time
                        fh.write(tr.model_dump_json() + "\n")
                        fh.flush()
                        if progress is not None:
                            progress.advance(bar)

                    await run_on_ray(jobs, envs=envs, setup=setup, cfg=cfg, write=write, address=ray_address,
                                     workers=ray_workers, llm_config=llm_config)
                    jobs = []

                async def one(task: RolloutTask, method: str, k: int) -> None:
                    async with limiter:
                        env = envs[task.env]
                        try:
                            tr = await ROLLOUTS[method](rt, env, task, k, setup)
                        except Exception as err:  # noqa: BLE001  (recorded; siblings go on)
                            from treadle.weft.rollouts.rollout import _trajectory

                            tr = _trajectory(task, env, method, k, setup, [], [], [], [], False,
                                             failure=clip(f"{type(err).__name__}: {err}", 1000))
                        async with lock:
                            fh.write(tr.model_dump_json() + "\n")
                            fh.flush()
                            if progress is not None:
                                progress.advance(bar)

                async with anyio.create_task_group() as tg:
                    for job in jobs:
                        tg.start_soon(one, *job)
    finally:
        if progress is not None:
            progress.stop()
    return read_trajectories(out_path)


def sample(run_dir: str | Path, tasks: Sequence[RolloutTask], cfg: SampleConfig, *, client: Any = None,
           console: Any = None, **ray_args: Any) -> list[Trajectory]:
    """Synchronous :func:`sample_async` (its own event loop: call from plain code, not from async);
    ``ray_args``: ``ray_address``, ``ray_workers``, ``llm_config`` as there."""
    return anyio.run(lambda: sample_async(run_dir, tasks, cfg, client=client, console=console, **ray_args))
