"""WEFT failure attribution over every eligible BFCL v4 ``base`` entry (not one per class, as the drill does).

Runs :func:`~treadle.weft.evolve.faults_bfcl.bfcl_suite` with ``limit=None, per_class=None`` (the first turn of
every single-class ``base`` entry whose gold executes and is not on the audit's exclusion list), each case
attributed as the evolution loop does (``as_loop``), and prints the confusion (injected label -> blame) and every
case blamed on another component than its label. Needs ``bfcl-eval``; deterministic and offline (no model is asked).

    python bench/bfcl_attribution_wide.py                                  # table and misattributions
    python bench/bfcl_attribution_wide.py --page bench/results/<dir>/weft-attribution-bfcl-wide.md --json cases.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import sys
import time
from pathlib import Path

import anyio


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


async def _run() -> list:
    from treadle.weft.evolve.faults_bfcl import bfcl_suite
    from treadle.weft.runtime import Runtime

    async with Runtime() as rt:
        return await bfcl_suite(rt, limit=None, per_class=None, as_loop=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", type=Path, help="write a results page (markdown with front matter) here")
    ap.add_argument("--json", type=Path, help="write every case (label, blame, rule, detail) here")
    args = ap.parse_args(argv)
    try:
        import bfcl_eval  # noqa: F401
    except ImportError as err:
        print(f"bfcl-eval is not installed ({err}); pip install --no-deps bfcl-eval", file=sys.stderr)
        return 2
    from treadle.weft.evolve.faults import report

    logging.getLogger("treadle.weft.tools").setLevel(logging.CRITICAL)  # injected crashes log tracebacks
    t0 = time.perf_counter()
    cases = anyio.run(_run)
    wall = time.perf_counter() - t0
    rep = report(cases)
    table = rep.table()
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    lines += ["| " + " | ".join(r) + " |" for r in table[1:]]
    wrong = [c for c in rep.observed if not c.correct]
    entries = len({c.task for c in cases})
    head = (f"{len(cases)} faults over {entries} entries, {len(rep.observed)} observed; accuracy "
            f"{rep.accuracy:.1%}; {wall:.0f} s wall")
    miss = [f"- `{c.id}`: {c.label.value} -> {c.attribution.blame.value} ({c.attribution.rule}): "
            f"{c.attribution.detail[:240]}" for c in wrong]
    print(head)
    print("\n".join(lines))
    print("\n".join(miss) or "every observed case is blamed on its label")
    if args.json:
        args.json.write_text(json.dumps([c.model_dump(mode="json") for c in cases], indent=1))
    if args.page:
        front = ["---", "title: WEFT failure attribution over every eligible BFCL v4 base entry",
                 "command: python bench/bfcl_attribution_wide.py --page " + str(args.page),
                 f"device: {_cpu()}, {len(__import__('os').sched_getaffinity(0))} cores, no GPU (deterministic: "
                 "no model is asked)", f"date: {datetime.date.today().isoformat()}", "---"]
        body = [head + ".", "", *lines, "", "Cases blamed on another component than their label:", "",
                *(miss or ["none"])]
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text("\n".join(front + body) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
