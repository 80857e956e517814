"""SCALE: treadle's gated LoRA vs the base linear alone and vs PEFT LoRA + a separate gate; top-k
entropy peak memory, chunked from hidden states vs full logits. One run, side by side.

    treadle bench --ops scale           (or: pytest bench/bench_scale.py --benchmark-enable)

Gated LoRA cases: d_in = d_out = 2048 and 4096, r = 16, 4,096 tokens, fp32 on CPU (bf16 on
CUDA with TREADLE_BENCH_DEVICE=cuda), forward and forward+backward (dx and the gate's grads; W, A, B
frozen). Implementations:

* ``base_linear``: the frozen base layer alone (``F.linear``), the floor.
* ``treadle_gated_lora``: the base layer + ``treadle.ops.gated_lora`` (shrink with A and w stacked,
  per-token lambda, expand added into the base output).
* ``treadle_gated_lora_linear``: ``treadle.ops.gated_lora_linear``, the base GEMM fused in (expand and
  the LoRA part of dx added in place into the base GEMM's outputs); what ``treadle.scale`` uses.
* ``triton_base_gemm`` (CUDA, forward only): ``treadle.ops.gated_lora.triton_base_linear``, the
  persistent Triton GEMM that ``gated_lora_linear`` fuses the LoRA into, with the LoRA off: its gap
  to ``base_linear`` (cuBLAS) is what the fused op pays before the LoRA.
* ``peft_lora+gate``: what a user writes without treadle: PEFT's LoRA Linear pieces
  (``base_layer(x)``, ``lora_B(lora_A(dropout(x))) * scaling``) and an ``nn.Linear(d_in, 1)`` gate on
  ``x.detach()``, combined as ``base + lambda * delta``.

The three run interleaved, round by round, so load from other processes hits them alike. Reported
per case: median wall time, on CPU also median process CPU time (all threads; steadier on a shared
machine), ``added`` = (impl - base) / base, and for the PEFT composition ``added_ratio`` = its added
time / treadle's added time (targets on CPU: treadle's forward added <= 15%, and
added_ratio >= 2 for forward and forward+backward).

Top-k entropy memory (vocab 151,936, k = 100, forward+backward, fp32, hidden size 64: the logits'
memory does not depend on it, and it keeps the GEMMs short on 2 cores): each variant runs in a fresh
process and reports its peak RSS above the RSS after setup. The chunked form runs at 8,192 positions;
full logits run at 1,024 and 2,048 positions and are extrapolated linearly to 8,192 (at 8,192 they need
~5 GB per (N, V) fp32 buffer, too much for a shared 24 GB machine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from treadle.ops import gated_lora, gated_lora_linear

DEVICE = os.environ.get("TREADLE_BENCH_DEVICE", "cpu")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOKENS, RANK = 4096, 16
GATE = dict(L=-2.0, U=3.0, tau=1.0)
# treadle's backend for its ops (None: as dispatched; bench/guard.py pins "cpp", so that an inherited
# TRITON_INTERPRET=1, which makes the dispatcher pick the Triton interpreter on CPU, is never timed)
OPS_BACKEND: str | None = None
IMPLS = ["base_linear", "treadle_gated_lora", "treadle_gated_lora_linear", "peft_lora+gate"]
ROUNDS_CPU = int(os.environ.get("TREADLE_BENCH_ROUNDS", "7"))


def _layer(d: int):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(d, d, bias=False))
    cfg = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["0"], lora_dropout=0.0, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg).to(device=DEVICE, dtype=DTYPE)
    for p in pm.parameters():
        p.requires_grad_(False)
    return pm.base_model.model[0]


def _make(impl: str, d: int, backward: bool):
    layer = _layer(d)
    x = torch.randn(TOKENS, d, device=DEVICE, dtype=DTYPE, requires_grad=backward)
    dy = torch.randn(TOKENS, d, device=DEVICE, dtype=DTYPE)
    A = layer.lora_A["default"].weight
    B = layer.lora_B["default"].weight
    scaling = layer.scaling["default"]
    w = (0.01 * torch.randn(d, device=DEVICE)).requires_grad_(backward)
    b = torch.zeros(1, device=DEVICE, requires_grad=backward)
    gate = torch.nn.Linear(d, 1).to(device=DEVICE)
    with torch.no_grad():
        gate.weight.copy_(w.view(1, d))
        gate.bias.zero_()
    gate.requires_grad_(backward)
    L, U, tau = GATE["L"], GATE["U"], GATE["tau"]

    if impl == "base_linear":
        def fwd():
            return layer.base_layer(x)
    elif impl == "triton_base_gemm":
        from treadle.ops.gated_lora import triton_base_linear

        weight = layer.base_layer.weight

        def fwd():
            return triton_base_linear(x.detach(), weight, layer.base_layer.bias)
    elif impl == "treadle_gated_lora":
        def fwd():
            return gated_lora(x, layer.base_layer(x), A, B, w, b, scaling=scaling, backend=OPS_BACKEND, **GATE)
    elif impl == "treadle_gated_lora_linear":
        base = layer.base_layer

        def fwd():
            return gated_lora_linear(x, base.weight, base.bias, A, B, w, b, scaling=scaling, backend=OPS_BACKEND,
                                     **GATE)
    else:
        def fwd():
            base = layer.base_layer(x)
            delta = layer.lora_B["default"](layer.lora_A["default"](layer.lora_dropout["default"](x))) * scaling
            v = torch.tanh(gate(x.detach().float()) / tau)
            lam = 1 + (1 - L) * v.clamp(max=0) + (U - 1) * v.clamp(min=0)
            return base + lam.to(base.dtype) * delta

    if not backward:
        def run():
            with torch.no_grad():
                return fwd()
        return run

    def run():
        fwd().backward(dy)
        x.grad = None
        w.grad = b.grad = gate.weight.grad = gate.bias.grad = None
    return run


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


CASES = [(d, mode) for d in (2048, 4096) for mode in ("fwd", "fwd+bwd")]


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


@pytest.mark.parametrize("case", CASES, ids=[f"{DEVICE}-d{d}-{m}" for d, m in CASES])
def test_gated_lora(benchmark, peer_table, case):
    """The three implementations of one case, interleaved round by round (so that load from other
    processes hits them alike); medians of wall time and, on CPU, of process CPU time (all threads)."""
    d, mode = case
    impls = IMPLS + (["triton_base_gemm"] if DEVICE == "cuda" and mode == "fwd" else [])
    runs = {impl: _make(impl, d, mode == "fwd+bwd") for impl in impls}
    if getattr(benchmark, "disabled", False):
        for run in runs.values():  # smoke run only
            run()
        return
    rounds = ROUNDS_CPU if DEVICE == "cpu" else 30
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for run in runs.values():
        run()
        _sync()
    for _ in range(rounds):
        for impl, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            _sync()
            wall[impl].append(time.perf_counter() - t0)
            cpu[impl].append(time.process_time() - c0)
    # pytest-benchmark's own record (for --benchmark-save / --benchmark-compare) of treadle's op
    benchmark.pedantic(lambda: (runs["treadle_gated_lora"](), _sync()), rounds=1, iterations=1)
    key = f"{DEVICE} {str(DTYPE).removeprefix('torch.')} d={d} N={TOKENS} r={RANK} {mode}"
    wm = {k: _median(v) for k, v in wall.items()}
    cm = {k: _median(v) for k, v in cpu.items()}
    for impl in impls:
        extra = {}
        if DEVICE == "cpu":
            extra["cpu_ms"] = f"{cm[impl] * 1e3:.1f}"
        if impl != "base_linear":
            extra["added_wall"] = f"{100 * (wm[impl] - wm['base_linear']) / wm['base_linear']:+.1f}%"
            if DEVICE == "cpu":
                extra["added_cpu"] = f"{100 * (cm[impl] - cm['base_linear']) / cm['base_linear']:+.1f}%"
        if impl == "peft_lora+gate":
            for name, m in [("wall", wm)] + ([("cpu", cm)] if DEVICE == "cpu" else []):
                for ours_name, tag in (("treadle_gated_lora", ""), ("treadle_gated_lora_linear", "_vs_linear")):
                    ours = m[ours_name] - m["base_linear"]
                    if ours > 0:
                        extra[f"added_ratio{tag}_{name}"] = f"{(m[impl] - m['base_linear']) / ours:.2f}x"
        peer_table.record(key, impl, seconds=wm[impl], **extra)


_MEM_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time, torch
    from treadle.ops import topk_entropy, topk_entropy_from_hidden
    mode, n, vocab, d, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    torch.manual_seed(0)
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(vocab, d) / d ** 0.5
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    before = rss()
    t0 = time.perf_counter()
    if mode == "full":
        loss = topk_entropy(h @ w.t(), k=k)
    else:
        loss = topk_entropy_from_hidden(h, w, k=k)
    loss.backward()
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra_peak": peak - before, "seconds": secs, "loss": float(loss)}))
""")


def _peak(mode: str, n: int, vocab: int = 151936, d: int = 64, k: int = 100) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, mode, str(n), str(vocab), str(d), str(k)],
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(DEVICE != "cpu", reason="the memory comparison runs on CPU (peak RSS)")
def test_topk_entropy_peak_memory(benchmark, peer_table):
    if getattr(benchmark, "disabled", False):
        pytest.skip("--benchmark-disable")
    gib = 2 ** 30
    f1, f2 = _peak("full", 1024), _peak("full", 2048)
    slope = (f2["extra_peak"] - f1["extra_peak"]) / 1024
    full_8192 = f2["extra_peak"] + slope * (8192 - 2048)
    c = _peak("chunked", 8192)
    key = "topk_entropy fwd+bwd vocab=151936 k=100 fp32"
    peer_table.record(f"{key} N=1024", "full_logits", seconds=f1["seconds"],
                      peak_GiB=f"{f1['extra_peak'] / gib:.2f}")
    peer_table.record(f"{key} N=2048", "full_logits", seconds=f2["seconds"],
                      peak_GiB=f"{f2['extra_peak'] / gib:.2f}")
    peer_table.record(f"{key} N=8192", "full_logits(extrapolated)", seconds=f2["seconds"] * 4,
                      peak_GiB=f"{full_8192 / gib:.2f}")
    peer_table.record(f"{key} N=8192", "treadle_chunked", seconds=c["seconds"],
                      peak_GiB=f"{c['extra_peak'] / gib:.2f}", saving=f"{full_8192 / c['extra_peak']:.1f}x")
    benchmark.extra_info.update(full_8192_GiB=full_8192 / gib, chunked_8192_GiB=c["extra_peak"] / gib)
    benchmark.pedantic(lambda: None, rounds=1)
