"""WEFT RL: the shared-prefill sampler vs plain ``generate``, and a WEFT RL step on TRL under its options.

    treadle bench --ops weft_rl        (or: pytest bench/bench_weft_rl.py --benchmark-enable)

An atomic-turn group's G candidates share one context (a few hundred tokens of history) and differ only in
their turn (tens of tokens):

* ``sampling call``: :class:`~treadle.weft.rl.sampling.HFSampler` (``treadle weft groups``, the held-out
  evaluation) prefills each distinct context once and gathers its K/V to the rows that share it
  (``treadle_shared_prefill``) vs plain ``model.generate`` over the left-padded batch, which prefills every row
  (``per_row_prefill``). Both draw identical tokens (tests/weft/rl/test_shared_prefix.py).
* ``WEFT RL step``: one atomic-turn GRPO step of ``treadle weft train`` on ``trl.GRPOTrainer``
  (:class:`~treadle.weft.rl.trl_trainer.WeftGRPOTrainer`, TRL's transformers generation and tool loop) on the
  cached tiny tool policy (trained first when missing), 8 turn groups x G = 4 of the same train episodes, one
  update iteration, 2 steps, mean per step, under each of :data:`VARIANTS`. Shares per step: generation
  (``_generate_single_turn``), environment (the environment's ``reset`` / tool calls / ``get_reward``) and
  update plus the rest (log-probabilities, loss, optimizer, TRL's bookkeeping). Run alone:
  ``python bench/bench_weft_rl.py engine``.

Shapes of the sampling case: the tiny tool policy's architecture (``ToolTrainConfig``: Qwen3, hidden 192, 4
layers), untrained weights (speed does not depend on them; nothing is downloaded or trained), 8 groups x G =
8, contexts of 300-500 tokens, 64 new tokens per sampling row.
Reported: median wall time and process CPU time (all threads) per implementation, ratio = plain / shared.
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


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def test_shared_prefix(benchmark, peer_table):
    """treadle's shared-prefill sampler and plain ``generate``, interleaved round by round; medians of wall time
    and process CPU time."""
    case = "sampling call"
    model, tok = _policy()
    runs = _sampling_runs(model, tok)
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


VARIANTS = {
    "trl": {},
    "trl, micro-batches of 8 rows": {"micro_rows": 8},
    "trl, zero-advantage rows skipped": {"skip_zero_advantage": True},
    "trl, both": {"micro_rows": 8, "skip_zero_advantage": True},
}
"""The TRL settings timed by :func:`engine_step` (``micro_rows``: ``per_device_train_batch_size`` with
``gradient_accumulation_steps`` = rows / it, the same generation batch and optimizer steps;
``skip_zero_advantage``: :class:`~treadle.weft.rl.trl_trainer.WeftGRPOTrainer`'s option)."""


def engine_step(steps: int = 2, groups: int = 8, g: int = 4, variants=None) -> dict:
    """Per-step seconds and shares (generation, environment, update and the rest) of an atomic-turn WEFT RL step
    on ``trl.GRPOTrainer`` under each of ``variants`` (default :data:`VARIANTS`), one after the other in this
    process on copies of one policy and the same rows."""
    import copy
    import functools
    import tempfile

    from treadle.weft.rl.config import WeftTrainConfig
    from treadle.weft.rl.sft import ToolTrainConfig, load_tool_model, tool_slot
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_run import grpo_config
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer

    torch.set_num_threads(1)
    model, tok = load_tool_model(None, config=ToolTrainConfig(), name=tool_slot(None, False).name)  # cached
    cfg = WeftTrainConfig.quick(steps=steps, turns_per_step=groups, G=g, num_iterations=1, max_new_tokens=40,
                                max_steps=4, eval_episodes=1, eval_samples=2)
    data = weft_turn_dataset(max(1, steps * groups // 2), "train", start=500_000 + cfg.seed * 10_000)
    out = {}
    for name, opts in (variants or VARIANTS).items():
        timers = {"generation_s": 0.0, "environment_s": 0.0}

        def timed(fn, key):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timers[key] += time.perf_counter() - t
            return wrapper

        rows = groups * g
        micro = opts.get("micro_rows", rows)
        with tempfile.TemporaryDirectory() as tmp:
            env = weft_environment()
            args = grpo_config(cfg, tmp, save_strategy="no", per_device_train_batch_size=micro,
                               gradient_accumulation_steps=rows // micro)
            trainer = WeftGRPOTrainer(model=copy.deepcopy(model), args=args, processing_class=copy.deepcopy(tok),
                                      train_dataset=data, environment_factory=env,
                                      skip_zero_advantage=opts.get("skip_zero_advantage", False))
            trainer._generate_single_turn = timed(trainer._generate_single_turn, "generation_s")
            for m in ("reset", "_call", "get_reward"):
                setattr(env, m, timed(getattr(env, m), "environment_s"))
            t0 = time.perf_counter()
            trainer.train()
            total = time.perf_counter() - t0
            loss = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        v = {"step_s": total / steps, "generation_s": timers["generation_s"] / steps,
             "environment_s": timers["environment_s"] / steps,
             "update_s": (total - timers["generation_s"] - timers["environment_s"]) / steps, "loss": loss}
        v["shares"] = {k[:-2]: v[k] / v["step_s"] for k in ("generation_s", "environment_s", "update_s")}
        out[name] = v
    return out


def test_engine_step(benchmark, peer_table):
    """One atomic-turn WEFT RL step on TRL under each of :data:`VARIANTS`; seconds per step and shares."""
    if getattr(benchmark, "disabled", False):
        return  # minutes of CPU: only with --benchmark-enable (or `python bench/bench_weft_rl.py engine`)
    res = engine_step()
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    key = "WEFT RL step on TRL, 8 turn groups x G=4, tiny tool policy"
    for impl, r in res.items():
        peer_table.record(key, impl, seconds=r["step_s"],
                          shares=" ".join(f"{k} {v:.0%}" for k, v in r["shares"].items()))


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] == ["engine"]:
        print(json.dumps(engine_step(), indent=1))
