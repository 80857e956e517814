"""Shared benchmark plumbing: every suite records (case, implementation, median seconds) into one
table per run and prints the ratios against the named peers at the end (also written as JSON to
``bench/results/last_<suite>.json``, or into ``$TREADLE_BENCH_RESULTS_DIR`` when set: ``treadle bench``
sets it and turns those files into its report, see treadle.bench_report). Timings come from
pytest-benchmark's own statistics."""
from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

_ROWS: dict[str, dict[str, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))


class PeerTable:
    def __init__(self, suite: str):
        self.suite = suite

    def record(self, case: str, impl: str, benchmark=None, seconds: float | None = None, **extra) -> None:
        """Record ``impl``'s median time for ``case`` (from a finished pytest-benchmark fixture or given)."""
        if seconds is None:
            stats = getattr(benchmark, "stats", None)
            if stats is None:  # --benchmark-disable: nothing measured
                return
            seconds = stats.stats.median
        _ROWS[self.suite][case][impl] = {"seconds": seconds, **extra}


@pytest.fixture(scope="module")
def peer_table(request):
    return PeerTable(Path(request.module.__file__).stem.removeprefix("bench_"))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{cpu} ({os.cpu_count()} cores){gpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    out_dir = Path(os.environ.get("TREADLE_BENCH_RESULTS_DIR") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    for suite, cases in _ROWS.items():
        terminalreporter.section(f"{suite}: medians and ratios (peer time / treadle time; >1 means treadle is faster)")
        for case, impls in cases.items():
            ours = {k: v for k, v in impls.items() if k.startswith("treadle")}
            line = [f"{case}:"]
            for impl, row in impls.items():
                extra = "".join(f" {k}={v}" for k, v in row.items() if k != "seconds")
                line.append(f"  {impl:<28} {row['seconds'] * 1e3:10.3f} ms{extra}")
            for o_name, o in ours.items():
                for impl, row in impls.items():
                    if impl not in ours:
                        line.append(f"  ratio {impl} / {o_name}: {row['seconds'] / o['seconds']:.2f}x")
            terminalreporter.write_line("\n".join(line))
        payload = {"suite": suite, "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "cases": {c: dict(v) for c, v in cases.items()}}
        (out_dir / f"last_{suite}.json").write_text(json.dumps(payload, indent=1))
