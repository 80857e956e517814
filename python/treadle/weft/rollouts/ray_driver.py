"""The rollout driver on Ray: rollouts run on Ray actors, each holding its own runtime.

Seed: WEFT 4.1 (rejection sampling at scale over many runtime workers). :func:`sample_async` with
``ray_address`` hands its pending ``(task, method, k)`` rollouts to :func:`run_on_ray`:

- ``workers`` actors (:class:`RolloutActor`, ``SPREAD`` over the cluster's nodes) each open a
  :class:`~treadle.weft.runtime.Runtime`, build the environments of the run, and run whole rollouts
  (the same :data:`~treadle.weft.rollouts.rollout.ROLLOUTS` functions as the single-process driver);
  ``concurrency`` rollouts are in flight over all actors together;
- the components travel pickled (the :class:`~treadle.weft.rollouts.rollout.Setup` the driver built), except
  those that need an LLM client (``llm`` policy, ``simuser-llm`` view): each actor opens its own
  :class:`~treadle.llm.LLMClient` from the run's config (no shared cache or ledger then);
- the driver writes every finished trajectory to ``trajectories.jsonl`` at once (one writer, as without
  Ray): that file is the run's checkpoint. An actor that dies (``ray.kill``, a lost node) loses only the
  rollouts it had in flight; they are resubmitted to a replacement actor (``max_retries`` times, then written
  as failed trajectories that a rerun redoes). Nothing already written is redone.

Results equal the single-process run for the same seeds (rollouts are deterministic in the setup, the
task, the method and ``k``; each runs in sessions of its own).
"""
from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from treadle.weft.rollouts.records import Trajectory
from treadle.weft.rollouts.tasks import RolloutTask
from treadle.untrusted import clip

__all__ = ["RolloutActor", "needs_llm_client", "run_on_ray"]


class RolloutActor:
    """A Ray actor running rollouts in its own runtime (an anyio event loop on a thread of its own; the actor is
    threaded, so ``max_concurrency`` rollouts overlap in it)."""

    def __init__(self, env_names: Sequence[str], setup: Any = None, cfg_json: str | None = None,
                 llm_config: Any = None):
        from treadle.weft.rollouts.config import SampleConfig, build_setup, env_builder
        from treadle.weft.runtime import Runtime

        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.client = None
        if setup is None:  # components that need an LLM client: rebuilt here around a client of our own
            from treadle.llm import LLMClient

            client = llm_config() if callable(llm_config) else LLMClient(llm_config)
            self._client_cm = self.portal.wrap_async_context_manager(client)
            self.client = self._client_cm.__enter__()
            setup = build_setup(SampleConfig.model_validate_json(cfg_json), client=self.client)
        self.setup = setup
        self._rt_cm = self.portal.wrap_async_context_manager(Runtime())
        self.rt = self._rt_cm.__enter__()
        self.envs = {name: self.portal.call(env_builder(name), self.rt) for name in env_names}

    def pid(self) -> int:
        return os.getpid()

    def rollout(self, task: RolloutTask, method: str, k: int) -> str:
        """One rollout; its trajectory as JSON (a rollout that raises becomes a failed trajectory, as in
        :func:`~treadle.weft.rollouts.batch.sample_async`)."""
        from treadle.weft.rollouts.rollout import ROLLOUTS, _trajectory

        env = self.envs[task.env]
        try:
            tr = self.portal.call(ROLLOUTS[method], self.rt, env, task, k, self.setup)
        except Exception as err:  # noqa: BLE001  (recorded; siblings go on)
            tr = _trajectory(task, env, method, k, self.setup, [], [], [], [], False,
                             failure=clip(f"{type(err).__name__}: {err}", 1000))
        return tr.model_dump_json()


def needs_llm_client(cfg: Any) -> bool:
    """True when the config's components need an LLM client (``llm`` policy, a view such as ``simuser-llm``)."""
    from treadle.weft.rollouts.registry import VIEWS

    return cfg.policy.name == "llm" or bool(getattr(VIEWS.get(cfg.view.name), "needs_client", False))


async def run_on_ray(jobs: Sequence[tuple[RolloutTask, str, int]], *, envs: dict[str, Any], setup: Any, cfg: Any,
                     write: Callable[[Trajectory], None], address: str | None = "auto", workers: int | None = None,
                     llm_config: Any = None, max_retries: int = 3, num_cpus: float = 1,
                     on_actors: Callable[[list], None] | None = None) -> None:
    """Run ``jobs`` on Ray actors and ``write`` each trajectory as it finishes (in the driver, one at a time).

    Args:
        jobs: ``(task, method, k)`` rollouts to run.
        envs: the run's environments by name (built in the driver: failed trajectories list their tools).
        setup: the built components (shipped pickled when no LLM client is needed).
        cfg: the :class:`~treadle.weft.rollouts.batch.SampleConfig` (``concurrency``: rollouts in flight in all).
        address: Ray address (``auto``, ``local``, ``ray://HOST:PORT``, ``HOST:PORT``).
        workers: actors to start (default: as many as the cluster has CPUs, at most ``concurrency`` and at
            most one per job).
        llm_config: the :class:`~treadle.llm.LLMConfig` each actor opens a client from (``llm`` policy,
            ``simuser-llm`` view), or a picklable zero-argument callable returning an unopened
            :class:`~treadle.llm.LLMClient` (another backend, a cache path of its own per actor).
        max_retries: resubmissions of a rollout whose actor died.
        num_cpus: CPUs each actor reserves.
        on_actors: called with the actor handles after each (re)start (tests, chaos drills).

    Raises:
        ValueError: components need an LLM client and no ``llm_config`` was given; bad ``workers``.
        RayUnavailableError / ConnectionError: Ray missing / no cluster at ``address``.
    """
    from treadle.ray_cluster import ensure_ray
    from treadle.weft.rollouts.rollout import _trajectory

    needs_client = needs_llm_client(cfg)
    if needs_client and llm_config is None:
        raise ValueError("with Ray, the llm policy / simuser-llm view need llm_config (CLI: --llm-config)")
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if not jobs:
        return
    ray = await anyio.to_thread.run_sync(ensure_ray, address)
    if workers is None:
        cpus = int(ray.cluster_resources().get("CPU", 1) // num_cpus) or 1
        workers = max(1, min(cpus, cfg.concurrency, len(jobs)))
    workers = min(workers, cfg.concurrency)
    per_actor = -(-cfg.concurrency // workers)
    actor_cls = ray.remote(RolloutActor)
    env_names = sorted(envs)
    ship = (env_names, None, cfg.model_dump_json(), llm_config) if needs_client else (env_names, setup)

    run_id = uuid.uuid4().hex[:8]
    started = itertools.count()

    def start() -> Any:  # named, so that `ray list actors` shows which run an actor serves
        return actor_cls.options(name=f"weft-rollout-{run_id}-{next(started)}", num_cpus=num_cpus,
                                 max_concurrency=per_actor, max_restarts=0, scheduling_strategy="SPREAD").remote(*ship)

    actors = [start() for _ in range(workers)]
    generation = [0] * workers  # bumped when slot i's actor is replaced
    if on_actors is not None:
        on_actors(list(actors))
    replace_lock = anyio.Lock()
    todo: list[tuple[RolloutTask, str, int, int]] = [(t, m, k, 0) for t, m, k in reversed(jobs)]

    in_flight = [0]

    def kill(actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001  (already gone)
            pass

    async def lane(slot: int) -> None:
        while todo or in_flight[0]:
            if not todo:  # a rollout in flight elsewhere may come back for a retry
                await anyio.sleep(0.05)
                continue
            task, method, k, tries = todo.pop()
            gen, actor = generation[slot], actors[slot]
            in_flight[0] += 1
            try:
                text = await actor.rollout.remote(task, method, k)
            except ray.exceptions.RayActorError as err:
                async with replace_lock:
                    if generation[slot] == gen:  # the first lane to see this death replaces the actor
                        kill(actor)
                        actors[slot], generation[slot] = start(), gen + 1
                        if on_actors is not None:
                            on_actors(list(actors))
                if tries < max_retries:
                    todo.append((task, method, k, tries + 1))
                    continue
                tr = _trajectory(task, envs[task.env], method, k, setup, [], [], [], [], False,
                                 failure=clip(f"worker lost {tries + 1} times: {type(err).__name__}: {err}", 1000))
            except Exception as err:  # noqa: BLE001  (Ray could not run it: recorded, a rerun redoes it)
                tr = _trajectory(task, envs[task.env], method, k, setup, [], [], [], [], False,
                                 failure=clip(f"{type(err).__name__}: {err}", 1000))
            else:
                tr = Trajectory.model_validate_json(text)
            finally:
                in_flight[0] -= 1
            write(tr)

    try:
        async with anyio.create_task_group() as tg:
            for i in range(cfg.concurrency):
                tg.start_soon(lane, i % workers)
    finally:
        for a in actors:
            kill(a)
