"""CLI of WEFT RL: ``treadle weft groups`` and ``treadle weft train`` (``treadle model train-tiny --task tools``
is :mod:`treadle.models.cli`'s one train-tiny path).

Usage errors are one line naming the flag, exit 2, before any work. Both follow the project's run-folder rule
(:mod:`treadle.run_dirs`: ``run.json``; a run of the same settings is resumed, another config refused,
``--overwrite`` replaces). ``weft train`` resumes at two levels: finished (grouping, seed) runs are kept
(so ``--seeds`` / ``--grouping`` may grow a comparison), and an unfinished run continues from TRL's last
checkpoint (``<run>/trl/checkpoint-N``, :mod:`treadle.weft.rl.trl_run`). A folder of the removed GRPO loop
is refused with one usage error (``--overwrite`` replaces it).
"""
from __future__ import annotations

from pathlib import Path

import typer

from treadle.cli_output import make_console
from treadle.cli_runs import OUT_HELP_SUFFIX, open_run, recorded, usage_error
from treadle.run_dirs import read_stored_json

console = make_console()


def _tool_config(quick: bool):
    from treadle.weft.rl.sft import ToolTrainConfig

    return ToolTrainConfig.quick() if quick else ToolTrainConfig()


def _default_out(out: Path | None, name: str, quick: bool) -> Path:
    """``--out``, else ``runs/<name>`` (``runs/<name>-quick`` for ``--quick``: a quick run never lands where the
    full results live, as ``treadle demo --quick`` -> ``runs/demo-quick``)."""
    return Path(out) if out is not None else Path("runs") / (name + ("-quick" if quick else ""))


def _check_model(model: Path | None) -> None:
    """``--model`` checked as the tool policy (folder, causal-LM config, tokenizer: pad and eos tokens, chat
    template, vocabulary) without loading its weights: a one-line usage error before any folder is written."""
    if model is None:
        return
    from treadle.models.tiny import CheckpointError
    from treadle.weft.rl.sft import check_tool_model

    try:
        check_tool_model(model)
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as err:
        raise usage_error(f"--model {str(model)!r}: {err}") from None


def _policy(model: Path | None, quick: bool):
    from treadle.models.tiny import CheckpointError
    from treadle.weft.rl.sft import load_tool_model, tool_slot

    try:
        if model is not None:
            return load_tool_model(model, train_if_missing=False)
        return load_tool_model(None, config=_tool_config(quick), console=console, train_if_missing=True,
                               name=tool_slot(None, quick).name)
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as err:
        raise usage_error(f"--model {str(model)!r}: {err}") from None


def groups_cmd(
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="Run folder (default runs/weft-groups; with --quick runs/weft-groups-quick)."
                                  + OUT_HELP_SUFFIX),
    model: Path = typer.Option(None, "--model", help="Tool-policy checkpoint (default: the cached tiny tool policy, "
                                                     "trained on first use)."),
    episodes: int = typer.Option(8, "--episodes", help="Episodes (two atomic turns each), >= 1."),
    split: str = typer.Option("train", "--split", help="train or heldout."),
    group_size: int = typer.Option(4, "--group-size", "-G", help="Candidates per group G, >= 2."),
    seed: int = typer.Option(0, "--seed", help="Seed of the episodes and the sampling."),
    chunk: int = typer.Option(8, "--chunk", help="Groups sampled per batch (the resume unit), >= 1."),
    estimator: str = typer.Option("grpo", "--estimator", help="grpo, dr_grpo, rloo or reinforce_baseline."),
    quick: bool = typer.Option(False, "--quick", help="The seconds-long quick tool policy (a weak model; not with "
                                                      "--model)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run of other settings in --out (deleting "
                                                              "it)."),
) -> None:
    """Atomic-turn GRPO groups of the tool policy on shop episodes -> groups.jsonl, rows.jsonl, stats.json."""
    from treadle.reference.grpo import ESTIMATORS
    from treadle.weft.rl.run import ConfigMismatchError, check_folder, folder_config
    from treadle.weft.rl.worlds import SPLITS

    if group_size < 2:
        raise usage_error(f"--group-size must be >= 2 (a group of one has no baseline), got {group_size}")
    if episodes < 1:
        raise usage_error(f"--episodes must be >= 1, got {episodes}")
    if chunk < 1:
        raise usage_error(f"--chunk must be >= 1, got {chunk}")
    if split not in SPLITS:
        raise usage_error(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if estimator not in ESTIMATORS:
        raise usage_error(f"--estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if quick and model is not None:  # --quick only picks the quick cached policy: with --model it would be ignored
        raise usage_error(f"--quick picks the quick tool policy, --model {str(model)!r} another one: give one of them")
    out = _default_out(out, "weft-groups", quick)
    _check_model(model)
    doc = folder_config({"model": str(model) if model else ("quick" if quick else "tiny-qwen3-tools"),
                         "episodes": episodes, "split": split, "estimator": estimator},
                        G=group_size, seed=seed, chunk=chunk, max_steps=4)
    # the rule of every command's run folder (run.json: same config resumed, another refused, a non-empty
    # folder that is not a run refused), then the chunks' own config.json check
    run = open_run(out, command="weft groups", config=doc, overwrite=overwrite)
    if not run.overwrite:  # (--overwrite empties the folder at the start)
        try:
            check_folder(out, doc)
        except ConfigMismatchError as err:
            raise usage_error(f"--out: {err}") from None
    with recorded(run, console, saved=lambda: "every finished chunk", resumable=True):
        _groups(out, doc, model, quick, episodes, split, group_size, seed, chunk, estimator)


def _groups(out: Path, doc: dict, model, quick: bool, episodes: int, split: str, group_size: int, seed: int,
            chunk: int, estimator: str) -> None:
    import anyio

    from treadle.weft.rl.run import groups_to_folder

    policy, tok = _policy(model, quick)

    async def main():
        from treadle.weft.rl.gold import play_gold, shop_server
        from treadle.weft.rl.sampling import HFSampler
        from treadle.weft.rl.worlds import episodes as draw
        from treadle.weft.rollouts.harnesses import HermesHarness
        from treadle.weft.runtime import Runtime

        harness = HermesHarness()
        async with Runtime() as rt:
            h = await shop_server(rt)
            golds = [await play_gold(rt, h, e, harness, verify=False)
                     for e in draw(episodes, split, start=seed * 100_000)]
            starts = [s for g in golds for s in g.starts]
            return await groups_to_folder(rt, h, starts, group_size, HFSampler(policy, tok, max_new_tokens=72), tok,
                                          harness, out, config={k: doc[k] for k in ("model", "episodes", "split",
                                                                                    "estimator")},
                                          seed=seed, chunk=chunk, estimator=estimator,
                                          on_chunk=lambda i, part: console.print(f"chunk {i}: {len(part)} groups",
                                                                                 markup=False))

    groups = anyio.run(main)
    stats = read_stored_json(out / "stats.json", what="group statistics")
    console.print(f"{len(groups)} groups x G={group_size} -> {out} (groups.jsonl, rows.jsonl, stats.json): "
                  f"mean verdict {stats['mean_reward']:.2f}, all-equal groups {stats['all_equal_groups']} "
                  f"({stats['all_pass_groups']} all-pass, {stats['all_fail_groups']} all-fail), singleton "
                  f"{stats['singleton_groups']}, flagged rows {stats['flagged_rows']} "
                  f"({stats['flagged_successful_rows']} successful), env failures {stats['env_failures']}",
                  markup=False)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise usage_error(f"--seeds must be comma-separated non-negative ints, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise usage_error(f"--seeds must be distinct non-negative ints, got {text!r}")
    return seeds


_LOOP_GONE = ("treadle's own GRPO loop was removed: weft train runs on trl.GRPOTrainer (atomic and trajectory "
              "grouping: --grouping atomic|trajectory|both)")


def train_cmd(
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="Run folder, one sub-folder per grouping and seed (default runs/weft-train; with "
                                  "--quick runs/weft-train-quick)." + OUT_HELP_SUFFIX + " Other --seeds or "
                                                                   "--grouping add to it: finished (grouping, seed) "
                                                                   "runs of the same settings are kept."),
    grouping: str = typer.Option("atomic", "--grouping",
                                 help="atomic (atomic-turn groups), trajectory (whole-task groups, R = mean_k r_k: "
                                      "the ablation baseline) or both (the comparison)."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated seeds (one run each)."),
    steps: int = typer.Option(None, "--steps", help="GRPO steps per run, >= 1 (default 16; --quick 2)."),
    eval_episodes: int = typer.Option(None, "--eval-episodes", help="Held-out episodes (two turns each) evaluated "
                                                                   "before and after, >= 1 (default 24)."),
    model: Path = typer.Option(None, "--model", help="Tool-policy checkpoint to start from (default: the cached tiny "
                                                     "tool policy)."),
    quick: bool = typer.Option(False, "--quick", help="Seconds-long smoke settings on the quick tool policy."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out (every run again)."),
    checkpoint_every: int = typer.Option(1, "--checkpoint-every", help="Write a TRL checkpoint every N optimizer "
                                                                      "steps, >= 1; an interrupted run continues "
                                                                      "from the last one."),
    vllm: bool = typer.Option(False, "--vllm", help="Generate with vLLM (TRL's use_vllm=True, colocated on the "
                                                    "training GPUs; needs vllm installed)."),
    kl_coef: float = typer.Option(None, "--kl-coef", help="Beta of the k3 KL penalty to the start policy, >= 0 "
                                                          "(default 0: off; GRPO's paper used 0.04)."),
    engine: str = typer.Option(None, "--engine", hidden=True, help="trl (the only engine; kept for old scripts)."),
    jobs: int = typer.Option(None, "--jobs", hidden=True, help="Removed with treadle's own loop."),
    parallel: str = typer.Option(None, "--parallel", hidden=True, help="Removed with treadle's own loop."),
    resume: bool = typer.Option(False, "--resume", hidden=True, help="Removed with treadle's own loop."),
) -> None:
    """GRPO of the tiny tool policy on trl.GRPOTrainer with the WEFT environment: held-out success before/after;
    --grouping both compares atomic-turn and trajectory groups."""
    if engine not in (None, "trl"):
        raise usage_error(f"--engine {engine}: {_LOOP_GONE}; drop --engine")
    for flag, given in (("--parallel", parallel is not None), ("--jobs", jobs is not None), ("--resume", resume)):
        if given:  # any use, --jobs 0 included
            raise usage_error(f"{flag}: {_LOOP_GONE}; drop {flag} (a run folder resumes by itself)")
    if grouping not in ("atomic", "trajectory", "both"):
        raise usage_error(f"--grouping must be atomic, trajectory or both, got {grouping!r}")
    if steps is not None and steps < 1:
        raise usage_error(f"--steps must be >= 1, got {steps}")
    if eval_episodes is not None and eval_episodes < 1:
        raise usage_error(f"--eval-episodes must be >= 1, got {eval_episodes}")
    if checkpoint_every < 1:
        raise usage_error(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
    if kl_coef is not None and not 0 <= kl_coef < float("inf"):
        raise usage_error(f"--kl-coef must be a finite number >= 0, got {kl_coef}")
    if vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise usage_error("--vllm needs vLLM installed (pip install vllm; a CUDA GPU), which this environment "
                              "lacks")
    seed_list = _seeds(seeds)
    out = _default_out(out, "weft-train", quick)
    _check_model(model)
    groupings = ("atomic", "trajectory") if grouping == "both" else (grouping,)
    from treadle.weft.rl.config import WeftTrainConfig

    base = WeftTrainConfig.quick() if quick else WeftTrainConfig()
    doc = {"groupings": list(groupings), "seeds": seed_list, "steps": steps or base.steps,
           "eval_episodes": eval_episodes or base.eval_episodes,
           "model": str(model) if model else ("quick" if quick else "tiny-qwen3-tools"), "quick": quick,
           "engine": "trl", "sampler": "vllm" if vllm else "trl"}
    overrides = {k: v for k, v in (("eval_episodes", eval_episodes), ("kl_coef", kl_coef)) if v}
    if kl_coef:  # (absent when off, so that run folders of earlier versions keep matching)
        doc["kl_coef"] = kl_coef
    if not overwrite:
        _refuse_loop_folder(out)
    _train_trl(out, doc, overwrite, model, quick, seed_list, steps, overrides, checkpoint_every, vllm, groupings)


def _refuse_loop_folder(out: Path) -> None:
    """A run folder of the removed loop engine: one usage error (its results stay as they are)."""
    import json

    try:
        prev = json.loads((out / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return  # no run.json, or an unreadable one: the run-folder rule decides
    if isinstance(prev, dict) and prev.get("command") == "weft train" and \
            (prev.get("config") or {}).get("engine") != "trl":
        raise usage_error(f"--out {str(out)!r} holds a run of treadle's removed GRPO loop ({_LOOP_GONE}); its results "
                          f"stay readable there. Give a new --out, or --overwrite to replace it")


def _train_trl(out: Path, doc: dict, overwrite: bool, model, quick: bool, seeds, steps, overrides: dict,
               checkpoint_every: int, vllm: bool = False, groupings=("atomic",)) -> None:
    """``weft train``: every (grouping, seed) run on trl.GRPOTrainer (:mod:`treadle.weft.rl.trl_run`), under the
    run-folder rule; finished runs are kept, an unfinished one continues from TRL's last checkpoint."""
    run = _open_train(out, doc, overwrite)
    if _show_finished(run, doc):
        return
    with recorded(run, console, saved=lambda: "the finished seeds and each run's TRL checkpoints", resumable=True):
        from treadle.weft.rl.trl_run import run_trl

        policy = _policy(model, quick)
        try:
            run_trl(out, policy, seeds, steps=steps, quick=quick, console=console, overrides=overrides or None,
                    checkpoint_every=checkpoint_every, vllm=vllm, groupings=groupings)
        except ImportError as err:
            raise usage_error(f"weft train{' --vllm' if vllm else ''}: a package is missing: {err}") from None


# a comparison grows by seeds and groupings: finished (grouping, seed) runs are kept by their own config
_GROWS = ("seeds", "groupings")


def _open_train(out: Path, doc: dict, overwrite: bool):
    """``--out`` under the run-folder rule (:func:`treadle.cli_runs.open_run`; exit 2 before any change)."""
    return open_run(out, command="weft train", config=doc, overwrite=overwrite, ignore=_GROWS)


def _show_finished(run, doc: dict) -> bool:
    """A finished comparison of exactly these settings: print its results (nothing is run) and return True."""
    prev = (run.previous or {}).get("config") or {}
    if not run.finished or any(prev.get(k) != doc[k] for k in _GROWS) or not (run.path / "summary.json").exists():
        return False
    summary = read_stored_json(run.path / "summary.json", what="run summary")
    for grouping, g in summary.get("groupings", {}).items():
        console.print(f"{grouping}: held-out per-turn success change {g['turn_change_mean']:+.3f} (sd "
                      f"{g['turn_change_sd']:.3f}) over seeds {summary['seeds']}", markup=False)
    console.print(f"{run.path} already holds this finished comparison (same settings; finished "
                  f"{run.previous.get('ended')}); results unchanged: {run.path / 'summary.json'}"
                  + ". Add --overwrite to run it again.", markup=False)
    return True
