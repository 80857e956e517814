"""WEFT RL: shared prefixes vs the plain padded batch (same samples, same maths). One run, side by side.

    treadle bench --ops weft_rl        (or: pytest bench/bench_weft_rl.py --benchmark-enable)

An atomic-turn group's G candidates share one context (a few hundred tokens of history) and differ only in
their turn (tens of tokens). Two places of a WEFT RL step exploit that (``treadle.weft.rl``), and each is
timed here against the plain form it replaces, interleaved round by round:

* ``sampling call``: :class:`~treadle.weft.rl.sampling.HFSampler` prefills each distinct context once and
  gathers its K/V to the rows that share it (``treadle_shared_prefill``) vs plain ``model.generate`` over
  the left-padded batch, which prefills every row (``per_row_prefill``: the same sampler with the shared
  prefill turned off). Both draw identical tokens (tests/weft/rl/test_shared_prefix.py).
* ``update forward+backward``: the log-probabilities of the policy tokens and their backward, with each
  distinct prefix run once and its K/V repeated over the candidates (``treadle_shared_prefix``,
  :func:`treadle.weft.rl.train._row_logprobs`) vs one forward over the full right-padded batch
  (``full_batch``, :func:`treadle.weft.rl.train._logprobs`, what the data-parallel update runs).

Shapes: the tiny tool policy's architecture (``ToolTrainConfig``: Qwen3, hidden 192, 4 layers), untrained
weights (speed does not depend on them; nothing is downloaded or trained), 8 groups x G = 8, contexts of
300-500 tokens, 64 new tokens per sampling row, responses of 20-60 tokens in the update. Reported: median
wall time and process CPU time (all threads) per implementation, ratio = plain / shared.
"""
from __future__ import annotations

import time

import pytest
import torch

GROUPS, G = 8, 8
ROUNDS = 5


def _policy():
    from treadle.models.tiny import build_model
    from treadle.weft.rl.sft import ToolTrainConfig
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tok = build_tool_tokenizer()
    torch.manual_seed(0)
    model = build_model(ToolTrainConfig(), tok).eval()
    return model, tok


def _contexts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (int(torch.randint(300, 500, (), generator=g)),), generator=g).tolist()
            for _ in range(GROUPS)]


class _PerRowSampler:
    """The sampler with its shared prefill turned off: plain ``model.generate`` over the padded batch."""

    def __new__(cls, model, tok):
        from treadle.weft.rl.sampling import HFSampler

        s = HFSampler(model, tok, temperature=1.0, max_new_tokens=64)
        s._shared_prefill = lambda rows, ids, mask: {}
        return s


def _sampling_runs(model, tok):
    from treadle.weft.rl.sampling import HFSampler

    rows = [(None, 0, c) for c in _contexts(len(tok)) for _ in range(G)]
    shared = HFSampler(model, tok, temperature=1.0, max_new_tokens=64)
    plain = _PerRowSampler(model, tok)
    return {"treadle_shared_prefill": lambda: shared.generate(rows, 3),
            "per_row_prefill": lambda: plain.generate(rows, 3)}


def _update_runs(model, tok):
    from treadle.weft.rl.train import _logprobs, _row_logprobs, _rows_batch

    g = torch.Generator().manual_seed(2)
    rows = []
    for c in _contexts(len(tok)):
        for _ in range(G):
            n = int(torch.randint(20, 60, (), generator=g))
            resp = torch.randint(5, len(tok), (n,), generator=g).tolist()
            rows.append((c, resp, [1] * n, 1.0))
    ids, mask, _ = _rows_batch(rows, tok.pad_token_id)
    model.train()

    def shared():
        model.zero_grad(set_to_none=True)
        (_row_logprobs(model, rows, ids.shape[1]) * mask).sum().backward()

    def full():
        model.zero_grad(set_to_none=True)
        (_logprobs(model, ids) * mask).sum().backward()

    return {"treadle_shared_prefix": shared, "full_batch": full}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


CASES = ["sampling call", "update forward+backward"]


@pytest.mark.parametrize("case", CASES, ids=["sampling", "update"])
def test_shared_prefix(benchmark, peer_table, case):
    """treadle's shared-prefix form and the plain form of one case, interleaved round by round; medians of
    wall time and process CPU time."""
    model, tok = _policy()
    runs = (_sampling_runs if case == "sampling call" else _update_runs)(model, tok)
    if getattr(benchmark, "disabled", False):
        for run in runs.values():  # smoke run only
            run()
        return
    for run in runs.values():
        run()
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(ROUNDS):
        for impl, run in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            wall[impl].append(time.perf_counter() - t0)
            cpu[impl].append(time.process_time() - c0)
    ours = next(k for k in runs if k.startswith("treadle"))
    benchmark.pedantic(runs[ours], rounds=1, iterations=1)
    key = f"{case}, {GROUPS} groups x G={G}, contexts 300-500 tokens"
    for impl in runs:
        peer_table.record(key, impl, seconds=_median(wall[impl]), cpu_ms=f"{_median(cpu[impl]) * 1e3:.0f}")
