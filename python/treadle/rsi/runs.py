"""Batch layer of the offline RSI loop: run folders (config, JSONL records, harness versions, curve),
resume after an interruption, difficulty-curve PNG, the ablation in miniature.

Run folder layout::

    config.json        loop config + solver {name, args} + seed ids (a resume must match it exactly)
    seeds.jsonl        training seeds; heldout.jsonl: held-out seeds (read only by the transfer step)
    harness/v{N}.json  every harness version that was in force at a round boundary
    problems.jsonl     verified valid tasks with provenance (seed, harness version, skills, solver accuracy)
    repairs.jsonl      invalid tasks and tool failures routed to repair
    log.jsonl          skill admissions (and refusals), post-batch candidates with verdicts, rollbacks
    ledger.jsonl       cost entries (operator, phase, seed chain, units)
    state.json         written atomically after each round (chains, harness, curve): the resume point
    curve.json / curve.png / summary.json

Records of round ``r`` are appended before ``state.json`` says ``r`` is done; a resume drops records of
rounds not marked done, so a crash never duplicates or loses a finished round's records.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from treadle.rsi.harness import Harness
from treadle.rsi.ledger import CostEntry, CostLedger
from treadle.rsi.loop import LoopConfig, RSILoop
from treadle.rsi.math_tasks import MathTask
from treadle.rsi.solvers import CapacitySolver, Solver, TinyModelSolver

__all__ = ["ABLATIONS", "RunConfig", "RunMismatchError", "SolverSpec", "ablate", "build_solver", "plot_curves", "run"]

SOLVERS = {"capacity": CapacitySolver, "tiny-model": TinyModelSolver}
ABLATIONS = {"full": {"online": True, "post_batch": True}, "task-only": {"online": False, "post_batch": False},
             "online-only": {"online": True, "post_batch": False},
             "post-batch-only": {"online": False, "post_batch": True}}


class RunMismatchError(ValueError):
    """A resume whose config differs from the one in the run folder."""


class SolverSpec(BaseModel):
    """A solver by registered name and arguments (rebuildable from the run folder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = "capacity"
    args: dict = Field(default_factory=dict)


class RunConfig(BaseModel):
    """Everything that fixes a run's output."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    loop: LoopConfig = Field(default_factory=LoopConfig)
    solver: SolverSpec = Field(default_factory=SolverSpec)
    seed_ids: tuple[str, ...] = ()
    heldout_ids: tuple[str, ...] = ()
    decontamination: tuple[str, ...] = ()
    """Benchmark files whose 13-grams no exported problem may share."""
    embedding: dict | None = None
    """Embedding decontamination against the same files: ``{"embedder": name, "threshold": t}`` (None: off)."""


def build_solver(spec: SolverSpec) -> Solver:
    """Solver from its spec; ValueError naming the known solvers for an unknown name."""
    if spec.name not in SOLVERS:
        raise ValueError(f"unknown solver {spec.name!r}; known: {sorted(SOLVERS)}")
    return SOLVERS[spec.name](**spec.args)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _jsonl(rows) -> str:
    return "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows)


def _ensure_file(path: Path, text: str) -> None:
    """Make ``path`` hold exactly ``text`` (written whole); left alone when it already does."""
    try:
        if path.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    _write_atomic(path, text)


def _append(path: Path, rows) -> None:
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True, default=str) + "\n")
        f.flush()


def _keep_rounds(path: Path, upto: int) -> list[dict]:
    """Rows of a JSONL file with ``round < upto`` (rewritten in place); [] if absent."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for i, x in enumerate(lines):
        if not x.strip():
            continue
        try:
            rows.append(json.loads(x))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not text.endswith("\n"):  # a write cut by a kill: that round is redone
                continue
            raise RunMismatchError(f"{path}:{i + 1} is not a JSON line; the run folder is damaged, "
                                   f"use another folder") from None
    rows = [r for r in rows if r.get("round", -1) < upto]
    _write_atomic(path, "".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows))
    return rows


def run(out_dir, seeds: list[MathTask], heldout: list[MathTask] = (), loop: LoopConfig | None = None,
        solver: SolverSpec | None = None, *, resume: bool = True, solver_obj: Solver | None = None,
        on_round=None, decontamination: tuple[str, ...] = (), embedding_threshold: float | None = None,
        embedder=None, ray_address: str | None = None, chains=None) -> dict:
    """Run (or resume) the offline loop into ``out_dir``; returns the summary (also ``summary.json``).

    ``decontamination``: benchmark files (see :class:`treadle.rsi.decontam.BenchmarkIndex`); a verified
    problem sharing a 13-gram with one of them is not exported but recorded in ``repairs.jsonl``
    (reason ``contaminated``). ``embedding_threshold``: also drop problems whose cosine similarity to a
    benchmark item reaches it (:class:`treadle.rsi.embedding.EmbeddingIndex` with ``embedder``, default the
    offline :class:`~treadle.rsi.embedding.MiniLMEmbedder`; reason ``contaminated_embedding``).
    ``chains``: an already connected :class:`treadle.rsi.ray_tasks.RayChains` (instead of ``ray_address``;
    the CLI connects before it writes anything).

    Raises:
        ValueError: no seeds, duplicated ids, a held-out id that is also a training id, an
            ``embedding_threshold`` without ``decontamination`` files or outside (0, 1].
        EmbedderUnavailableError: ``embedding_threshold`` set, no ``embedder`` and the MiniLM wheel missing.
        RunMismatchError: ``out_dir`` holds a run with another config (the message lists the differences;
            ``rounds`` may differ: the run continues to the new count),
            or ``resume`` is False and the folder already holds a run.
        RayUnavailableError / ConnectionError: ``ray_address`` given (chains and candidate evaluations as Ray
            tasks, :mod:`treadle.rsi.ray_tasks`; same results) but Ray is missing or no cluster answers there
            (raised before the run folder is touched).
    """
    loop = loop or LoopConfig()
    solver = solver or SolverSpec()
    if not seeds:
        raise ValueError("no training seeds")
    ids = [t.seed_id for t in seeds]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicated seed ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    both = sorted(set(ids) & {t.seed_id for t in heldout})
    if both:
        raise ValueError(f"seed ids both in training and held-out seeds: {both}")
    if chains is None and ray_address is not None:
        from treadle.rsi.ray_tasks import RayChains

        chains = RayChains(ray_address)
    emb_index = None
    if embedding_threshold is not None:
        from treadle.rsi.embedding import EmbeddingIndex, MiniLMEmbedder

        if not decontamination:
            raise ValueError("embedding_threshold needs decontamination benchmark files to compare with")
        if not 0.0 < embedding_threshold <= 1.0:
            raise ValueError(f"embedding_threshold must be in (0, 1], got {embedding_threshold!r}")
        emb_index = EmbeddingIndex(embedder if embedder is not None else MiniLMEmbedder(), embedding_threshold)
    cfg = RunConfig(loop=loop, solver=solver, seed_ids=tuple(ids), heldout_ids=tuple(t.seed_id for t in heldout),
                    decontamination=tuple(str(p) for p in decontamination),
                    embedding=None if emb_index is None else {"embedder": emb_index.embedder.name,
                                                              "threshold": embedding_threshold})
    index = None
    if decontamination:
        from treadle.rsi.decontam import BenchmarkIndex

        index = BenchmarkIndex()
        for p in decontamination:
            index.add_file(p)
            if emb_index is not None:
                emb_index.add_file(p)
    out = Path(out_dir)
    cfg_path, state_path = out / "config.json", out / "state.json"
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text())
            if not isinstance(old, dict) or not isinstance(old.get("loop"), dict):
                raise ValueError("not a run config object")
        except (ValueError, OSError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RunMismatchError(f"{cfg_path} is not a readable run config ({err}); the folder is left as "
                                   f"it is, use another folder") from None
        new = json.loads(cfg.model_dump_json())
        if not resume:
            raise RunMismatchError(f"{out} already holds a run; resume it or choose another folder")
        old.setdefault("embedding", None)  # run folders from before embedding decontamination
        old["loop"].setdefault("answer_check", "last-number")  # run folders from before the math-verify option
        old["loop"].pop("rounds", None)  # more (or fewer) rounds: the same run, continued
        new_rounds = new["loop"].pop("rounds")
        if old != new:
            keys = sorted(k for k in set(old["loop"]) | set(new["loop"]) if old["loop"].get(k) != new["loop"].get(k))
            other = [k for k in ("solver", "seed_ids", "heldout_ids", "decontamination", "embedding")
                     if old.get(k) != new.get(k)]
            raise RunMismatchError(f"{out} holds a run with another config: differs in {keys + other}")
        new["loop"]["rounds"] = new_rounds
        _write_atomic(cfg_path, json.dumps(new, indent=1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "harness").mkdir(exist_ok=True)
    for stale in (*out.glob("*.tmp"), *(out / "harness").glob("*.tmp")):  # a write an interruption cut short
        stale.unlink(missing_ok=True)
    # The seed files are written whole (temporary file, then rename) before config.json, whose presence
    # marks a run; a resume rewrites one that an interruption left missing or cut.
    _ensure_file(out / "seeds.jsonl", _jsonl(t.model_dump(mode="json") for t in seeds))
    _ensure_file(out / "heldout.jsonl", _jsonl(t.model_dump(mode="json") for t in heldout))
    if not cfg_path.exists():
        _write_atomic(cfg_path, cfg.model_dump_json(indent=1))
    solver_impl = solver_obj or build_solver(solver)
    if state_path.exists():
        try:  # a hand-edited or truncated state.json is one line, not a traceback
            st = json.loads(state_path.read_text())
            done = st["round"]
            if not isinstance(done, int) or isinstance(done, bool) or done < 0:
                raise ValueError(f"'round' is {done!r}, not an int >= 0")
            L = RSILoop(seeds, solver_impl, loop, harness=Harness.model_validate(st["harness"]))
            L.h0 = Harness.model_validate(st["h0"])
            L.chains = {k: MathTask.model_validate(v) for k, v in st["chains"].items()}
            L.round, L.curve, L.curve_ci = done, list(st["curve"]), [tuple(c) for c in st["curve_ci"]]
        except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as err:
            raise RunMismatchError(f"{state_path} is not a readable run state ({type(err).__name__}: "
                                   f"{' '.join(str(err).split())[:200]}); the folder is left as it is") from None
        L.log = [r for r in _keep_rounds(out / "log.jsonl", done)]
        L.ledger = CostLedger([CostEntry.model_validate(r) for r in _keep_rounds(out / "ledger.jsonl", done)])
        for name in ("problems.jsonl", "repairs.jsonl"):
            _keep_rounds(out / name, done)
    else:
        for name in ("log.jsonl", "ledger.jsonl", "problems.jsonl", "repairs.jsonl"):
            (out / name).unlink(missing_ok=True)
        L = RSILoop(seeds, solver_impl, loop)
        _append(out / "ledger.jsonl", [e.model_dump(mode="json") for e in L.ledger.entries])
        _write_atomic(out / "harness" / "v0.json", L.h0.to_json())
    L.distributed = chains
    try:
        return _run_rounds(L, out, loop, index, emb_index, heldout, on_round)
    finally:
        L.close()


def _run_rounds(L: RSILoop, out: Path, loop: LoopConfig, index, emb_index, heldout, on_round) -> dict:
    state_path = out / "state.json"
    while L.round < loop.rounds:
        n_log, n_led = len(L.log), len(L.ledger.entries)
        rec = L.step_round()
        exports, repairs = rec["exports"], rec["repairs"]
        if index is not None:
            bad = [e for e in exports if index.contaminated(e["text"])]
            exports = [e for e in exports if not index.contaminated(e["text"])]
            repairs = repairs + [{**e, "reason": "contaminated"} for e in bad]
        if emb_index is not None and exports:
            flags = emb_index.contaminated_many([e["text"] for e in exports])
            repairs = repairs + [{**e, "reason": "contaminated_embedding"} for e, f in zip(exports, flags) if f]
            exports = [e for e, f in zip(exports, flags) if not f]
        _append(out / "problems.jsonl", exports)
        _append(out / "repairs.jsonl", repairs)
        _append(out / "log.jsonl", L.log[n_log:])
        _append(out / "ledger.jsonl", [e.model_dump(mode="json") for e in L.ledger.entries[n_led:]])
        for h in (rec["harness_online"], rec["harness"]):
            _write_atomic(out / "harness" / f"v{h.version}.json", h.to_json())
        _write_atomic(state_path, json.dumps({"round": L.round, "harness": L.harness.model_dump(mode="json"),
                                              "h0": L.h0.model_dump(mode="json"), "curve": L.curve,
                                              "curve_ci": L.curve_ci,
                                              "chains": {k: v.model_dump(mode="json") for k, v in L.chains.items()}}))
        if on_round is not None:
            on_round(rec)
    summary = {"curve": L.curve, "curve_ci95": L.curve_ci, "harness_version": L.harness.version,
               "skills": [s.name for s in L.harness.skills],
               "ledger": L.ledger.summary(), "n_problems": sum(1 for _ in (out / "problems.jsonl").open())}
    if heldout:
        summary["transfer"] = {"h_final": L.transfer(list(heldout), L.harness, loop.rounds),
                               "h0": L.transfer(list(heldout), L.h0, loop.rounds)}
    _write_atomic(out / "curve.json", json.dumps({"round": list(range(len(L.curve))), "accuracy": L.curve,
                                                  "ci95": L.curve_ci, "n_tasks": len(L.chains),
                                                  "attempts": loop.attempts}))
    _write_atomic(out / "summary.json", json.dumps(summary, indent=1, default=str))
    plot_curves({"run": L.curve}, out / "curve.png", title="fixed-solver accuracy on the fixed queue",
                cis={"run": L.curve_ci})
    return summary


def plot_curves(curves: dict[str, list[float]], path, title: str, cis: dict | None = None) -> None:
    """Difficulty curves (accuracy per round; shaded 95% intervals where ``cis`` has them) to a PNG with
    matplotlib's object API (no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, ys in curves.items():
        ax.plot(range(len(ys)), ys, marker="o", label=name)
        if cis and name in cis:
            ax.fill_between(range(len(ys)), [c[0] for c in cis[name]], [c[1] for c in cis[name]], alpha=0.2)
    ax.set_xticks(range(max((len(ys) for ys in curves.values()), default=1)))
    ax.set_xlabel("round (0 = seeds)")
    ax.set_ylabel("fixed-solver accuracy (4 attempts)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def ablate(out_dir, seeds: list[MathTask], base: LoopConfig, solver: SolverSpec, run_seeds=(0, 1, 2),
           on_run=None, solver_obj: Solver | None = None) -> list[dict]:
    """The paper's ablation in miniature: Full / Task-only / Online-only / Post-batch-only, each for every
    seed in ``run_seeds``, same seeds and budget; rows of final-round accuracy and cost per operator,
    ``ablation.json`` and ``ablation.png`` (mean curve per variant). ``solver_obj``: the solver of
    ``solver``, already built (e.g. a loaded tiny model, shared by every run instead of loaded per run)."""
    out = Path(out_dir)
    rows, curves = [], {}
    for variant, flags in ABLATIONS.items():
        per = []
        for s in run_seeds:
            cfg = base.model_copy(update={**flags, "seed": s})
            summ = run(out / f"{variant}-seed{s}", seeds, (), cfg, solver, solver_obj=solver_obj)
            ops = summ["ledger"]["by_operator"]
            row = {"variant": variant, "seed": s, "final_accuracy": summ["curve"][-1],
                   "cost_online": summ["ledger"]["by_phase"].get("online", 0.0),
                   "cost_post_batch": summ["ledger"]["by_phase"].get("post_batch", 0.0),
                   **{f"cost_{k}": ops.get(k, 0.0) for k in ("extend", "revise", "verify", "director", "skill_update")}}
            rows.append(row)
            per.append(summ["curve"])
            if on_run is not None:
                on_run(row)
        curves[variant] = [sum(c[i] for c in per) / len(per) for i in range(len(per[0]))]
    _write_atomic(out / "ablation.json", json.dumps({"rows": rows, "mean_curves": curves}, indent=1))
    plot_curves(curves, out / "ablation.png", title="ablation: mean accuracy per round")
    return rows
