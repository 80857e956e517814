"""Ahead-of-time structure check of every Triton kernel for an H200 (sm_90a), on a CPU.

Compiles each kernel at each config its op can launch (the ``aot_specs()`` of every module under
``treadle.triton_kernels``; see ``triton_kernels/aot.py``) with ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``: no GPU and no driver are needed, the ptxas of the triton wheel
does the final step. From the ptxas log (``TRITON_DUMP_PTXAS_LOG=1``), the PTX and the TTGIR it
reads registers, spill bytes, shared memory, ptxas warning codes, and whether the kernel uses wgmma
(``wgmma.mma_async``), TMA (``cp.async.bulk.tensor``) and warp specialisation
(``ttg.warp_specialize``), and from the wheel's ``nvdisasm`` the static SASS instruction count and how
many of those are float64 (``D*`` opcodes and 64-bit ``MUFU``): the instruction budget of a memory-bound
kernel, where float64 division and square root are long software sequences. A config fails on any spill, a C7511/C7515 warning (wgmma serialised),
shared memory over the sm_90 limit (232,448 B) or an ``expect_*`` of its spec that is not met.

Each kernel module compiles in its own subprocesses (a crash in the compiler is that module's
failure, not the run's) with a fresh ``TRITON_CACHE_DIR`` (a cached kernel prints no ptxas log).
The check compiles with the Triton of the GPU image (3.6): the environment's own when it is 3.6,
else a side install given by ``TREADLE_AOT_TRITON`` or found at ``<venv>/aot-triton`` (``make setup``
puts triton 3.6.0 there with ``pip install --target``), first on the compile workers' path only.

    python bench/gpu_aot.py                      # table, exit 1 on any failure
    python bench/gpu_aot.py --json aot.json      # also the rows as JSON
    python bench/gpu_aot.py --modules grpo,topk_entropy --jobs 2
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 232_448  # bytes of shared memory one block may use on sm_90 (227 KB)
FATAL_WARNINGS = ("C7511", "C7515")  # ptxas: wgmma serialised (registers / non-wgmma accumulator defs)
TRITON_VERSION = "3.6"  # the GPU image's Triton: what the GPU compiles is what this check compiles
HELPER_MODULES = {"aot", "common"}  # modules of triton_kernels that hold no launchable kernel
KEYS = ("kernel", "config", "registers", "spill_bytes", "shared_bytes", "wgmma", "tma", "warp_specialized",
        "warnings")


def _import_path() -> None:
    """Make ``treadle`` importable from a source checkout (``python/``) as well as installed."""
    try:
        import treadle  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))


def kernel_modules() -> list[str]:
    """Every module of ``treadle.triton_kernels`` that may hold kernels (helpers left out)."""
    _import_path()
    import treadle.triton_kernels as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in HELPER_MODULES)


def _specs(module: str):
    mod = importlib.import_module(f"treadle.triton_kernels.{module}")
    fn = getattr(mod, "aot_specs", None)
    return None if fn is None else list(fn())


# ------------------------------------------------------------------ parsing (no triton needed)
def parse_ptxas(log: str) -> dict:
    """Registers, spill and stack bytes and warning codes from a ``ptxas -v`` log of one kernel."""
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    st = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    ld = [int(x) for x in re.findall(r"(\d+) bytes spill loads", log)]
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    # ptxas prints its advisories at any level, e.g. "ptxas info    : (C7511) ... wgmma ... serialized"
    codes = sorted(set(re.findall(r"ptxas\s+\w+\s*:\s*\((C\d+)\)", log)))
    # any advisory that says wgmma is serialised (C7511, C7515 and kin such as C7512) fails the check
    serial = sorted(set(re.findall(r"ptxas\s+\w+\s*:\s*\((C\d+)\)[^\n]*wgmma[^\n]*serialized", log)))
    return {"registers": max(regs) if regs else None, "spill_store_bytes": sum(st), "spill_load_bytes": sum(ld),
            "spill_bytes": sum(st) + sum(ld), "stack_bytes": max(stack) if stack else 0, "warnings": codes,
            "wgmma_serialized": serial}


_SASS_OP = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
_F64_OPS = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "MUFU.RCP64H", "MUFU.RSQ64H")


def sass_counts(sass: str) -> dict:
    """Static instruction count of a kernel's SASS (``nvdisasm`` text) and how many are float64."""
    ops = [m.group(1) for m in map(_SASS_OP.match, sass.splitlines()) if m]
    return {"sass_instructions": len(ops), "sass_f64": sum(o.startswith(_F64_OPS) for o in ops)}


def _disassemble(cubin: bytes) -> dict:
    """:func:`sass_counts` of a cubin, through the Triton wheel's ``nvdisasm`` (empty if it has none)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists() or not cubin:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([str(tool), "-hex", f.name], capture_output=True, text=True, timeout=120)
    return sass_counts(proc.stdout) if proc.returncode == 0 else {}


def structure(ptx: str, ttgir: str) -> dict:
    """What the PTX and TTGIR show about the kernel's use of Hopper features."""
    return {"wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "warp_specialized": "ttg.warp_specialize" in ttgir, "cp_async": "cp.async.cg" in ptx or
            "cp.async.ca" in ptx, "setmaxnreg": "setmaxnreg" in ptx}


def failures(row: dict, expect: dict) -> list[str]:
    """Why a compiled config fails the check (empty: it passes)."""
    why = []
    if row.get("error"):
        return [f"compile error: {row['error']}"]
    if row["registers"] is None:
        why.append("no ptxas log (was the kernel taken from a cache?)")
    if row["spill_bytes"]:
        why.append(f"spills {row['spill_store_bytes']} B stored / {row['spill_load_bytes']} B loaded")
    bad = sorted({c for c in row["warnings"] if c in FATAL_WARNINGS} | set(row.get("wgmma_serialized") or []))
    if bad:
        why.append(f"ptxas {', '.join(bad)}: wgmma serialised")
    if row["shared_bytes"] > SMEM_LIMIT:
        why.append(f"shared memory {row['shared_bytes']} B > {SMEM_LIMIT} B")
    for key in ("wgmma", "tma", "warp_specialized"):
        if expect.get(key) and not row[key]:
            why.append(f"designed for {key} but does not get it")
    return why


# ------------------------------------------------------------------ compiling (worker side)
def compile_spec(spec) -> dict:
    """Compile one :class:`AotSpec` for sm_90a; the row of the report (``fail`` lists why it fails)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row = {"kernel": spec.kernel, "config": spec.config, "num_warps": spec.num_warps, "num_stages": spec.num_stages}
    expect = {"wgmma": spec.expect_wgmma, "tma": spec.expect_tma, "warp_specialized": spec.expect_warp_specialized}
    names = list(spec.fn.arg_names)
    missing = [n for n in names if n not in spec.signature]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        if missing:
            raise ValueError(f"signature lacks arguments {missing}")
        src = ASTSource(fn=spec.fn, signature=dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
        opts = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **spec.options}
        with contextlib.redirect_stdout(out):
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as exc:  # reported as this config's failure; the other configs still compile
        row.update({k_: None for k_ in KEYS[2:]}, error=f"{type(exc).__name__}: {str(exc)[:600]}")
        row["fail"] = failures(row, expect)
        return row
    row.update(parse_ptxas(out.getvalue()))
    row["shared_bytes"] = int(k.metadata.shared)
    row["global_scratch_bytes"] = int(getattr(k.metadata, "global_scratch_size", 0) or 0)
    row.update(structure(k.asm.get("ptx", ""), k.asm.get("ttgir", "")))
    row.update(_disassemble(k.asm.get("cubin", b"")))
    row["compile_s"] = round(time.perf_counter() - t0, 2)
    row["fail"] = failures(row, expect)
    return row


def _worker(module: str, indices: list[int], out_path: str) -> None:
    _import_path()
    import triton

    specs = _specs(module) or []
    rows = [dict(compile_spec(specs[i]), module=module, triton=triton.__version__) for i in indices]
    Path(out_path).write_text(json.dumps(rows))


# ------------------------------------------------------------------ driver
def _run_chunk(module: str, indices: list[int], timeout: float, side: Path | None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="treadle-aot-") as tmp:
        first = ([str(side)] if side else []) + [str(ROOT / "python")]
        env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / "cache"), TRITON_DUMP_PTXAS_LOG="1",
                   TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
                       first + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", module,
               "--indices", ",".join(map(str, indices)), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [{"module": module, "kernel": module, "config": f"specs {indices}", "error": "timed out",
                     "fail": [f"compile timed out after {timeout:.0f} s"]}]
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout)[-1500:]
            return [{"module": module, "kernel": module, "config": f"specs {indices}", "error": tail,
                     "fail": [f"worker exited {proc.returncode}: {tail.strip().splitlines()[-1] if tail.strip() else ''}"]}]
        return json.loads(out.read_text())


def check(modules: list[str] | None = None, jobs: int = 2, timeout: float = 600,
          side: Path | None = None) -> tuple[list[dict], list[str]]:
    """Compile every spec of ``modules`` (default: all kernel modules) in worker processes (``side``:
    a triton install put first on their path); returns ``(rows, notes)``."""
    _import_path()
    modules = modules or kernel_modules()
    notes, work = [], []
    for m in modules:
        try:
            specs = _specs(m)
        except Exception as exc:
            notes.append(f"{m}: import failed: {type(exc).__name__}: {exc}")
            work.append((m, None))
            continue
        if specs is None:
            notes.append(f"{m}: no aot_specs() (skipped)")
            continue
        if not specs:
            notes.append(f"{m}: aot_specs() is empty")
            continue
        # split a module's specs over the workers (each worker pays one import of torch and triton)
        parts = max(1, min(jobs, len(specs)))
        for p in range(parts):
            work.append((m, list(range(p, len(specs), parts))))
    rows: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = []
        for m, idx in work:
            if idx is None:
                rows.append({"module": m, "kernel": m, "config": "-", "error": "import failed",
                             "fail": ["module does not import"]})
                continue
            futs.append(pool.submit(_run_chunk, m, idx, timeout, side))
        for f in futs:
            rows.extend(f.result())
    for r in rows:
        for k in KEYS:
            r.setdefault(k, None)
    rows.sort(key=lambda r: (r.get("module", ""), r["kernel"], r["config"]))
    return rows, notes


def table(rows: list[dict]) -> str:
    head = "| kernel | config | regs | spills B | smem B | SASS (f64) | wgmma | tma | ws | warnings | result |"
    lines = [head, "|" + "---|" * 11]
    yn = {True: "yes", False: "-", None: "?"}
    for r in rows:
        res = "ok" if not r["fail"] else "FAIL: " + "; ".join(r["fail"])
        lines.append(f"| {r['kernel']} | {r['config']} | {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} | "
                     f"{r.get('sass_instructions', '?')} ({r.get('sass_f64', '?')}) | {yn[r['wgmma']]} | {yn[r['tma']]} | {yn[r['warp_specialized']]} | "
                     f"{','.join(r['warnings'] or []) or '-'} | {res[:300]} |")
    return "\n".join(lines)


def side_triton() -> Path | None:
    """A directory holding the GPU image's triton (``pip install --target DIR triton==3.6.0``), or None."""
    cands = [os.environ.get("TREADLE_AOT_TRITON"), str(Path(sys.prefix) / "aot-triton")]
    for c in cands:
        if c and list(Path(c).glob(f"triton-{TRITON_VERSION}.*.dist-info")) and (Path(c) / "triton").is_dir():
            return Path(c)
    return None


def compile_path() -> tuple[Path | None, str | None]:
    """(side install to put first on the workers' path or None, a problem that stops the check or None)."""
    import triton

    if triton.__version__.startswith(TRITON_VERSION + "."):
        return None, None
    side = side_triton()
    if side is not None:
        return side, None
    return None, (f"triton {triton.__version__} is installed and no triton {TRITON_VERSION}.x side install was "
                  f"found; this check compiles with the GPU image's triton: `pip install --no-deps --target "
                  f"{Path(sys.prefix) / 'aot-triton'} triton=={TRITON_VERSION}.0` (make setup does it), set "
                  f"TREADLE_AOT_TRITON to such a folder, or pass --any-triton")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows (list of objects) to this file")
    ap.add_argument("--modules", help="comma-separated kernel modules (default: all)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compile processes")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per worker process")
    ap.add_argument("--any-triton", action="store_true", help="run under a Triton other than the GPU image's")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--indices", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a.worker, [int(i) for i in a.indices.split(",") if i], a.out)
        return 0
    _import_path()
    side, problem = compile_path()
    if problem and not a.any_triton:
        print(f"gpu_aot: {problem}", file=sys.stderr)
        return 2
    mods = a.modules.split(",") if a.modules else None
    t0 = time.time()
    rows, notes = check(mods, jobs=a.jobs, timeout=a.timeout, side=side)
    print(table(rows))
    for n in notes:
        print(f"note: {n}")
    bad = [r for r in rows if r["fail"]]
    print(f"{len(rows)} configs compiled for sm_90a in {time.time() - t0:.0f} s; {len(bad)} failing")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
