"""The sm_90a structure check (bench/gpu_aot.py): every kernel module's ``aot_specs()`` compiles for
an H200 on this CPU with no spill, no wgmma-serialising ptxas warning, shared memory within the
limit and the Hopper features its design expects; the JSON report has the documented keys; the
parsers read ptxas logs and reject what they must."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("treadle_bench_gpu_aot", ROOT / "bench" / "gpu_aot.py")
aot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aot)

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_stair_fwd_kernel' for 'sm_90a'
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the wgmma pipeline in the function '_stair_fwd_kernel'
ptxas info    : Function properties for _stair_fwd_kernel
    252 bytes stack frame, 252 bytes spill stores, 228 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 252 bytes cumulative stack size
"""


def test_ptxas_log_is_read():
    p = aot.parse_ptxas(LOG)
    assert p["registers"] == 255 and p["spill_store_bytes"] == 252 and p["spill_load_bytes"] == 228
    assert p["spill_bytes"] == 480 and p["stack_bytes"] == 252 and p["warnings"] == ["C7511"]
    assert p["wgmma_serialized"] == ["C7511"]
    clean = aot.parse_ptxas("ptxas info    : Used 40 registers, used 0 barriers\n    0 bytes stack frame, "
                            "0 bytes spill stores, 0 bytes spill loads\n")
    assert clean["registers"] == 40 and clean["spill_bytes"] == 0 and clean["warnings"] == []
    assert aot.parse_ptxas("ptxas warning : (C7515) Potential Performance Loss: wgmma.mma_async ...")["warnings"] == ["C7515"]


def test_structure_markers():
    s = aot.structure("wgmma.mma_async.sync.aligned cp.async.bulk.tensor.2d", "ttg.warp_specialize(")
    assert s["wgmma"] and s["tma"] and s["warp_specialized"]
    assert not any(aot.structure("ld.global.v4.f32", "tt.load")[k] for k in ("wgmma", "tma", "warp_specialized"))


def test_sass_counts_instructions_and_float64():
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 DFMA R2, R4, R6, R2 ;                    /* 0x000000060402722b */
        /*0020*/                   MUFU.RCP64H R9, R5 ;                     /* 0x0000000500097308 */
        /*0030*/                   FADD R3, R3, R4 ;                        /* 0x0000000403037221 */
                                                                             /* 0x000fe20000000000 */
        .L_x_1:
"""
    assert aot.sass_counts(sass) == {"sass_instructions": 4, "sass_f64": 2}


def _row(**kw):
    row = dict(registers=128, spill_bytes=0, spill_store_bytes=0, spill_load_bytes=0, shared_bytes=1024,
               wgmma=False, tma=False, warp_specialized=False, warnings=[])
    row.update(kw)
    return row


def test_every_kind_of_failure_is_caught():
    assert aot.failures(_row(), {}) == []
    assert aot.failures(_row(spill_bytes=8, spill_store_bytes=4, spill_load_bytes=4), {})
    assert aot.failures(_row(warnings=["C7515"]), {})
    assert aot.failures(_row(warnings=["C7511", "C7520"]), {})
    assert aot.failures(_row(warnings=["C7512"], wgmma_serialized=["C7512"]), {})  # any "wgmma serialized" code
    assert aot.failures(_row(warnings=["C7520"]), {}) == []  # other advisories are reported, not fatal
    assert aot.failures(_row(shared_bytes=aot.SMEM_LIMIT + 1), {})
    assert aot.failures(_row(shared_bytes=aot.SMEM_LIMIT), {}) == []
    for key in ("wgmma", "tma", "warp_specialized"):
        assert aot.failures(_row(), {key: True}), key
        assert aot.failures(_row(**{key: True}), {key: True}) == []
    assert aot.failures(_row(registers=None), {})  # no ptxas log: nothing was checked
    assert aot.failures(dict(_row(), error="CompilationError: x"), {})


def test_every_kernel_module_compiles_clean_for_sm90(tmp_path):
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_aot.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert rows and all(set(aot.KEYS) <= set(r) for r in rows)
    assert all(r["spill_bytes"] == 0 and r["shared_bytes"] <= aot.SMEM_LIMIT for r in rows)
    assert all(not set(r["warnings"]) & set(aot.FATAL_WARNINGS) for r in rows)
    assert all(r["triton"].startswith(aot.TRITON_VERSION + ".") for r in rows)
    # every module that declares specs is in the report (the others are listed as skipped)
    with_specs = {m for m in aot.kernel_modules() if aot._specs(m) is not None}
    assert {r["module"] for r in rows} == with_specs
    assert "grpo" in with_specs and {"grpo", "scale", "stair"} <= set(aot.kernel_modules())
