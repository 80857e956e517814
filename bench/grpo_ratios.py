"""GRPO advantages: treadle's C++ op vs each peer on every case of bench/bench_grpo.py, measured the
guard's way (bench/guard.py: interleaved rounds in one process, process CPU time on one torch thread,
median of per-round ratios), with the memory-bound limit of each case. Prints a Markdown table.

    python bench/grpo_ratios.py [--rounds 9] [--sizes 4096,65536,1048576]

The limit is the time to stream the bytes the op must touch (rewards 4 B + ids 8 B + output 4 B a
row) at ``torch.clone``'s bandwidth on the same machine (best of 20 clones of a 16 N-byte buffer).
verl's estimators run up to N = 65,536 (the loop takes minutes and the vectorised one > 24 GB at 1M).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import guard  # noqa: E402


def _peers(n: int, layout: str, rewards, ids):
    import numpy as np

    import bench_grpo as bg
    from treadle.reference.grpo import grpo_advantages_scatter

    peers = {"torch scatter": lambda: grpo_advantages_scatter(rewards, ids)}
    kind = layout.removesuffix("-shuffled")
    if not layout.endswith("-shuffled") and not kind.startswith("ragged"):
        g = int(kind[1:])
        peers["TRL view"] = lambda: bg.trl_view(rewards, g)
    core = bg._verl()
    if core is not None and n <= 65536:
        index = np.array([str(i) for i in ids.tolist()], dtype=object)
        est = core.get_adv_estimator_fn("grpo_vectorized")
        tlr, mask = rewards.unsqueeze(1), torch.ones(n, 1)
        peers["verl vectorized"] = lambda: est(token_level_rewards=tlr.clone(), response_mask=mask, index=index)
    return peers


def _limit_s(n: int) -> float:
    buf = torch.empty(16 * n, dtype=torch.uint8)
    best = math.inf
    for _ in range(20):
        t0 = time.perf_counter()
        buf.clone()
        best = min(best, time.perf_counter() - t0)
    return best  # clone reads and writes 16 N bytes: the op reads 12 N and writes 4 N


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--round-ms", type=float, default=30.0)
    ap.add_argument("--sizes", default="4096,65536,1048576")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import bench_grpo as bg
    from treadle.ops import grpo_advantages

    print(f"CPU: {guard.machine()['cpu']}; {time.strftime('%Y-%m-%d %H:%M %Z')}; process CPU time, 1 thread, "
          f"median of {args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
    print("| case | treadle C++ | memory-bound limit | peer: time (peer / treadle) |")
    print("|---|---|---|---|")
    for n in [int(x) for x in args.sizes.split(",")]:
        for layout in bg.LAYOUTS:
            rewards, ids = bg.make_batch(n, layout)
            ours = lambda: grpo_advantages(rewards, ids, backend="cpp")  # noqa: E731
            cells, ours_ms = [], []
            for name, peer in _peers(n, layout, rewards, ids).items():
                c = guard.Check(name, "time", "", name, lambda naive, p=peer: (ours, p))
                r = guard.run_time_check(c, args.rounds if "verl" not in name else 3, args.round_ms)
                ours_ms.append(r["ours_ms"])
                cells.append(f"{name} {r['peer_ms']:.3g} ms ({r['ratio']:.2f}x)")
            t = statistics.median(ours_ms)
            lim = _limit_s(n) * 1e3
            print(f"| N={n:,} {layout} | {t:.3g} ms | {lim:.3g} ms ({lim / t:.0%} of treadle's time) | "
                  f"{'; '.join(cells)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
