"""CLI of WEFT RL: ``treadle weft groups`` and ``treadle weft train`` (``treadle model train-tiny --task tools``
is :mod:`treadle.models.cli`'s one train-tiny path).

Usage errors are one line naming the flag, exit 2, before any work. Both follow the project's run-folder rule
(:mod:`treadle.run_dirs`: ``run.json``; a run of the same settings is resumed, another config refused,
``--overwrite`` replaces). ``weft train`` resumes at two levels: finished (grouping, seed) runs are kept
(so ``--seeds`` / ``--grouping`` may grow a comparison), and an unfinished run continues from its step
checkpoint (``<run>/checkpoint/state.pt``, :mod:`treadle.distributed.weft_resume`): in one process, or
under ``--parallel ddp|fsdp2`` on any number of ranks.
"""
from __future__ import annotations

import os
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


def _cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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


def train_cmd(
    out: Path = typer.Option(None, "--out", show_default=False,
                             help="Run folder, one sub-folder per grouping and seed (default runs/weft-train; with "
                                  "--quick runs/weft-train-quick)." + OUT_HELP_SUFFIX + " Other --seeds or "
                                                                   "--grouping add to it: finished (grouping, seed) "
                                                                   "runs of the same settings are kept."),
    engine: str = typer.Option(None, "--engine", show_default=False,
                               help="trl (the default: atomic-turn GRPO on trl.GRPOTrainer with the WEFT environment) "
                                    "or loop (treadle's own loop: trajectory grouping, dynamic sampling, --parallel, "
                                    "--jobs; chosen by default when one of those is given)."),
    grouping: str = typer.Option(None, "--grouping", show_default=False,
                                 help="atomic, trajectory or both (default: atomic with --engine trl, both with "
                                      "--engine loop; trl trains atomic only)."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated seeds (one run each)."),
    steps: int = typer.Option(None, "--steps", help="GRPO steps per run, >= 1 (default 16; --quick 2)."),
    eval_episodes: int = typer.Option(None, "--eval-episodes", help="Held-out episodes (two turns each) evaluated "
                                                                   "before and after, >= 1 (default 24)."),
    model: Path = typer.Option(None, "--model", help="Tool-policy checkpoint to start from (default: the cached tiny "
                                                     "tool policy)."),
    quick: bool = typer.Option(False, "--quick", help="Seconds-long smoke settings on the quick tool policy."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --out (every run again)."),
    resume: bool = typer.Option(False, "--resume", hidden=True, help="Kept for old scripts: resuming is the default "
                                                                     "(the run-folder rule)."),
    jobs: int = typer.Option(None, "--jobs", show_default=False,
                             help="Runs at once (worker processes, one thread each), 1 to the CPUs available "
                                  "(default 2, at most the CPUs); the numbers do not depend on it. Not with "
                                  "--parallel."),
    parallel: str = typer.Option(None, "--parallel", help="Data-parallel GRPO under torchrun: 'ddp' or 'fsdp2' (e.g. "
                                                         "torchrun --nproc-per-node 2 -m treadle weft train --parallel "
                                                         "ddp; fsdp2 gathers the policy for the rollouts); "
                                                         "each step's episodes are split over the ranks (runs one "
                                                         "after another; --jobs is not used). Its rollouts differ "
                                                         "from one process's (row-keyed sampling), so a run folder "
                                                         "is either data-parallel or not; ddp and fsdp2, and any "
                                                         "number of ranks, continue each other's runs."),
    checkpoint_every: int = typer.Option(1, "--checkpoint-every", help="Write a step checkpoint "
                                                                      "(<run>/checkpoint/state.pt, rank 0) every N "
                                                                      "steps, >= 1; an interrupted run continues from "
                                                                      "it."),
    vllm: bool = typer.Option(False, "--vllm", help="--engine trl: generate with vLLM (TRL's use_vllm=True, "
                                                    "colocated on the training GPUs; needs vllm installed)."),
    kl_coef: float = typer.Option(None, "--kl-coef", help="Beta of the k3 KL penalty to the start policy, >= 0 "
                                                          "(default 0: off; GRPO's paper used 0.04)."),
) -> None:
    """GRPO on the tiny tool policy (TRL by default): held-out success before/after; --engine loop: atomic-turn vs
    trajectory grouping, PNG."""
    if engine is None:  # trl, unless an option only the loop has is given (old command lines keep working)
        engine = "loop" if (parallel or jobs is not None or resume) else "trl"
    if engine not in ("trl", "loop"):
        raise usage_error(f"--engine must be trl or loop, got {engine!r}")
    if grouping is None:
        grouping = "atomic" if engine == "trl" else "both"
    if grouping not in ("atomic", "trajectory", "both"):
        raise usage_error(f"--grouping must be atomic, trajectory or both, got {grouping!r}")
    if steps is not None and steps < 1:
        raise usage_error(f"--steps must be >= 1, got {steps}")
    if eval_episodes is not None and eval_episodes < 1:
        raise usage_error(f"--eval-episodes must be >= 1, got {eval_episodes}")
    cpus = _cpus()
    if jobs is not None and not 1 <= jobs <= cpus:  # more worker processes than CPUs only slows every run down
        raise usage_error(f"--jobs must be in 1..{cpus} (the CPUs available; each run is one single-thread "
                          f"process), got {jobs}")
    if jobs is not None and parallel is not None:
        raise usage_error(f"--jobs is not used with --parallel {parallel} (the runs go one after another over the "
                          f"ranks); drop one of them")
    if checkpoint_every < 1:
        raise usage_error(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
    if kl_coef is not None and not 0 <= kl_coef < float("inf"):
        raise usage_error(f"--kl-coef must be a finite number >= 0, got {kl_coef}")
    if parallel is not None and parallel not in ("ddp", "fsdp2"):
        raise usage_error(f"--parallel must be ddp or fsdp2, got {parallel!r}")
    if overwrite and resume:
        raise usage_error("--overwrite and --resume exclude each other (--resume is the default: a run of the same "
                          "settings in --out is continued)")
    if vllm and engine != "trl":
        raise usage_error("--vllm is an option of --engine trl (TRL's vLLM generation)")
    if vllm:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise usage_error("--vllm needs vLLM installed (pip install vllm; a CUDA GPU), which this environment "
                              "lacks")
    if engine == "trl":
        for flag, value in (("--parallel", parallel), ("--jobs", jobs), ("--resume", resume)):
            if value:
                raise usage_error(f"{flag} is an option of --engine loop (trajectory grouping, dynamic sampling, "
                                  f"data-parallel runs); --engine trl trains atomic-turn groups on trl.GRPOTrainer")
    jobs = jobs if jobs is not None else min(2, cpus)
    seed_list = _seeds(seeds)
    out = _default_out(out, "weft-train", quick)
    _check_model(model)
    groupings = ("atomic", "trajectory") if grouping == "both" else (grouping,)
    from treadle.weft.rl.train import WeftTrainConfig

    base = WeftTrainConfig.quick() if quick else WeftTrainConfig()
    doc = {"groupings": list(groupings), "seeds": seed_list, "steps": steps or base.steps,
           "eval_episodes": eval_episodes or base.eval_episodes,
           "model": str(model) if model else ("quick" if quick else "tiny-qwen3-tools"), "quick": quick,
           "sampler": "row-keyed" if parallel else "hf"}
    overrides = {k: v for k, v in (("eval_episodes", eval_episodes), ("kl_coef", kl_coef)) if v}
    if kl_coef:  # (absent when off, so that run folders of earlier versions keep matching)
        doc["kl_coef"] = kl_coef
    if engine == "trl":
        doc["engine"], doc["sampler"] = "trl", "vllm" if vllm else "trl"
        return _train_trl(out, doc, overwrite, model, quick, seed_list, steps, overrides, checkpoint_every, vllm,
                          groupings)
    if parallel is not None:
        return _train_parallel(parallel, out, groupings, seed_list, steps, model, quick, overrides, doc=doc,
                               overwrite=overwrite, checkpoint_every=checkpoint_every)
    run = _open_train(out, doc, overwrite)
    if _show_finished(run, doc):
        return
    with recorded(run, console, saved=lambda: "the finished (grouping, seed) runs and each run's step checkpoint",
                  resumable=True):
        from treadle.weft.rl.report import run_comparison

        policy = _policy(model, quick)
        run_comparison(out, policy, groupings, seed_list, steps=steps, quick=quick, console=console, jobs=jobs,
                       overrides=overrides or None, checkpoint_every=checkpoint_every)


def _train_trl(out: Path, doc: dict, overwrite: bool, model, quick: bool, seeds, steps, overrides: dict,
               checkpoint_every: int, vllm: bool = False, groupings=("atomic",)) -> None:
    """``weft train --engine trl``: every seed on trl.GRPOTrainer (:mod:`treadle.weft.rl.trl_run`), under the
    run-folder rule; finished seeds are kept, an unfinished one continues from TRL's last checkpoint."""
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
            raise usage_error(f"--engine trl{' --vllm' if vllm else ''}: a package is missing: {err}") from None


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
                  + ("" if doc.get("engine") == "trl" else f", {run.path / 'curves.png'}")
                  + ". Add --overwrite to run it again.", markup=False)
    return True


def _train_parallel(parallel: str, out: Path, groupings, seeds, steps, model, quick: bool,
                    overrides: dict | None = None, *, doc: dict, overwrite: bool = False,
                    checkpoint_every: int = 1) -> None:
    """``weft train --parallel ddp|fsdp2``: one rank of a torchrun job. Rank 0 opens ``--out`` (the run-folder
    rule; its refusal is every rank's one-line error) and loads (or trains) the start policy first, then the
    other ranks load it; every run trains on all ranks, continuing from its step checkpoint when there is one
    (any world size, ddp or fsdp2); rank 0 alone writes and prints."""
    import contextlib
    import functools

    import torch.distributed as dist

    import click
    from rich.console import Console

    from treadle.distributed.launch import LaunchError, init_from_torchrun, shutdown
    from treadle.distributed.parallel import broadcast_object
    from treadle.distributed.process_group import is_main
    from treadle.weft.rl.parallel import one_run_dp
    from treadle.weft.rl.report import run_comparison

    try:
        device = init_from_torchrun(parallel)
    except LaunchError as err:
        raise usage_error(str(err)) from None
    try:
        W, main = dist.get_world_size(), is_main()
        failed, done, run = None, False, None
        if main:
            try:
                run = _open_train(out, doc, overwrite)
                done = _show_finished(run, doc)
            except click.UsageError as err:
                failed = err.message
        failed, done = broadcast_object((failed, done))
        if failed is not None:  # every rank stops with rank 0's one-line error, nothing written
            raise usage_error(failed)
        if done:
            return
        ctx = (recorded(run, console, saved=lambda: "the finished (grouping, seed) runs and each run's step checkpoint",
                        resumable=True) if main else contextlib.nullcontext())
        with ctx:
            # the config does not depend on W (a rank may have no episode in a step), so a run continues on any
            # number of ranks, --quick included
            overrides = dict(overrides or {})
            failed = None
            if main:  # trains the cached policy when missing: once, before the other ranks load it
                try:
                    policy = _policy(model, quick)
                except click.UsageError as err:
                    failed = err.message
            failed = broadcast_object(failed)
            if failed is not None:
                raise usage_error(failed)
            if not main:
                policy = _policy(model, quick)
            policy = (policy[0].to(device), policy[1])
            run_comparison(out, policy, groupings, seeds, steps=steps, quick=quick,
                           console=console if main else Console(quiet=True), overrides=overrides, jobs=1,
                           runner=functools.partial(one_run_dp, parallel=parallel, checkpoint_every=checkpoint_every,
                                                    resume=True, console=console if main else None))
            if main:
                console.print(f"{parallel} on {W} ranks", markup=False)
    finally:
        shutdown()

