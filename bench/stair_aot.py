"""Compile the STAIR read-out kernels' pinned configs for sm_90a on a CPU and print what ptxas gives.

    TRITON_CACHE_DIR=$(mktemp -d) python bench/stair_aot.py [--module treadle.triton_kernels.stair] [-k SUBSTR] [--json F]

Needs triton 3.6 (the H200 image's version; ``pip install triton==3.6.0``), no GPU and no driver. Per
spec of the module's ``aot_specs()``: registers, spill bytes, shared memory, wgmma / TMA / warp
specialisation, the ptxas warning codes (C7511 / C7515: wgmma serialised), and whether that matches
what the spec expects. Exit status 1 when any spec fails (spills, a warning, shared memory over
232,448 B, an expected feature missing). ``bench/gpu_aot.py`` is the project-wide check; this script
is the STAIR kernels' own quick loop.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import time

SMEM_LIMIT = 232_448


def compile_spec(spec) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    names = list(spec.signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.divisible_by_16}
    src = triton.compiler.ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    buf = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(buf):
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options})
    log = buf.getvalue()
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    regs = max((int(x) for x in re.findall(r"Used (\d+) registers", log)), default=-1)
    spill = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log))
    row = {
        "kernel": spec.kernel, "config": spec.config, "registers": regs, "spill_bytes": spill,
        "shared_bytes": int(k.metadata.shared), "wgmma": "wgmma.mma_async" in ptx,
        "tma": "cp.async.bulk.tensor" in ptx, "warp_specialized": "ttg.warp_specialize" in ttgir,
        "warnings": sorted(set(re.findall(r"\b(C\d{4})\b", log))),
        "setmaxnreg": "setmaxnreg" in ptx, "global_scratch": int(getattr(k.metadata, "global_scratch_size", 0)),
        "seconds": round(time.time() - t0, 1),
    }
    fails = []
    if spill:
        fails.append("spills")
    if set(row["warnings"]) & {"C7511", "C7515"}:
        fails.append("wgmma serialised")
    if row["shared_bytes"] > SMEM_LIMIT:
        fails.append("smem")
    for key, want in (("wgmma", spec.expect_wgmma), ("tma", spec.expect_tma),
                      ("warp_specialized", spec.expect_warp_specialized)):
        if want and not row[key]:
            fails.append(f"no {key}")
    row["warning_text"] = sorted(set(re.findall(r"warning[^\n]*", log)))
    row["fail"] = fails
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", default="treadle.triton_kernels.stair")
    ap.add_argument("-k", default="", help="only specs whose kernel/config contains this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    mod = importlib.import_module(args.module)
    rows = []
    print(f"{'kernel':10} {'config':48} regs spill  smem   wgmma tma ws   warn  fail")
    for spec in mod.aot_specs():
        if args.k and args.k not in f"{spec.kernel} {spec.config}":
            continue
        try:
            r = compile_spec(spec)
        except Exception as exc:  # noqa: BLE001 - a compile failure is a result to report
            r = {"kernel": spec.kernel, "config": spec.config, "error": f"{type(exc).__name__}: {exc}"[:400],
                 "fail": ["compile error"]}
            print(f"{spec.kernel:10} {spec.config:48} ERROR {r['error'][:200]}")
        else:
            print(f"{r['kernel']:10} {r['config']:48} {r['registers']:4} {r['spill_bytes']:5} {r['shared_bytes']:6} "
                  f"{r['wgmma']!s:5} {r['tma']!s:5} {r['warp_specialized']!s:5} {','.join(r['warnings']) or '-':5} "
                  f"{','.join(r['fail']) or 'ok'} ({r['seconds']} s)")
        sys.stdout.flush()
        rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["fail"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
