"""Mutation testing of treadle's core modules with mutmut (``make mutate``; not part of ``make test``).

Usage::

    python tests/mutation/mutate.py [AREA ...] [--max-children N] [--resume]
    python tests/mutation/mutate.py --list

One AREA at a time (default: all, in order) is mutated in a scratch copy under
``build/mutate/<AREA>/`` with only the fast tests of that area, so a run fits a shared CPU. mutmut 3
imports mutants from ``./src``, so the scratch copy lays the package out as ``src/treadle`` (the repo
keeps it under ``python/``); the compiled extension is copied along, so C++ backends stay in play.
The score per area is printed at the end and written to ``build/mutate/<AREA>/score.json``;
survivors are listed with ``mutmut results`` / ``mutmut show NAME`` run inside that folder.
tests/MUTATION.md records the last scores and why each surviving mutant is equivalent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# area -> (files to mutate, relative to python/; fast tests that guard them; extra pytest selection args)
AREAS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "grpo": (
        ["treadle/grpo/losses.py", "treadle/grpo/broadcast.py", "treadle/grpo/grouping.py"],
        ["tests/grpo/test_losses_and_broadcast.py", "tests/grpo/test_loss_formulas.py"],
        [],
    ),
    "reference": (
        ["treadle/reference/grpo.py", "treadle/reference/scale.py", "treadle/reference/stair.py"],
        ["tests/grpo/test_advantages.py", "tests/scale/test_gated_lora.py", "tests/stair/test_stair_readout.py",
         "tests/scale/test_topk_entropy.py", "tests/metrics/test_reference_formulas.py",
         "tests/reference/test_reference_edges.py"],
        # the C++ kernels check the reference as strictly as Triton does, in a fraction of the time
        ["-k", "not triton and not cuda and not opcheck and not compile"],
    ),
    "dispatch": (
        ["treadle/dispatch.py"],
        ["tests/test_dispatch.py", "tests/test_backends_present.py"],
        ["-k", "not a_missing_backend_is"],  # that one runs a child pytest, which never sees the mutant
    ),
    "ops": (  # the public ops: argument checks, dispatch to the backends, autograd glue, autocast
        ["treadle/ops/grpo_advantages.py", "treadle/ops/gated_lora.py", "treadle/ops/stair_readout.py",
         "treadle/ops/topk_entropy.py", "treadle/ops/_amp.py"],
        ["tests/grpo/test_advantages.py", "tests/scale/test_gated_lora.py", "tests/stair/test_stair_readout.py",
         "tests/scale/test_topk_entropy.py", "tests/contracts/test_nonfinite.py", "tests/contracts/test_autocast.py",
         "tests/ops/test_ops_arguments.py", "tests/ops/test_ops_dispatch.py", "tests/ops/test_ops_dtensor.py"],
        # Triton under the interpreter is far too slow per mutant (the C++ kernels are checked as strictly); CUDA
        # needs a GPU machine
        ["-k", "not triton and not cuda and not opcheck and not compile"],
    ),
    # WEFT, one module (or a pair) per area so a run fits a shared CPU; "weft" runs all four
    "weft-state": (
        ["treadle/weft/runtime/state.py", "treadle/weft/runtime/sqlite_state.py"],
        ["tests/weft/test_state.py", "tests/weft/test_state_units.py", "tests/weft/test_fork.py",
         "tests/weft/test_shop.py"],
        [],
    ),
    "weft-object": (
        ["treadle/weft/runtime/object_state.py"],
        ["tests/weft/test_state.py", "tests/weft/test_object_state_units.py", "tests/weft/test_fork.py"],
        [],
    ),
    "weft-verify": (
        ["treadle/weft/runtime/verify.py"],
        ["tests/weft/test_verify.py", "tests/weft/test_verify_units.py", "tests/weft/test_determinism.py",
         "tests/weft/test_shop.py"],
        [],
    ),
    "weft-checkpoint": (
        ["treadle/weft/runtime/checkpoint.py"],
        ["tests/weft/test_checkpoint.py", "tests/weft/test_checkpoint_units.py", "tests/weft/test_determinism.py"],
        [],
    ),
}


# a name that stands for several areas, run in order
ALIASES: dict[str, list[str]] = {"weft": [a for a in AREAS if a.startswith("weft-")]}


def _prepare(area: str, work: Path, resume: bool) -> None:
    files, tests, select = AREAS[area]
    tests = [t for t in tests if (REPO / t).exists()]
    if not resume and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    if not (work / "src").exists():
        shutil.copytree(REPO / "python", work / "src", ignore=ignore)
    for name in ("tests",):
        shutil.copytree(REPO / name, work / name, ignore=ignore, dirs_exist_ok=True)
    shutil.copy2(REPO / "pyproject.toml", work / "pyproject.toml")
    cfg = ["[mutmut]", "source_paths = src", "only_mutate ="]
    cfg += [f"    src/{f}" for f in files]
    cfg += ["pytest_add_cli_args_test_selection ="] + [f"    {a}" for a in tests + select]
    cfg += ["pytest_add_cli_args =", "    -p", "    no:cacheprovider", "    -q",
            "process_isolation = fork", "use_git_change_detection = false", ""]
    (work / "setup.cfg").write_text("\n".join(cfg))


def _score(work: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True)
    counts: dict[str, int] = {}
    per_module: dict[str, dict[str, int]] = {}
    survivors = []
    for line in out.stdout.splitlines():
        if ":" not in line:
            continue
        name, status = (s.strip() for s in line.rsplit(":", 1))
        counts[status] = counts.get(status, 0) + 1
        module = name.split(".x_")[0].split(".xǁ")[0]
        per_module.setdefault(module, {}).setdefault(status, 0)
        per_module[module][status] += 1
        if status not in ("killed", "timeout", "not checked"):
            survivors.append(name)

    def pct(c: dict) -> float | None:
        # a mutant no test reaches ("no tests") is a survivor too; "not checked" ones are left out
        judged = sum(v for k, v in c.items() if k != "not checked")
        return None if not judged else round(100.0 * (c.get("killed", 0) + c.get("timeout", 0)) / judged, 1)

    return {"counts": counts, "killed_pct": pct(counts),
            "per_module": {m: dict(c, killed_pct=pct(c)) for m, c in sorted(per_module.items())},
            "survivors": survivors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("areas", nargs="*", help=f"areas to mutate (default all): {', '.join(AREAS)}; weft = every weft-* area")
    p.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--resume", action="store_true", help="keep build/mutate/<area> and mutmut's cached results")
    p.add_argument("--list", action="store_true", help="print the areas, their files and tests, and exit")
    args = p.parse_args(argv)
    if args.list:
        for a, (files, tests, select) in AREAS.items():
            print(f"{a}: {' '.join(files)}\n    tests: {' '.join(tests + select)}")
        return 0
    areas = [x for a in args.areas for x in (ALIASES.get(a) or [a])]
    bad = [a for a in areas if a not in AREAS]
    if bad:
        p.error(f"unknown area(s) {bad}; expected some of {list(AREAS)}")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CI="")
    scores = {}
    for area in areas or list(AREAS):
        work = REPO / "build" / "mutate" / area
        _prepare(area, work, args.resume)
        print(f"== mutmut: {area} in {work.relative_to(REPO)}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                            cwd=work, env=env).returncode
        score = _score(work)
        score["mutmut_rc"] = rc
        (work / "score.json").write_text(json.dumps(score, indent=1))
        scores[area] = score
        print(f"== {area}: {score['killed_pct']}% killed {score['counts']}", flush=True)
    for area, s in scores.items():
        print(f"{area:10s} {s['killed_pct']}% killed; survivors: {len(s['survivors'])}")
        for m, c in s["per_module"].items():
            print(f"    {m}: {c}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
