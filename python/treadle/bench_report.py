"""``treadle bench`` / ``make bench``: run the benchmark suites in ``bench/`` and write one report.

The suites (pytest-benchmark) record, per case, each implementation's time and extras into
``<out>/last_<suite>.json`` (bench/conftest.py). This module runs them and turns those files into:

* ``report.md``: per suite, a table of every case, treadle's implementation(s), each named peer, the
  two times and the ratio peer / treadle (> 1: treadle faster), plus memory rows where a suite
  measured peak memory; above it the machine (CPU model, cores, torch/triton/python versions, the
  backend each op dispatches to, git commit, date);
* ``report.json``: the same, machine-readable;
* ``ratios.png``: a bar chart of every (case, peer) ratio on a log scale, one panel per suite
  (matplotlib's object API, no pyplot state).

Baselines: every full run saves a pytest-benchmark baseline under ``bench/baselines/`` and, when one
from an earlier run on this machine exists, prints pytest-benchmark's ``--benchmark-compare`` table
next to it. The comparison is reported, never gating (the gate is bench/guard.py's ratios).
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
BASELINES = BENCH / "baselines"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU, GPU, versions, backends and commit of the current run."""
    import torch

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        info["triton"] = None
    info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import treadle

        info["treadle"] = getattr(treadle, "__version__", None)
        info["backends"] = {op: {dev: v.get("backend") for dev, v in devs.items()}
                            for op, devs in treadle.backends().items()}
    except Exception as err:  # noqa: BLE001
        info["backends"] = f"unavailable: {err}"
    try:
        try:
            src = find_bench().parent  # the checkout whose suites run (not site-packages after `pip install .`)
        except FileNotFoundError:
            src = ROOT
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def find_bench(cwd: Path | None = None) -> Path:
    """The ``bench/`` folder of the suites: next to the package (an editable install or a source tree), else
    in the current directory or one of its parents (a source checkout whose package was ``pip install``-ed
    into a venv: the package then lives in site-packages, far from the clone).

    Raises:
        FileNotFoundError: none of those holds a ``bench/`` with ``bench_*.py`` (the message names where it
            looked).
    """
    here = Path.cwd() if cwd is None else Path(cwd)
    candidates = [BENCH, *(d / "bench" for d in (here, *here.parents))]
    for c in candidates:
        if c.is_dir() and any(c.glob("bench_*.py")):
            return c
    looked = [str(BENCH), str(here / "bench")] + ([f"{here.parent}/.../bench"] if here.parent != here else [])
    raise FileNotFoundError(f"no bench/ folder with bench_*.py suites found; looked next to the package and in the "
                            f"current directory and its parents ({', '.join(looked)}); run from a source checkout")


def _suites(ops: list[str], bench: Path | None = None) -> list[Path]:
    bench = find_bench() if bench is None else bench
    have = sorted(p for p in bench.glob("bench_*.py"))
    if not ops:
        return have
    files = [bench / f"bench_{o}.py" for o in ops]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise ValueError(f"--ops: no such benchmark suite {missing}; have {[p.stem.removeprefix('bench_') for p in have]}")
    return files


#: pytest exit codes after which the suites ran (0: all passed, 1: some failed): the only ones a report follows
BENCHMARKS_RAN = (0, 1)
PYTEST_EXIT_CODES = {2: "interrupted", 3: "internal error", 4: "usage error (a bad pytest argument?)",
                     5: "no benchmarks collected"}


class BenchNotRunError(RuntimeError):
    """pytest exited without running the suites; no report was written."""

    def __init__(self, rc: int, why: str):
        super().__init__(f"pytest exited {rc} ({why}); the benchmarks did not run and no report was written")
        self.rc = rc


def run(ops: list[str], out: Path | None = None, save: str = "", compare: bool = True, report: bool = True,
        extra: list[str] | None = None) -> int:
    """Run the suites (all when ``ops`` is empty) and write the report into ``out`` (default
    ``bench/results/report-<date>``). Returns pytest's exit code.

    Raises:
        FileNotFoundError: no ``bench/`` folder (installed without the source checkout).
        ValueError: an unknown suite name in ``ops``.
        BenchNotRunError: pytest exited with a code other than 0 or 1 (e.g. 4 for a bad argument in
            ``extra``): no report is written, and a report folder this call created is removed.
    """
    bench = find_bench()
    files = _suites(ops, bench)
    baselines = bench / "baselines"
    out = out or bench / "results" / f"report-{time.strftime('%Y%m%d-%H%M%S')}"
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "--benchmark-enable", "-p", "no:cacheprovider", "-q",
           "--override-ini", "addopts=", "--override-ini", "testpaths=bench", "-o", "python_files=bench_*.py",
           f"--benchmark-json={out / 'pytest-benchmark.json'}", f"--benchmark-storage=file://{baselines}"]
    if save or not ops:  # a full run always keeps a baseline
        cmd.append(f"--benchmark-save={save or 'full'}")
    if compare and _has_baseline(baselines):
        cmd.append("--benchmark-compare")  # reported, never gating (no --benchmark-compare-fail)
    cmd += list(extra or [])
    env = {**os.environ, "TREADLE_BENCH_RESULTS_DIR": str(out)}
    rc = subprocess.call(cmd, cwd=bench.parent, env=env)
    if rc not in BENCHMARKS_RAN:
        # pytest never ran the suites (bad arguments, interrupted, internal error, nothing collected): a report
        # would show an old run's or no numbers as this one's. A folder this call created holds nothing else.
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise BenchNotRunError(rc, PYTEST_EXIT_CODES.get(rc, "unknown exit code"))
    if report:
        paths = write_report(out)
        print(f"report: {', '.join(str(p) for p in paths)}")
    return rc


def _has_baseline(baselines: Path = BASELINES) -> bool:
    return baselines.is_dir() and any(baselines.glob("*/*.json"))


def _fmt_ms(s: float) -> str:
    ms = s * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def collect(results_dir: Path) -> dict:
    """``{suite: {"machine": str, "date": str, "cases": {case: {impl: row}}}}`` from ``last_*.json``."""
    return {json.loads(p.read_text())["suite"]: json.loads(p.read_text()) for p in sorted(results_dir.glob("last_*.json"))}


def ratio_rows(suites: dict) -> list[dict]:
    """One row per (suite, case, treadle implementation, peer): times and peer / treadle ratio."""
    rows = []
    for suite, data in suites.items():
        for case, impls in data["cases"].items():
            ours = {k: v for k, v in impls.items() if k.startswith("treadle")}
            peers = {k: v for k, v in impls.items() if not k.startswith("treadle")}
            for o_name, o in ours.items():
                for p_name, p in peers.items():
                    rows.append({"suite": suite, "case": case, "treadle": o_name, "peer": p_name,
                                 "treadle_s": o["seconds"], "peer_s": p["seconds"],
                                 "ratio": p["seconds"] / o["seconds"] if o["seconds"] > 0 else math.inf,
                                 "treadle_extra": {k: v for k, v in o.items() if k != "seconds"},
                                 "peer_extra": {k: v for k, v in p.items() if k != "seconds"}})
            if not peers or not ours:  # a case with one side only (e.g. a memory case): keep it visible
                for name, v in impls.items():
                    rows.append({"suite": suite, "case": case, "treadle": name if name in ours else None,
                                 "peer": None if name in ours else name, "treadle_s": v["seconds"] if name in ours else None,
                                 "peer_s": None if name in ours else v["seconds"], "ratio": None,
                                 "treadle_extra": {k: x for k, x in v.items() if k != "seconds"}, "peer_extra": {}})
    return rows


def write_report(results_dir: Path, machine: dict | None = None) -> list[Path]:
    """Write report.md, report.json and ratios.png into ``results_dir`` from its ``last_*.json``."""
    suites = collect(results_dir)
    machine = machine or machine_info()
    rows = ratio_rows(suites)
    device = "GPU" if machine.get("gpu") else "CPU"
    where = (f"{machine['gpu']}; " if machine.get("gpu") else "") + f"{machine['cpu']}, {machine['cores']} cores"
    # front matter read by the docs' Benchmarks page (docs/benchresults.py): command, device, date
    lines = ["---", f"title: Every {device} suite vs its peers", f"command: {machine.get('command', 'treadle bench --report')}",
             f"device: {where}; torch {machine['torch']}", f"date: {machine['date'][:10]}", "---",
             f"# treadle benchmark report ({device})", "",
             f"- date: {machine['date']}; commit: {machine.get('commit')}",
             f"- CPU: {machine['cpu']} ({machine['cores']} cores, torch threads {machine['torch_threads']})"
             + (f"; GPU: {machine['gpu']}" if machine.get("gpu") else "; no GPU"),
             f"- versions: python {machine['python']}, torch {machine['torch']}, triton {machine.get('triton')}",
             f"- backends (op: cpu / cuda): " + (", ".join(f"{op}: {d.get('cpu')} / {d.get('cuda')}"
                                                        for op, d in machine["backends"].items())
                                                 if isinstance(machine.get("backends"), dict) else str(machine.get("backends"))),
             "", "Ratio = peer time / treadle time (> 1: treadle is faster), both measured in the same run.", ""]
    for suite in suites:
        lines += [f"## {suite}", "", "| case | treadle | peer | treadle time | peer time | ratio | notes |",
                  "|---|---|---|---|---|---|---|"]
        for r in (x for x in rows if x["suite"] == suite):
            notes = "; ".join(f"{k}={v}" for k, v in {**r["treadle_extra"], **r["peer_extra"]}.items())
            lines.append("| {} | {} | {} | {} | {} | {} | {} |".format(
                r["case"], r["treadle"] or "", r["peer"] or "", _fmt_ms(r["treadle_s"]) if r["treadle_s"] else "",
                _fmt_ms(r["peer_s"]) if r["peer_s"] else "", f"{r['ratio']:.2f}x" if r["ratio"] else "", notes))
        lines.append("")
    md = results_dir / "report.md"
    md.write_text("\n".join(lines))
    js = results_dir / "report.json"
    js.write_text(json.dumps({"machine": machine, "rows": rows, "suites": suites}, indent=1, default=str))
    png = results_dir / "ratios.png"
    plot_ratios(rows, png, title=f"treadle vs peers ({device}: {machine.get('gpu') or machine['cpu']}, "
                                   f"{machine['date'][:10]})")
    return [md, js, png]


def plot_ratios(rows: list[dict], path: Path, title: str) -> None:
    """Horizontal bars of peer / treadle per (case, peer), log scale, one panel per suite."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in rows if r["ratio"]]
    suites = list(dict.fromkeys(r["suite"] for r in rows)) or ["(no results)"]
    heights = [max(1, sum(r["suite"] == s for r in rows)) for s in suites]
    fig = Figure(figsize=(10, 1.2 + 0.24 * sum(heights) + 0.6 * len(suites)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(suites), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, suite in zip(axes, suites):
        sel = [r for r in rows if r["suite"] == suite]
        labels = [f"{r['case']}  {r['peer']} / {r['treadle']}" for r in sel]
        vals = [r["ratio"] for r in sel]
        colors = ["tab:green" if v >= 1 else "tab:red" for v in vals]
        ax.barh(range(len(sel)), vals, color=colors)
        ax.set_yticks(range(len(sel)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}x", va="center", fontsize=6)
        ax.set_title(suite, fontsize=9, loc="left")
        ax.set_xlabel("peer time / treadle time (log scale; > 1: treadle faster)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """``python -m treadle.bench_report DIR``: write the report from the ``last_*.json`` already in DIR
    (bench/gpu_check.sh uses it after running the GPU cases)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m treadle.bench_report RESULTS_DIR (a folder holding last_<suite>.json files)",
              file=sys.stderr)
        return 2
    paths = write_report(Path(args[0]))
    print(f"report: {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
