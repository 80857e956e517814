"""Performance regression guard: treadle vs its main peer, as ratios measured in one process.

    python bench/guard.py                  check every op against bench/guard_thresholds.json (exit 1 on a regression)
    python bench/guard.py --only grpo_contiguous_vs_trl --rounds 5
    python bench/guard.py --calibrate 3    measure 3 passes and rewrite the thresholds (see "Margins")

CI machines are shared and noisy, so absolute times never gate. Each time check builds treadle's
implementation and its main peer on the same inputs, calibrates a number of calls per round so that
each side's round lasts about ``--round-ms``, then runs ``--rounds`` rounds with the two sides
interleaved (order alternating each round): load from other processes hits both alike. Per round the
ratio is peer time / treadle time (> 1: treadle faster); the check fails when the median over the
rounds falls below the threshold. Times are process CPU time on one torch thread by default
(``--clock cpu --threads 1``): with 2 cores shared by many jobs, wall time mostly measures how long the
process waited for a core (ratios of the same code moved 25%+ between passes), CPU time the work done. Memory checks (the ops whose point is memory: STAIR read-out, top-k
entropy) measure the peak RSS above the inputs of treadle's op and of the naive peer, each in turn in
one fresh subprocess (glibc's mmap threshold fixed so freed buffers go back to the system), after one
warm-up call of each (the smaller of two measured calls), and gate naive peak / treadle peak. Without the
warm-up, one-off costs of the first call (kernel code pages touched for the first time, thread pools:
~7 MiB) landed in treadle's side, whose true extra peak is ~1.2 MiB for the STAIR check, and the CI
machine measured 12.5x where this one measured 31x.

Margins: ``--calibrate N`` runs N full passes and stores, per check, the N median ratios and the
threshold ``min(medians) * (1 - margin)`` with ``margin = max(floor, 2 * spread)``, where spread is
(max - min) / median of the N medians and floor is 0.15 for time checks and 0.35 for memory checks.
Measured on the shared 2-core VM while ~8 other jobs kept its load average at 10-20 (the spreads are
stored in the JSON): medians of 15 interleaved rounds in CPU time moved 3-24% between passes (wall
time: 25%+, hence the CPU clock), peak-memory ratios under 0.2%. The threshold sits below the
lowest calibration median by twice the largest move seen (at least 15%; 35% for memory, whose small
treadle-side peaks move with the machine's allocator and libraries more than between passes), a margin no
pass crossed, while a real regression (a kernel 2x slower, a fast path no longer taken, an op that
materialises the naive buffers again) still crosses it.

Test-only flags (tests/bench/test_guard.py): ``TREADLE_GUARD_SLOWDOWN="check=factor,..."`` (or
``"*=factor"``) makes treadle's side of those time checks run its op ``factor`` times per call, a
deliberately slowed implementation; ``TREADLE_GUARD_NAIVE="check,..."`` (or ``"*"``) swaps treadle's
side of those checks for the naive peer's implementation; ``TREADLE_GUARD_REFERENCE="check,..."`` (or
``"*"``) runs treadle's side of those time checks through its PyTorch reference backend (GRPO, STAIR), the
slow path a dispatch regression would fall back to. None is read outside this guard.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
THRESHOLDS = HERE / "guard_thresholds.json"
MARGIN_FLOOR = {"time": 0.15, "memory": 0.35}
SPREAD_FACTOR = 2.0


@dataclass
class Check:
    name: str
    kind: str  # "time" | "memory"
    ours: str  # what treadle's side is
    peer: str  # the main peer
    # time: (side) -> (ours_fn, peer_fn), side "treadle" | "peer" | "reference"; memory: the subprocess's args
    build: Callable


# ---------------------------------------------------------------------------------------------- time
def _grpo(layout: str, peer: str, n: int = 65536):
    def build(side: str):
        import torch

        sys.path.insert(0, str(HERE))
        import bench_grpo as bg
        from treadle.ops import grpo_advantages
        from treadle.reference.grpo import grpo_advantages_scatter

        torch.manual_seed(0)
        rewards, ids = bg.make_batch(n, layout)
        if peer == "trl_view":
            g = int(layout.removesuffix("-shuffled")[1:])
            peer_fn = lambda: bg.trl_view(rewards, g)  # noqa: E731
        else:
            peer_fn = lambda: grpo_advantages_scatter(rewards, ids)  # noqa: E731
        if side == "peer":
            return peer_fn, peer_fn
        backend = "reference" if side == "reference" else "cpp"
        return (lambda: grpo_advantages(rewards, ids, backend=backend)), peer_fn
    return build


STAIR_FWD_BWD_SHAPE = dict(B=1, Hq=8, Hkv=2, D=64, T=256, M=2048)
# The forward alone: D = 128 as in bench_stair's CPU case (where the <= 0.85x target is stated),
# a quarter of its query heads and an eighth of its T x M so that one call takes ~0.1 s on one thread.
STAIR_FWD_SHAPE = dict(B=1, Hq=8, Hkv=2, D=128, T=512, M=4096)


def _stair(backward: bool, shape: dict = STAIR_FWD_BWD_SHAPE):
    def build(side: str):
        sys.path.insert(0, str(HERE))
        import bench_stair as bs

        bs.OPS_BACKEND = "cpp"
        peer_fn = bs._runner("two_sdpa", shape, backward)
        # "reference": treadle's PyTorch reference backend (materialises the T x M scores)
        impl = {"treadle": "treadle_stair", "reference": "naive_reference"}.get(side)
        return (peer_fn if impl is None else bs._runner(impl, shape, backward)), peer_fn
    return build


def _gated_lora(d: int, backward: bool):
    def build(side: str):
        sys.path.insert(0, str(HERE))
        import bench_scale as bsc

        if side == "reference":
            raise ValueError("gated_lora_fwd_bwd_vs_peft has no reference variant (TREADLE_GUARD_REFERENCE)")
        bsc.TOKENS, bsc.OPS_BACKEND = 1024, "cpp"
        peer_fn = bsc._make("peft_lora+gate", d, backward)
        ours = peer_fn if side == "peer" else bsc._make("treadle_gated_lora_linear", d, backward)
        return ours, peer_fn
    return build


CHECKS = [
    Check("grpo_contiguous_vs_trl", "time", "grpo_advantages cpp, N=65,536 contiguous groups of 16",
          "TRL view-by-position", _grpo("g16", "trl_view")),
    Check("grpo_contiguous_g8_vs_trl", "time", "grpo_advantages cpp, N=65,536 contiguous groups of 8",
          "TRL view-by-position", _grpo("g8", "trl_view")),
    Check("grpo_shuffled_vs_scatter", "time", "grpo_advantages cpp, N=65,536 shuffled ragged 1..32",
          "torch scatter (index_add)", _grpo("ragged1-32-shuffled", "scatter")),
    Check("stair_fwd_bwd_vs_two_sdpa", "time", "stair_readout fwd+bwd, Hq=8 Hkv=2 D=64 T=256 M=2048 fp32",
          "two SDPA calls (autograd)", _stair(True)),
    Check("stair_fwd_eps0_vs_two_sdpa", "time", "stair_readout fwd eps=0, Hq=8 Hkv=2 D=128 T=512 M=4096 fp32",
          "two SDPA calls (no grad)", _stair(False, STAIR_FWD_SHAPE)),
    Check("gated_lora_fwd_bwd_vs_peft", "time", "gated_lora_linear fwd+bwd, d=1024, 1,024 tokens, r=16 fp32",
          "PEFT LoRA + separate gate", _gated_lora(1024, True)),
    Check("stair_memory_vs_naive", "memory", "stair_readout fwd, Hq=8 Hkv=2 D=64 T=128 M=8192 fp32",
          "naive reference (T x M scores)", ("stair",)),
    Check("topk_entropy_memory_vs_full", "memory", "topk_entropy_from_hidden fwd+bwd, N=1,024 V=32,768 k=100, "
          "chunks of 256 rows", "full logits + topk_entropy", ("topk",)),
]
BY_NAME = {c.name: c for c in CHECKS}


def _flag_map(var: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in os.environ.get(var, "").split(","))):
        k, _, v = part.partition("=")
        out[k] = v
    return out


def _flag(var: str, name: str) -> str | None:
    m = _flag_map(var)
    return m.get(name, m.get("*"))


def _slowed(fn: Callable, factor: int) -> Callable:
    def slow():
        for _ in range(factor):
            fn()
    return slow


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _batch_time(fn: Callable, calls: int) -> float:
    t0 = _clock()
    for _ in range(calls):
        fn()
    return (_clock() - t0) / calls


def run_time_check(check: Check, rounds: int, round_ms: float) -> dict:
    side = ("peer" if _flag("TREADLE_GUARD_NAIVE", check.name) is not None
            else "reference" if _flag("TREADLE_GUARD_REFERENCE", check.name) is not None else "treadle")
    ours, peer = check.build(side)
    factor = _flag("TREADLE_GUARD_SLOWDOWN", check.name)
    if factor:
        ours = _slowed(ours, int(factor))
    calls = {}
    for side, fn in (("ours", ours), ("peer", peer)):
        fn()
        fn()  # warm-up: caches, scratch buffers, lazy imports
        one = min(_batch_time(fn, 1) for _ in range(3))
        calls[side] = max(1, min(10_000, int(round_ms / 1e3 / max(one, 1e-7))))
    ratios, t_ours, t_peer = [], [], []
    for i in range(rounds):
        order = (("ours", ours), ("peer", peer)) if i % 2 == 0 else (("peer", peer), ("ours", ours))
        t = {side: _batch_time(fn, calls[side]) for side, fn in order}
        t_ours.append(t["ours"])
        t_peer.append(t["peer"])
        ratios.append(t["peer"] / t["ours"])
    return {"ratio": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios],
            "ours_ms": statistics.median(t_ours) * 1e3, "peer_ms": statistics.median(t_peer) * 1e3,
            "calls_per_round": calls}


# -------------------------------------------------------------------------------------------- memory
_MEM_SCRIPT = r"""
import gc, json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.manual_seed(0)
what, impls = sys.argv[2], sys.argv[3].split(",")

def status(field):  # kB fields of /proc/self/status
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))

def make(impl):
    if what == "stair":
        import bench_stair as bs
        name = "treadle_stair" if impl == "ours" else "naive_reference"
        return bs._runner(name, dict(B=1, Hq=8, Hkv=2, D=64, T=128, M=8192), False)
    from treadle.ops import topk_entropy, topk_entropy_from_hidden
    n, vocab, d, k = 1024, 32768, 64, 100
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(vocab, d) / d ** 0.5
    if impl == "ours":
        def run():
            topk_entropy_from_hidden(h, w, k=k, chunk_size=256).backward()
            h.grad = None
    else:
        def run():
            topk_entropy(h @ w.t(), k=k).backward()
            h.grad = None
    return run

out = {}
for impl in impls:
    run = make(impl)
    # one warm-up call first: lazy one-off costs (code pages of kernels touched for the first time,
    # thread pools, allocator arenas) otherwise land in whichever side runs first and swamp a small peak
    run()
    peaks, t0 = [], time.perf_counter()
    for _ in range(2):  # the smaller of two measured calls
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS high-water mark (VmHWM)
            f.write("5")
        before = status("VmRSS")
        run()
        peaks.append(max(status("VmHWM") - before, 1))
    out[impl] = {"extra_peak": min(peaks), "seconds": (time.perf_counter() - t0) / 2}
    del run
    gc.collect()
print(json.dumps(out))
"""


def run_memory_check(check: Check) -> dict:
    (what,) = check.build
    naive = _flag("TREADLE_GUARD_NAIVE", check.name) is not None
    # TRITON_INTERPRET=0: an inherited 1 (the test suite's) would make treadle's CPU ops dispatch to the
    # Triton interpreter
    env = {**os.environ, "TREADLE_BENCH_DEVICE": "cpu", "TRITON_INTERPRET": "0", "MALLOC_MMAP_THRESHOLD_": "131072",
           "MALLOC_TRIM_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    # ours first, then the naive peer; a naive "ours" (test flag) runs the peer's code in its place
    res = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, str(HERE), what, "peer,peer" if naive else "ours,peer"],
                         capture_output=True, text=True, timeout=600, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"memory check {check.name} failed:\n{res.stderr[-2000:]}")
    m = json.loads(res.stdout.strip().splitlines()[-1])
    ours = m["ours"] if not naive else m["peer"]
    mib = 2**20
    return {"ratio": m["peer"]["extra_peak"] / ours["extra_peak"], "ours_MiB": ours["extra_peak"] / mib,
            "peer_MiB": m["peer"]["extra_peak"] / mib}


# ----------------------------------------------------------------------------------------------- run
def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_checks(names: list[str], rounds: int, round_ms: float, log=print) -> dict:
    results = {}
    for name in names:
        c = BY_NAME[name]
        t0 = time.perf_counter()
        r = run_time_check(c, rounds, round_ms) if c.kind == "time" else run_memory_check(c)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        log(f"  {name:<32} {c.kind:<6} ratio {r['ratio']:7.2f}x  ({r['seconds']} s)")
    return results


def load_thresholds(path: Path = THRESHOLDS) -> dict:
    return json.loads(path.read_text())["checks"]


def verdict(results: dict, thresholds: dict) -> list[str]:
    """One line per failed check (empty: all passed)."""
    bad = []
    for name, r in results.items():
        th = thresholds.get(name)
        if th is None:
            bad.append(f"{name}: no threshold in {THRESHOLDS.name}; run `python bench/guard.py --calibrate 3`")
        elif r["ratio"] < th["min_ratio"]:
            peer = BY_NAME[name].peer if name in BY_NAME else th.get("peer", "peer")
            bad.append(f"{name}: {peer} / treadle = {r['ratio']:.2f}x, below the threshold {th['min_ratio']:.2f}x "
                       f"(calibrated medians {th['calibration']['medians']})")
    return bad


def threshold_from(medians: list[float], kind: str) -> tuple[float, float, float]:
    """(min_ratio, spread, margin) from the calibration passes' median ratios (rule in the module doc)."""
    spread = (max(medians) - min(medians)) / statistics.median(medians)
    margin = max(MARGIN_FLOOR[kind], SPREAD_FACTOR * spread)
    return round(min(medians) * (1 - margin), 3), round(spread, 3), round(margin, 3)


def calibrate(names: list[str], passes: int, rounds: int, round_ms: float, path: Path = THRESHOLDS) -> dict:
    runs, load = [], [os.getloadavg()[0]]
    for p in range(passes):
        print(f"calibration pass {p + 1}/{passes}")
        runs.append(run_checks(names, rounds, round_ms))
    load.append(os.getloadavg()[0])
    old = json.loads(path.read_text())["checks"] if path.exists() else {}
    checks = dict(old)
    for name in names:
        meds = [round(r[name]["ratio"], 3) for r in runs]
        c = BY_NAME[name]
        min_ratio, spread, margin = threshold_from(meds, c.kind)
        cal = {"medians": meds, "spread": spread, "margin": margin, "rounds": rounds, "round_ms": round_ms,
               "clock": [k for k, v in CLOCKS.items() if v is _clock][0],
               "load_avg_1min": [round(x, 1) for x in load],  # before, after
               "min_ratio": min_ratio, **machine()}
        # one calibration per CPU model (the newest of each); the threshold is the lowest of them, so the
        # guard holds on every CPU it was calibrated on (ratios against a peer differ between CPUs)
        prev = old.get(name, {})
        cals = [x for x in prev.get("calibrations", [prev["calibration"]] if "calibration" in prev else [])
                if x.get("cpu") != cal["cpu"]] + [cal]
        for x in cals:  # entries written before per-CPU calibrations hold min_ratio beside them
            x.setdefault("min_ratio", threshold_from(x["medians"], c.kind)[0])
        checks[name] = {"kind": c.kind, "treadle": c.ours, "peer": c.peer,
                        "min_ratio": min(x["min_ratio"] for x in cals), "calibration": cal, "calibrations": cals}
    doc = ("ratio = peer / treadle (time: median over interleaved rounds; memory: naive peak / treadle peak). "
           "Per calibration (one per CPU model, in 'calibrations'; 'calibration' is the newest): min_ratio = "
           "min(calibration medians) * (1 - margin), margin = max(floor, 2 * spread), spread = "
           "(max - min) / median of the calibration medians, floor 0.15 (time) / 0.35 (memory); a check's "
           "min_ratio is the lowest over its CPUs. "
           "Recalibrate with `python bench/guard.py --calibrate 3` on an idle machine; see bench/guard.py.")
    path.write_text(json.dumps({"_doc": doc, "checks": checks}, indent=1) + "\n")
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds per time check (default 15)")
    ap.add_argument("--round-ms", type=float, default=40.0, help="target time of one side's round (default 40 ms)")
    ap.add_argument("--calibrate", type=int, default=0, metavar="N", help="run N passes and rewrite the thresholds")
    ap.add_argument("--thresholds", type=Path, default=THRESHOLDS, help="threshold file")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                    help="cpu: process CPU time (default; on a shared machine wall time also counts the time the "
                         "process waits for a core, which swamps the ratios); wall: perf_counter")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the time checks (default 1: on a shared machine a second intra-op "
                         "thread that waits for a busy core makes wall times jump by orders of magnitude)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"error: --only: unknown check(s) {unknown}; have {list(BY_NAME)}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.round_ms <= 0:
        print("error: --rounds must be >= 1 and --round-ms > 0", file=sys.stderr)
        return 2
    import torch

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, names)
    finally:
        torch.set_num_threads(threads)


def _run(args, names: list[str]) -> int:
    global _clock
    _clock = CLOCKS[args.clock]
    if args.calibrate:
        calibrate(names, args.calibrate, args.rounds, args.round_ms, args.thresholds)
        print(f"thresholds written to {args.thresholds}")
        return 0
    thresholds = load_thresholds(args.thresholds)
    m = machine()
    print(f"perf guard on {m['cpu']} ({m['cores']} cores, torch {m['torch']}), {args.rounds} rounds a time check")
    t0 = time.perf_counter()
    results = run_checks(names, args.rounds, args.round_ms)
    bad = verdict(results, thresholds)
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "results": results, "failed": bad}, indent=1))
    for line in bad:
        print(f"REGRESSION {line}")
    print(f"perf guard: {len(results) - len(bad)}/{len(results)} passed in {time.perf_counter() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
