"""Evaluating STAIR: Vanilla / Native / STAIR and the controls (STAIR sec. 5.4).

All conditions share the problems, the histories (the backbone's own greedy responses to turns
1..t-1, replayed teacher-forced, so every condition sees the same visible history), the sampling
seeds (Gumbel noise drawn from ``(seed, turn, step)``, identical across conditions) and the decoding
budget. For each turn t >= 2 and condition, ``k`` samples per problem give Avg@k (mean accuracy)
and Pass@k (any sample right); answers are checked with math-verify.

Conditions: ``vanilla`` (turn t alone, no history), ``native`` (history, no STAIR), ``stair``
(trained normals), and the controls with the same parameter budget: ``random`` (untrained random
normals), ``bank_free`` (a trained per-head output vector, no bank read; needs its weights),
``shuffled`` (trained normals, values permuted within each row's bank), ``reflected`` (trained
normals, direct reflected read ``sum pi_R v``); plus ``stair@N`` for each bank prefix budget N.
Answer transitions count (problem, sample) pairs that go wrong->right / right->wrong between
native and each other condition. Cost: mean prefill latency of the turn (with vs without the
read-out) and, on CUDA, peak memory.
"""
from __future__ import annotations

import json
from dataclasses import asdict, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from treadle.data.arithmetic import known_levels
from treadle.figures import png_figure

__all__ = ["EvalConfig", "evaluate", "CONDITIONS", "results_table", "bar_chart", "turn_scores", "mean_over_turns",
           "answer_transitions"]

CONDITIONS = ("vanilla", "native", "stair", "random", "bank_free", "shuffled", "reflected")


Condition = Literal["vanilla", "native", "stair", "random", "bank_free", "shuffled", "reflected"]
PosInt = Annotated[int, Field(ge=1, strict=True)]


@pydantic_dataclass(config=ConfigDict(extra="forbid"))
class EvalConfig:
    """Settings of :func:`evaluate` (a pydantic dataclass: fields checked when made, ``ValueError``).

    Attributes:
        sessions: problems per turn (sessions, >= 1); turns: turns per session (>= 2); levels: level
            per turn (cycled).
        k: samples per problem (Avg@k / Pass@k, >= 1); temperature: sampling temperature (finite, >= 0).
        max_new_tokens: decoding budget (>= 1); seed: problems (``split="heldout"``) and sampling seeds.
        conditions: which of :data:`CONDITIONS` to run; budgets: bank prefix budgets (tokens, each >= 1).
    """

    sessions: PosInt = 32
    turns: Annotated[int, Field(ge=2, strict=True)] = 4
    levels: Annotated[list[Annotated[int, Field(strict=True)]], AfterValidator(known_levels)] = field(
        default_factory=lambda: [2, 3, 2, 3])
    k: PosInt = 4
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.7
    max_new_tokens: PosInt = 10
    seed: int = 1234
    conditions: tuple[Condition, ...] = CONDITIONS
    budgets: tuple[PosInt, ...] = ()


def turn_scores(correct: torch.Tensor) -> dict[str, float]:
    """Avg@k and Pass@k of one turn (STAIR sec. 5.4).

    Args:
        correct: ``(n_problems, k)`` bool, sample j of problem i right or not.

    Returns:
        ``{"avg": mean over problems and samples, "pass": share of problems with at least one right
        sample}``, both in [0, 1].

    Raises:
        ValueError: ``correct`` is not a non-empty 2-D bool tensor.
    """
    if not isinstance(correct, torch.Tensor) or correct.dtype != torch.bool or correct.dim() != 2 \
            or correct.numel() == 0:
        raise ValueError(f"correct must be a non-empty (n_problems, k) bool tensor, got "
                         f"{getattr(correct, 'dtype', type(correct).__name__)} {tuple(getattr(correct, 'shape', ()))}")
    # exact counts over Python ints (a float32 mean would round, e.g. 3/5 -> 0.6000000238)
    return {"avg": int(correct.sum()) / correct.numel(), "pass": int(correct.any(1).sum()) / correct.shape[0]}


def mean_over_turns(turns: dict[int, dict]) -> dict[str, float]:
    """Unweighted mean of the per-turn ``"avg"`` and ``"pass"`` (turns 2..n, each turn counts once).

    Raises:
        ValueError: no turn.
    """
    if not turns:
        raise ValueError("no turn to average")
    return {"avg": sum(x["avg"] for x in turns.values()) / len(turns),
            "pass": sum(x["pass"] for x in turns.values()) / len(turns)}


def answer_transitions(before: dict[int, torch.Tensor], after: dict[int, torch.Tensor], *,
                       before_name: str = "native") -> dict:
    """Count (problem, sample) pairs whose answer goes wrong -> right and right -> wrong from the
    ``before`` condition to ``after``, over the turns of ``after`` (same problems and sampling seeds).

    Args:
        before, after: turn -> ``(n_problems, k)`` bool correctness; ``before`` has every turn of ``after``.

    Returns:
        ``{"from": before_name, "wrong_to_right", "right_to_wrong", "pairs"}`` (ints; pairs = all
        compared (problem, sample) pairs).

    Raises:
        ValueError: a turn of ``after`` missing from ``before``, or shapes that differ.
    """
    w2r = r2w = pairs = 0
    for t, a in after.items():
        if t not in before or before[t].shape != a.shape:
            raise ValueError(f"turn {t}: {before_name} has {tuple(before[t].shape) if t in before else 'no such turn'}, "
                             f"expected shape {tuple(a.shape)}")
        b = before[t]
        w2r += int((~b & a).sum())
        r2w += int((b & ~a).sum())
        pairs += a.numel()
    return {"from": before_name, "wrong_to_right": w2r, "right_to_wrong": r2w, "pairs": pairs}


def _correct(texts, golds) -> list[bool]:
    from treadle.data.verify import is_correct

    return [is_correct(t, g) for t, g in zip(texts, golds)]


def _run_condition(model, tok, ctrl, sessions, history, cfg: EvalConfig, *, stair: bool, with_history: bool,
                   budget=None) -> dict:
    """Per turn t>=2: correctness (n_sessions, k) and mean prefill seconds."""
    from treadle.stair.session import StairSession

    n, k = len(sessions), cfg.k
    out = {}
    base = StairSession(model, tok, ctrl, batch_size=n, stair=stair, bank_budget=budget)
    cuda = next(model.parameters()).device.type == "cuda"
    for t in range(cfg.turns):
        users = [s.problems[t].prompt for s in sessions]
        if t >= 1:
            if with_history:
                branch = base.repeat(k)
            else:
                branch = StairSession(model, tok, ctrl, batch_size=n * k, stair=stair, bank_budget=budget)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            res = branch.generate([u for u in users for _ in range(k)], max_new_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, seed=cfg.seed * 1009 + t)
            golds = [s.problems[t].answer for s in sessions for _ in range(k)]
            ok = torch.tensor(_correct(res.texts, golds)).view(n, k)
            out[t + 1] = {"correct": ok, "prefill_s": res.prefill_seconds,
                          "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                          "bank_tokens": sum(branch.bank_tokens) / max(1, len(branch.bank_tokens))}
            del branch
        if with_history and t < cfg.turns - 1:
            base.forward(users, [h[t] for h in history])
    return out


def evaluate(model, tokenizer, cfg: EvalConfig, *, normals=None, bank_free=None, layers=None, eps: float = 0.0,
             backend: str | None = None, progress: bool = True, console=None) -> dict:
    """Run every condition of ``cfg`` and return the results.

    Args:
        model, tokenizer: the backbone.
        normals: path of trained STAIR normals (``StairController.save``); needed by stair /
            shuffled / reflected / budgets (those conditions are skipped without it).
        bank_free: path of trained bank-free control weights (the condition is skipped without it).
        layers: controlled layers (default: those recorded in the normals file).
        eps: pi_ref mixing (default: the normals file's).

    Returns:
        {"config", "conditions": {name: {"turns": {t: {"avg", "pass", "prefill_s", "peak_bytes",
        "bank_tokens"}}, "avg", "pass"}}, "transitions": {name: {"wrong_to_right", "right_to_wrong"}},
        "cost": {...}, "skipped": [...]}.

    Raises:
        FileNotFoundError: ``normals``/``bank_free`` does not exist.
        NormalsFileError: ``normals``/``bank_free`` is not a STAIR normals file or does not fit the model.
        ValueError: no layers given or recorded; see attach().
    """
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal

    from treadle.stair.controller import attach, read_normals_config
    from treadle.stair.training import make_training_sessions, self_responses

    meta = None
    if normals is not None:
        meta = read_normals_config(normals)
        layers = tuple(meta.get("layers", ())) if layers is None else layers
        eps = float(meta.get("eps", eps))
    if bank_free is not None:
        bf_meta = read_normals_config(bank_free)
        layers = tuple(bf_meta.get("layers", ())) if layers is None else layers
    if layers is None:
        raise ValueError("give layers=, or a normals/bank_free file that records them")
    sessions = make_training_sessions(cfg.sessions, cfg.turns, cfg.levels, seed=cfg.seed, split="heldout")
    history = self_responses(model, tokenizer, sessions, max_new_tokens=cfg.max_new_tokens)
    plan, skipped = [], []
    for c in cfg.conditions:
        if c in ("stair", "shuffled", "reflected") and normals is None:
            skipped.append(c)
        elif c == "bank_free" and bank_free is None:
            skipped.append(c)
        else:
            plan.append((c, None))
    if normals is not None and "stair" in cfg.conditions:
        plan += [(f"stair@{b}", b) for b in cfg.budgets]
    results, raw = {}, {}
    bar = tqdm(plan, desc="stair-eval", disable=not progress_enabled(progress), dynamic_ncols=True)
    for name, budget in bar:
        bar.set_postfix(condition=name)
        kind = "bank_free" if name == "bank_free" else "stair"
        ctrl = attach(model, layers=layers, eps=eps, kind=kind, backend=backend, seed=cfg.seed,
                      mode="reflected" if name == "reflected" else "diff")
        try:
            if name == "bank_free":
                ctrl.load(bank_free)
            elif name not in ("vanilla", "native", "random"):
                ctrl.load(normals)
            if name == "shuffled":
                ctrl.shuffle_seed = cfg.seed
            with torch.no_grad():
                r = _run_condition(model, tokenizer, ctrl, sessions, history, cfg,
                                   stair=name not in ("vanilla", "native"), with_history=name != "vanilla",
                                   budget=budget)
        finally:
            ctrl.detach()
        raw[name] = r
        turns = {t: {**turn_scores(v["correct"]), "prefill_s": v["prefill_s"], "peak_bytes": v["peak_bytes"],
                     "bank_tokens": v["bank_tokens"]}
                 for t, v in r.items()}
        results[name] = {"turns": turns, **mean_over_turns(turns)}
    bar.close()
    transitions = {}
    if "native" in raw:
        for name, r in raw.items():
            if name == "native":
                continue
            transitions[name] = answer_transitions({t: v["correct"] for t, v in raw["native"].items()},
                                                   {t: v["correct"] for t, v in r.items()})
    cost = {}
    if "native" in results and "stair" in results:
        pn = [v["prefill_s"] for v in results["native"]["turns"].values()]
        ps = [v["prefill_s"] for v in results["stair"]["turns"].values()]
        cost = {"prefill_s_native": sum(pn) / len(pn), "prefill_s_stair": sum(ps) / len(ps),
                "extra_prefill_s": sum(ps) / len(ps) - sum(pn) / len(pn)}
        pk_n = [v["peak_bytes"] for v in results["native"]["turns"].values() if v["peak_bytes"] is not None]
        pk_s = [v["peak_bytes"] for v in results["stair"]["turns"].values() if v["peak_bytes"] is not None]
        cost["extra_peak_bytes"] = (max(pk_s) - max(pk_n)) if pk_n and pk_s else None
    return {"config": {**asdict(cfg), "conditions": list(cfg.conditions), "budgets": list(cfg.budgets),
                       "layers": list(layers), "eps": eps, "normals": str(normals) if normals else None},
            "conditions": results, "transitions": transitions, "cost": cost, "skipped": skipped}


def results_table(res: dict, k: int):
    """A rich Table: condition x (Avg@k, Pass@k per turn and mean, transitions vs native)."""
    from rich.table import Table

    t = Table(title=f"STAIR evaluation (Avg@{k} / Pass@{k}, turns 2..n; transitions vs Native)")
    t.add_column("condition")
    turns = sorted(next(iter(res["conditions"].values()))["turns"]) if res["conditions"] else []
    for tt in turns:
        t.add_column(f"T{tt} avg", justify="right")
    t.add_column(f"Avg@{k}", justify="right")
    t.add_column(f"Pass@{k}", justify="right")
    t.add_column("w>r/r>w", justify="right")
    t.add_column("prefill ms", justify="right")
    for name, r in res["conditions"].items():
        tr = res["transitions"].get(name)
        pre = sum(v["prefill_s"] for v in r["turns"].values()) / len(r["turns"]) * 1e3
        t.add_row(name, *[f"{r['turns'][tt]['avg']:.1%}" for tt in turns],
                  f"{r['avg']:.2%}", f"{r['pass']:.2%}", f"{tr['wrong_to_right']}/{tr['right_to_wrong']}" if tr else "-",
                  f"{pre:.1f}")
    return t


def bar_chart(res: dict, path, k: int) -> Path:
    """PNG bar chart of Avg@k and Pass@k per condition (mean over turns 2..n)."""

    names = list(res["conditions"])
    avg = [res["conditions"][n]["avg"] * 100 for n in names]
    pas = [res["conditions"][n]["pass"] * 100 for n in names]
    with png_figure(path, figsize=(max(6, 1.1 * len(names)), 3.6)) as (fig, ax):
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], avg, width=0.4, label=f"Avg@{k}")
        ax.bar([i + 0.2 for i in x], pas, width=0.4, label=f"Pass@{k}")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("% correct (turns 2..n)")
        ax.set_title("STAIR: Vanilla / Native / STAIR and controls")
        ax.legend()
    return Path(path)


def write_jsonl(res: dict, path) -> Path:
    """One JSON record per (condition, turn), then transitions and cost records."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name, r in res["conditions"].items():
            for t, v in r["turns"].items():
                f.write(json.dumps({"type": "turn", "condition": name, "turn": t, **v}) + "\n")
            f.write(json.dumps({"type": "mean", "condition": name, "avg": r["avg"], "pass": r["pass"]}) + "\n")
        for name, tr in res["transitions"].items():
            f.write(json.dumps({"type": "transitions", "condition": name, **tr}) + "\n")
        f.write(json.dumps({"type": "cost", **res["cost"]}) + "\n")
        f.write(json.dumps({"type": "config", **res["config"], "skipped": res["skipped"]}) + "\n")
    return path

