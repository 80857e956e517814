"""WEFT's verdict in verl's reward: an agent loop that ends each trajectory with its verdict, the
``compute_score`` verl's reward manager calls, and the configs a verl user points at.

Seed: WEFT 4.1 (atomic-turn GRPO: the reward of a candidate turn is that turn's verdict). verl 0.9 computes a
trajectory's reward after its agent loop returns: the agent-loop worker sends the trajectory (with its
``extra_fields`` as ``tool_extra_fields``) to a reward-loop worker, whose reward manager (``naive`` by default)
calls ``reward.custom_reward_function`` with ``extra_info`` = the row's ``extra_info`` updated with those extra
fields; the score becomes ``rm_scores`` (the last response token) and the trainer's token-level reward. The
reward worker is another process than the one that holds the trajectory's forked WEFT session, and verl's
agent loop never calls ``BaseTool.calc_reward``. So:

- :class:`WeftToolAgentLoop` (agent name ``weft_tool_agent``, the rows' ``agent_name``) is verl's
  ``ToolAgentLoop`` plus one step at the end of a trajectory, in the process that holds its fork: the verdict
  (:func:`treadle.weft.rl.verl_tool.finish`, which also closes the fork; a trajectory without a tool call is
  verified from a fresh fork of its start state) goes into its extra fields ``weft_reward`` (1.0 / 0.0, None
  for an environment failure), ``weft_flags`` and ``weft_env_failure``.
- :func:`compute_score` reads them back in the reward worker: the score is the verdict (0.0 for an
  environment failure), with ``weft_env_failed`` and ``weft_flagged`` (0/1) as reward extra info (verl logs
  them as metrics; their names differ from the extra fields', which verl writes into the same batch after
  them). Rows of other data sources go to verl's ``default_compute_score``.

Configs (:func:`write_verl_configs`, or ``python -m treadle.weft.rl.verl_reward --out DIR``): the tool config,
the agent-loop config, train and held-out parquets of atomic-turn rows, and ``weft_grpo.yaml``, a Hydra config
on top of verl's ``ppo_trainer`` that names them all. Launch (GPUs, Ray, vLLM; not run here):

    python -m treadle.weft.rl.verl_reward --out verl_weft --episodes 512
    python -m verl.trainer.main_ppo --config-path "$PWD/verl_weft" --config-name weft_grpo \\
        actor_rollout_ref.model.path=<policy> trainer.n_gpus_per_node=8

The config trains with verl's ``grpo`` estimator: flagged turns are not clamped to ``min(A, 0)`` and an
environment failure counts as a 0 in its group, since verl's trainer gives an estimator only the group keys it
drew itself (``uid``), with no hook between the rollout and ``compute_advantage`` (where
:func:`treadle.weft.rl.verl_tool.tag_uids` would make them :class:`~treadle.grpo.verl_adapter.RowUid` keys for
``treadle_grpo``). A trainer subclass that calls ``tag_uids`` there gets WEFT's clamping.
"""
from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from treadle.weft.rl.trl_env import ROW_COLUMNS
from treadle.weft.rl.verl_tool import AGENT_NAME, TRAJECTORY_KEY, finish, verl_rows, write_tool_config

__all__ = ["WeftToolAgentLoop", "compute_score", "WeftRewardError", "write_agent_loop_config", "write_verl_configs",
           "DATA_SOURCE"]

DATA_SOURCE = "treadle-weft-shop"
"""The ``data_source`` of WEFT rows (:func:`treadle.weft.rl.verl_tool.verl_rows`)."""

class WeftRewardError(ValueError):
    """A WEFT row reached the reward without a verdict: it was not rolled out by :class:`WeftToolAgentLoop`."""


def _row(kwargs: dict) -> dict:
    """The state reference of an agent-loop sample: the row's ``extra_info`` columns, else a tool's
    ``create_kwargs``."""
    extra = kwargs.get("extra_info") or {}
    if all(c in extra for c in ROW_COLUMNS):
        return {c: extra[c] for c in ROW_COLUMNS}
    for spec in (kwargs.get("tools_kwargs") or {}).values():
        ck = (spec or {}).get("create_kwargs") or {}
        if all(c in ck for c in ROW_COLUMNS):
            return {c: ck[c] for c in ROW_COLUMNS}
    return dict(extra)


class WeftToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` that ends each trajectory with its WEFT verdict in its extra fields (see the
    module docstring). Registered with verl under ``weft_tool_agent`` by the agent-loop config
    (:func:`write_agent_loop_config`); same constructor as ``ToolAgentLoop``."""

    async def run(self, sampling_params: dict[str, Any], **kwargs):
        """Run the trajectory (verl's loop), then verify it and close its fork.

        Raises:
            WeftRowError: the sample names no turn start and made no tool call.
        """
        out = await super().run(sampling_params, **kwargs)
        key = out.extra_fields.pop(TRAJECTORY_KEY, None)
        verdict = await asyncio.get_running_loop().run_in_executor(None, functools.partial(finish, key, _row(kwargs)))
        out.extra_fields.update(verdict)
        return out


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                  **kwargs) -> dict:
    """verl's ``custom_reward_function``: the WEFT verdict the agent loop wrote (see the module docstring).

    Returns:
        ``{"score": verdict (0.0 for an environment failure), "weft_env_failed": 0/1, "weft_flagged": 0/1}``
        (the same keys for every row, as verl's batch of reward extra info needs).

    Raises:
        WeftRewardError: a WEFT row without ``weft_reward`` in its extra fields (its ``agent_name`` is not
            ``weft_tool_agent``, or the agent-loop config does not register it).
    """
    if data_source != DATA_SOURCE:
        from verl.utils.reward_score import default_compute_score

        r = default_compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
        return {"score": float(r["score"] if isinstance(r, dict) else r), "weft_env_failed": 0.0,
                "weft_flagged": 0.0}
    extra = extra_info or {}
    if "weft_reward" not in extra:
        raise WeftRewardError(f"a {DATA_SOURCE} row has no WEFT verdict: roll it out with agent_name {AGENT_NAME!r} "
                              f"(actor_rollout_ref.rollout.agent.agent_loop_config_path = the file "
                              f"write_agent_loop_config writes)")
    r = extra["weft_reward"]
    return {"score": 0.0 if r is None else float(r),
            "weft_env_failed": float(r is None or extra.get("weft_env_failure") is not None),
            "weft_flagged": float(bool(extra.get("weft_flags")))}


def write_agent_loop_config(path) -> str:
    """Write the agent-loop config verl reads (``actor_rollout_ref.rollout.agent.agent_loop_config_path``):
    ``weft_tool_agent`` -> :class:`WeftToolAgentLoop`. Returns the agent name."""
    import yaml

    entry = {"name": AGENT_NAME, "_target_": f"{WeftToolAgentLoop.__module__}.{WeftToolAgentLoop.__qualname__}"}
    Path(path).write_text(yaml.safe_dump([entry], sort_keys=False), encoding="utf-8")
    return AGENT_NAME


def trainer_config(folder, *, n: int = 8, rollout: str = "vllm") -> dict:
    """The Hydra config (on top of verl's ``ppo_trainer``) of :func:`write_verl_configs`'s ``folder``."""
    folder = Path(folder).resolve()
    return {
        "hydra": {"searchpath": ["pkg://verl.trainer.config"]},
        "defaults": ["ppo_trainer", "_self_"],
        "data": {"train_files": str(folder / "weft_train.parquet"), "val_files": str(folder / "weft_heldout.parquet"),
                 "prompt_key": "prompt", "return_raw_chat": True},
        "algorithm": {"adv_estimator": "grpo"},
        "actor_rollout_ref": {"rollout": {
            "name": rollout, "n": n,
            "multi_turn": {"enable": True, "format": "hermes", "tool_config_path": str(folder / "weft_tools.yaml")},
            "agent": {"agent_loop_config_path": str(folder / "weft_agent_loops.yaml"),
                      "default_agent_loop": AGENT_NAME}}},
        "reward": {"custom_reward_function": {"path": f"pkg://{__name__}", "name": "compute_score"}},
    }


def write_verl_configs(folder, *, episodes: int = 512, heldout: int = 64, n: int = 8, rollout: str = "vllm",
                       backend=None) -> dict:
    """Write everything a verl run of WEFT atomic-turn GRPO reads into ``folder``: ``weft_tools.yaml``,
    ``weft_agent_loops.yaml``, ``weft_train.parquet`` (``episodes`` episodes, two atomic turns each),
    ``weft_heldout.parquet`` (``heldout`` episodes of the held-out split) and ``weft_grpo.yaml``
    (:func:`trainer_config`). Returns ``{name: path}``.

    Raises:
        ValueError: ``episodes`` or ``heldout`` < 1, ``n`` < 2 (a group of one has no baseline).
    """
    import pandas as pd
    import yaml

    for name, v, low in (("episodes", episodes, 1), ("heldout", heldout, 1), ("n", n, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {k: folder / f for k, f in (("tools", "weft_tools.yaml"), ("agent_loops", "weft_agent_loops.yaml"),
                                        ("train", "weft_train.parquet"), ("heldout", "weft_heldout.parquet"),
                                        ("trainer", "weft_grpo.yaml"))}
    write_tool_config(paths["tools"], backend=backend)
    write_agent_loop_config(paths["agent_loops"])
    for key, split, count, start in (("train", "train", episodes, 0), ("heldout", "heldout", heldout, 900_000)):
        rows = verl_rows(count, split, start=start, backend=backend)
        pd.DataFrame(rows).to_parquet(paths[key])
    cfg = trainer_config(folder, n=n, rollout=rollout)
    paths["trainer"].write_text("# WEFT atomic-turn GRPO on verl (written by treadle.weft.rl.verl_reward)\n"
                                + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return {k: str(v) for k, v in paths.items()}


def _main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m treadle.weft.rl.verl_reward",
                                 description="Write the verl configs and data of WEFT atomic-turn GRPO into a folder.")
    ap.add_argument("--out", required=True, help="folder to write (created)")
    ap.add_argument("--episodes", type=int, default=512, help="train episodes (two atomic turns each), >= 1")
    ap.add_argument("--heldout", type=int, default=64, help="held-out episodes for verl's validation, >= 1")
    ap.add_argument("--n", type=int, default=8, help="candidates per turn (actor_rollout_ref.rollout.n), >= 2")
    ap.add_argument("--rollout", default="vllm", choices=("vllm", "sglang"), help="verl's rollout engine")
    args = ap.parse_args(argv)
    try:
        paths = write_verl_configs(args.out, episodes=args.episodes, heldout=args.heldout, n=args.n,
                                   rollout=args.rollout)
    except ValueError as err:
        ap.error(str(err))
    print(json.dumps(paths, indent=1))
    print(f"python -m verl.trainer.main_ppo --config-path {Path(args.out).resolve()} --config-name weft_grpo "
          f"actor_rollout_ref.model.path=<policy>")


if __name__ == "__main__":
    _main()
