"""Re-evaluate a finished ``treadle weft train`` comparison on a larger held-out set.

    python bench/weft_rl_heldout.py RUN_FOLDER --episodes 96 [--runs atomic-seed0,atomic-seed1,...]

For each ``<grouping>-seed<k>`` run of RUN_FOLDER: the start policy (``RUN_FOLDER/start-policy``) and the
trained policy (the run's last TRL checkpoint, ``trl/checkpoint-<last step>``) are evaluated with the same
protocol (:func:`treadle.weft.rl.heldout.evaluate_heldout`: sampled per-turn and whole-task success, the seed's
sampling seeds, 6 samples per turn) on the first ``--episodes`` held-out episodes, the same draw as
``treadle weft train --eval-episodes N``. Prints one JSON line per run and the per-turn change with its
mean, sd and range over the seeds of each grouping; writes ``RUN_FOLDER/heldout-<N>.json``. Used for the
README's WEFT RL 96-episode table (the runs' own evaluation uses 24 episodes, 288 samples per number).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import anyio
import torch


def _last_checkpoint(run: Path) -> Path | None:
    """The run's final TRL checkpoint, or None when the run is not finished (no ``summary.json``)."""
    from transformers.trainer_utils import get_last_checkpoint

    if not (run / "summary.json").exists() or not (run / "trl").is_dir():
        return None
    last = get_last_checkpoint(str(run / "trl"))
    return Path(last) if last else None


def _trained(run: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_last_checkpoint(run))


async def evaluate_runs(folder: Path, n: int, names: list[str]) -> dict:
    from treadle.weft.rl.gold import play_gold, shop_server
    from treadle.weft.rl.sft import load_tool_model
    from treadle.weft.rl.config import WeftTrainConfig
    from treadle.weft.rl.heldout import evaluate_heldout
    from treadle.weft.rl.worlds import episodes
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.runtime import Runtime

    out = {}
    async with Runtime() as rt:
        h = await shop_server(rt)
        held = [await play_gold(rt, h, e, HermesHarness(), verify=False)
                for e in episodes(n, "heldout", start=900_000)]
        for name in names:
            grouping, seed = name.rsplit("-seed", 1)
            cfg = WeftTrainConfig(grouping=grouping, seed=int(seed), eval_episodes=n)
            res = {}
            for when in ("before", "after"):
                model, tok = load_tool_model(folder / "start-policy")
                if when == "after":
                    model.load_state_dict(_trained(folder / name).state_dict())
                t = time.process_time()
                res[when] = await evaluate_heldout(rt, h, model.eval(), tok, held, cfg)
                res[when]["cpu_s"] = time.process_time() - t
            out[name] = res
            print(name, json.dumps(res), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_folder", type=Path)
    ap.add_argument("--episodes", type=int, default=96)
    ap.add_argument("--runs", default=None, help="comma-separated <grouping>-seed<k> (default: every run)")
    args = ap.parse_args()
    if args.episodes < 1:
        ap.error(f"--episodes must be >= 1, got {args.episodes}")
    names = (args.runs.split(",") if args.runs else
             sorted(p.name for p in args.run_folder.glob("*-seed*") if _last_checkpoint(p) is not None))
    if not names:
        ap.error(f"no finished run with a TRL checkpoint under {args.run_folder}")
    missing = [n for n in names if "-seed" not in n or _last_checkpoint(args.run_folder / n) is None]
    if missing:  # before any work: an unfinished run has no final policy
        ap.error(f"no finished run (summary.json and trl/checkpoint-N) for {', '.join(missing)} under "
                 f"{args.run_folder}; expected <grouping>-seed<k> runs of `treadle weft train`")
    if not (args.run_folder / "start-policy").is_dir():
        ap.error(f"{args.run_folder / 'start-policy'} is missing: not a `treadle weft train` run folder")
    torch.set_num_threads(1)
    res = anyio.run(evaluate_runs, args.run_folder, args.episodes, names)
    for grouping in sorted({n.rsplit("-seed", 1)[0] for n in res}):
        ch = [r["after"]["turn_success"] - r["before"]["turn_success"] for k, r in res.items()
              if k.rsplit("-seed", 1)[0] == grouping]
        sd = statistics.stdev(ch) if len(ch) > 1 else 0.0
        print(f"{grouping}: per-turn change {' / '.join(f'{c:+.3f}' for c in ch)}; mean {statistics.mean(ch):+.4f}, "
              f"sd {sd:.4f}, range {max(ch) - min(ch):.4f}")
    (args.run_folder / f"heldout-{args.episodes}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
