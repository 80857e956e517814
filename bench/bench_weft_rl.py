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

* ``WEFT RL step``: one atomic-turn GRPO step on ``trl.GRPOTrainer`` (``treadle weft train --engine trl``:
  :class:`~treadle.weft.rl.trl_trainer.WeftGRPOTrainer`, TRL's transformers generation and tool loop) vs the same
  step in treadle's own loop (``--engine loop``: :func:`~treadle.weft.rl.train.train_policy`), on the same
  tiny tool policy (the cached SFT policy; trained first when missing) and the same batch (8 turn groups x
  G = 4 of the same train episodes, one update iteration, 2 steps each, mean per step). Shares per step:
  generation (TRL: ``_generate_single_turn``; loop: the sampler), environment (TRL: the environment's
  ``reset`` / tool calls / ``get_reward``; loop: forks, tool calls, verification) and update plus the rest
  (TRL: log-probabilities, loss, optimizer, its bookkeeping; loop: advantages and update). Run alone:
  ``python bench/bench_weft_rl.py engine``.

Shapes of the first two: the tiny tool policy's architecture (``ToolTrainConfig``: Qwen3, hidden 192, 4
layers), untrained weights (speed does not depend on them; nothing is downloaded or trained), 8 groups x G =
8, contexts of 300-500 tokens, 64 new tokens per sampling row, responses of 20-60 tokens in the update.
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


def engine_step(steps: int = 2, groups: int = 8, g: int = 4) -> dict:
    """Per-step seconds and shares of a WEFT RL step on the TRL path and in treadle's loop (module docstring),
    run one after the other in this process on copies of one policy."""
    import copy
    import functools
    import tempfile

    import anyio

    from treadle.weft.rl.sft import ToolTrainConfig, load_tool_model, tool_slot
    from treadle.weft.rl.train import WeftTrainConfig, train_policy
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer
    from treadle.weft.rl.trl_run import grpo_config

    torch.set_num_threads(1)
    model, tok = load_tool_model(None, config=ToolTrainConfig(), name=tool_slot(None, False).name)  # cached
    cfg = WeftTrainConfig.quick(steps=steps, turns_per_step=groups, G=g, num_iterations=1, max_new_tokens=40,
                                max_steps=4, eval_episodes=1, eval_samples=2)
    out = {}
    summary = anyio.run(functools.partial(train_policy, copy.deepcopy(model), tok, cfg, progress=False))
    recs = summary["records"]
    n = len(recs)
    out["loop"] = {"step_s": sum(r["t_step_s"] for r in recs) / n,
                   "generation_s": sum(r["t_model_s"] for r in recs) / n,
                   "environment_s": sum(r["t_env_s"] for r in recs) / n,
                   "update_s": sum(r["t_update_s"] + r["t_advantage_s"] for r in recs) / n}
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

    with tempfile.TemporaryDirectory() as tmp:
        env = weft_environment()
        data = weft_turn_dataset(max(1, steps * groups // 2), "train", start=500_000 + cfg.seed * 10_000)
        trainer = WeftGRPOTrainer(model=copy.deepcopy(model), args=grpo_config(cfg, tmp, save_strategy="no"),
                                  processing_class=copy.deepcopy(tok), train_dataset=data, environment_factory=env)
        trainer._generate_single_turn = timed(trainer._generate_single_turn, "generation_s")
        for name in ("reset", "_call", "get_reward"):
            setattr(env, name, timed(getattr(env, name), "environment_s"))
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
    out["trl"] = {"step_s": total / steps, "generation_s": timers["generation_s"] / steps,
                  "environment_s": timers["environment_s"] / steps,
                  "update_s": (total - timers["generation_s"] - timers["environment_s"]) / steps}
    for v in out.values():
        v["shares"] = {k[:-2]: v[k] / v["step_s"] for k in ("generation_s", "environment_s", "update_s")}
    out["ratio_loop_over_trl"] = out["loop"]["step_s"] / out["trl"]["step_s"]
    return out


def test_engine_step(benchmark, peer_table):
    """The TRL path and treadle's loop, one WEFT RL step each (module docstring); seconds per step and shares."""
    if getattr(benchmark, "disabled", False):
        return  # minutes of CPU: only with --benchmark-enable (or `python bench/bench_weft_rl.py engine`)
    res = engine_step()
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    key = f"WEFT RL step, 8 turn groups x G=4, tiny tool policy (loop / trl = {res['ratio_loop_over_trl']:.2f})"
    for impl in ("trl", "loop"):
        r = res[impl]
        peer_table.record(key, impl, seconds=r["step_s"],
                          shares=" ".join(f"{k} {v:.0%}" for k, v in r["shares"].items()))


if __name__ == "__main__":
    import json
    import sys

    if sys.argv[1:] == ["engine"]:
        print(json.dumps(engine_step(), indent=1))
