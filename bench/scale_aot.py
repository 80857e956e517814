"""Compile the gated-LoRA Triton kernels for sm_90a on a CPU and print their GPU structure.

    TRITON_DUMP_PTXAS_LOG=1 python bench/scale_aot.py [--json FILE] [--only NAME]

Each :class:`triton_kernels.aot.AotSpec` of ``triton_kernels/scale.py`` is compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` (no GPU, no driver; pin the GPU
image's Triton, 3.6); registers, spill bytes and the C75xx warnings come from the ptxas log,
shared memory from the kernel's metadata, wgmma / TMA from the PTX, warp specialisation from the
TTGIR. Exits 1 when a kernel spills, serialises wgmma (C7511, C7512, C7515: any ptxas "wgmma ...
serialized" warning), needs more than 232,448 B of
shared memory, or lacks what its spec expects. (The project-wide check is ``bench/gpu_aot.py``.)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile

SMEM_LIMIT = 232_448


def _compile(spec):
    import triton
    from triton.backends.compiler import GPUTarget

    names = spec.fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    src = triton.compiler.ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
    opts = dict(num_warps=spec.num_warps, num_stages=spec.num_stages, **spec.options)
    log = io.StringIO()
    # ptxas's -v log goes to the process's stdout (fd 1) from a subprocess: capture the fd
    with tempfile.TemporaryFile(mode="w+") as tmp:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        try:
            with contextlib.redirect_stdout(log):
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read() + log.getvalue()
    return k, text


def check(spec) -> dict:
    k, log = _compile(spec)
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", log)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    row = dict(kernel=spec.kernel, config=spec.config, registers=max(regs) if regs else None,
               spill_bytes=sum(spills), shared_bytes=int(k.metadata.shared),
               wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
               warp_specialized="ttg.warp_specialize" in ttgir,
               warnings=sorted(set(re.findall(r"C75\d\d", log))),
               wgmma_ops=len(re.findall(r"wgmma.mma_async", ptx)),
               tma_ops=len(re.findall(r"cp.async.bulk.tensor", ptx)))
    problems = []
    if row["registers"] is None:
        problems.append("no ptxas log (a cached compile: use an empty TRITON_CACHE_DIR)")
    if row["spill_bytes"]:
        problems.append("spills")
    serialised = set(re.findall(r"\((C75\d\d)\)[^\n]*serialized", log))
    if serialised | (set(row["warnings"]) & {"C7511", "C7515"}):
        problems.append("wgmma serialised")
    if row["shared_bytes"] > SMEM_LIMIT:
        problems.append("shared memory over the limit")
    for key, want in (("wgmma", spec.expect_wgmma), ("tma", spec.expect_tma),
                      ("warp_specialized", spec.expect_warp_specialized)):
        if want and not row[key]:
            problems.append(f"no {key}")
    row["problems"] = problems
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--only", help="only kernels whose name contains this")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DUMP_PTXAS_LOG", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="scale-aot-"))
    import triton

    from treadle.triton_kernels.scale import aot_specs

    rows = []
    print(f"triton {triton.__version__}")
    print(f"{'kernel':20} {'config':44} {'regs':>4} {'spill':>5} {'smem':>7} wgmma tma ws  warnings problems")
    for spec in aot_specs():
        if args.only and args.only not in spec.kernel:
            continue
        row = check(spec)
        rows.append(row)
        print(f"{row['kernel']:20} {row['config']:44} {row['registers']!s:>4} {row['spill_bytes']:>5} "
              f"{row['shared_bytes']:>7} {row['wgmma_ops']:>5} {row['tma_ops']:>3} {int(row['warp_specialized']):>2}  "
              f"{','.join(row['warnings']) or '-':8} {','.join(row['problems']) or 'ok'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["problems"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
