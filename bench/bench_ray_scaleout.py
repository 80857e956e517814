"""Ray scale-out vs the single-process drivers, side by side in one run.

    pytest bench/bench_ray_scaleout.py --benchmark-enable     (needs treadle[ray])

Cases (one local Ray instance of all the machine's CPUs, started once, its start-up not counted):
- ``weft rollouts``: ``WEFT_BENCH_RAY_REPLICAS`` x 2 shop tasks x k in (1, 3, 5) x 2 methods rollouts (default
  4 -> 48) with the replay policy, one process (``sample``) vs Ray actors (``sample(ray_address=...)``, one
  actor per CPU, actor start-up counted: it is part of every run).
- ``rsi rounds``: 2 rounds of the offline RSI loop on ``WEFT_BENCH_RAY_SEEDS`` seeds (default 16), chains and
  candidate evaluations in the driver vs as Ray tasks.

Both peers produce the same records (the tests check that: tests/weft/test_ray_rollouts.py,
tests/rsi/test_ray_tasks.py); the ratio is the speed-up of spreading the work, which grows with the
number of CPUs / nodes and with the cost of one rollout (an LLM policy's latency), and shrinks with Ray's
per-call overhead (~1 ms a task on one node) and actor start-up (seconds: one Python process each).

Last measured (2026-11-30, this 2-core shared machine, Intel Xeon Processor, load average 16-20 from other
jobs; one round each): 48 shop rollouts 8.7 s in one process vs 39.2 s on 2 Ray actors (0.22x: two actors
importing the runtime under load, and rollouts of ~0.2 s CPU each); RSI 2 rounds x 16 seeds 3.3 s vs 8.3 s
as Ray tasks in slices (0.39x; 16.6 s with one task per chain). Not measured on a multi-node cluster.
"""
from __future__ import annotations

import os
import tempfile

import pytest

ray = pytest.importorskip("ray")

from treadle.rsi.loop import LoopConfig, RSILoop  # noqa: E402
from treadle.rsi.math_tasks import make_seeds  # noqa: E402
from treadle.rsi.ray_tasks import RayChains  # noqa: E402
from treadle.rsi.solvers import CapacitySolver  # noqa: E402
from treadle.weft.rollouts.batch import Component, SampleConfig, sample  # noqa: E402
from treadle.weft.rollouts.tasks import from_shop, replicate  # noqa: E402

REPLICAS = int(os.environ.get("WEFT_BENCH_RAY_REPLICAS", "4"))
SEEDS = int(os.environ.get("WEFT_BENCH_RAY_SEEDS", "16"))
CFG = SampleConfig(policy=Component(name="replay", args={"rates": {"wrong_argument": 0.2}, "seed": 0}),
                   methods=("prefix", "end_to_end"), ks=(1, 3, 5), concurrency=2 * (os.cpu_count() or 1))


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("impl", ["one-process", "treadle-ray"])
def test_weft_rollouts(benchmark, peer_table, local_ray, impl):
    tasks = replicate(from_shop(), REPLICAS)
    kw = {"ray_address": "auto", "ray_workers": os.cpu_count()} if impl == "treadle-ray" else {}

    def run():
        with tempfile.TemporaryDirectory() as d:
            return sample(d, tasks, CFG, **kw)
    trs = benchmark.pedantic(run, rounds=1, iterations=1)
    assert len(trs) == len(tasks) * 6
    peer_table.record(f"weft rollouts x{len(trs)}", impl, benchmark, rollouts=len(trs))


@pytest.mark.parametrize("impl", ["one-process", "treadle-ray"])
def test_rsi_rounds(benchmark, peer_table, local_ray, impl):
    def run():
        L = RSILoop(make_seeds(SEEDS, 0), CapacitySolver(), LoopConfig(seed=1, rounds=2))
        L.distributed = RayChains() if impl == "treadle-ray" else None
        return [L.step_round() for _ in range(2)]
    benchmark.pedantic(run, rounds=1, iterations=1)
    peer_table.record(f"rsi 2 rounds x{SEEDS} seeds", impl, benchmark, seeds=SEEDS)
