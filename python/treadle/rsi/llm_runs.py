"""Batch layer of RSI rounds with LLM roles: a run folder, resumable after an interruption.

Run folder layout::

    config.json        domain, LLMLoopConfig, seed ids, models per role (never keys); a resume must match it
    harness/v{N}.json  the harness at each round boundary (online admissions grow it)
    problems.jsonl     verified tasks with provenance (seed, harness version, skills, solver accuracy)
    repairs.jsonl      invalid tasks, generator failures, tool failures
    failures.jsonl     failed model calls (operator, kind, blame, message), per chain and round
    log.jsonl          post-batch: baseline, every proposal with its diff and verdict, rollbacks
    state.json         written atomically after each round (round, harness, chains, curve points): the resume point
    measure.jsonl      the fixed solver on every chain's task at each curve point (:mod:`~treadle.rsi.llm_curve`)
    curve.json / curve.png  difficulty curve on the fixed queue: accuracy (95% CI), pass@k, construction steps
    summary.json       per-round mean accuracy of newly verified tasks, counts, the curve, the cost ledger per
                       operator (measuring calls counted apart: they are not synthesis cost)

A round's records are appended before ``state.json`` marks it done; a resume drops records of a round not
marked done and reruns it, and :mod:`treadle.llm`'s cache serves the calls that round already paid for.
"""
from __future__ import annotations

import json
from pathlib import Path

from treadle.llm import LLMClient, read_ledger
from treadle.rsi.coding import CodingTask
from treadle.rsi.harness import Harness
from treadle.rsi.llm_curve import QueuePoint, curve_rows, curve_table, measure_queue, plot_curve
from treadle.rsi.llm_loop import CodingDomain, LLMLoopConfig, LLMRound, TextMathTask
from treadle.rsi.llm_roles import cost_from_llm_ledger
from treadle.rsi.runs import RunMismatchError, _append, _keep_rounds, _write_atomic

__all__ = ["run_llm"]


def _task_type(domain):
    return CodingTask if isinstance(domain, CodingDomain) else TextMathTask


async def run_llm(out_dir, queue: list, domain, client: LLMClient, rounds: int, *, harness: Harness | None = None,
                  config: LLMLoopConfig | None = None, on_round=None, post_batch: bool = False,
                  margin: float = 0.02, measure: bool = True) -> dict:
    """Run (or resume) ``rounds`` LLM rounds over ``queue`` into ``out_dir``; returns the summary.

    Args:
        queue: seed tasks (:class:`~treadle.rsi.llm_loop.TextMathTask` or :class:`~treadle.rsi.coding.CodingTask`,
            matching ``domain``), distinct ``seed_id``.
        client: an open :class:`treadle.llm.LLMClient` (give it a cache so resumed rounds are free, and a
            ledger for the cost summary).
        harness: the starting harness (its library must not be empty).
        post_batch: after each round's online phase, LLM post-batch proposals judged by the Critic
            (:func:`~treadle.rsi.llm_post_batch.llm_post_batch`, noise ``margin``) on the frozen queue.
        measure: the difficulty curve on the fixed queue: the fixed solver (``harness``'s solver prompt at
            the start) attempts every chain's task before round 0 and after each round
            (:func:`~treadle.rsi.llm_curve.measure_queue`); ``summary["curve"]``, ``curve.json``, ``curve.png``.

    Raises:
        ValueError: empty queue, duplicated seed ids, tasks of the wrong type, ``rounds`` < 1, an empty library.
        RunMismatchError: ``out_dir`` holds a run with another config.
    """
    config = config or LLMLoopConfig()
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if not queue:
        raise ValueError("no seed tasks in the queue")
    ttype = _task_type(domain)
    wrong = [type(t).__name__ for t in queue if not isinstance(t, ttype)]
    if wrong:
        raise ValueError(f"domain {domain.name!r} needs {ttype.__name__} tasks, got {sorted(set(wrong))}")
    ids = [t.seed_id for t in queue]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"duplicated seed ids: {dup}")
    harness = harness or Harness()
    if not harness.skills:
        raise ValueError("the starting harness has no skills: the Director could only Finish")
    loop = LLMRound(client, domain, harness, config)  # checks the roles before any call
    cfg = {"domain": domain.name, "loop": config.model_dump(mode="json"), "seed_ids": ids,
           "post_batch": {"margin": margin} if post_batch else None, "measure": measure,
           "answer_check": getattr(domain, "answer_check_version", None),
           "models": {r: client.config.role(config.roles[r]).model for r in config.roles}}
    out = Path(out_dir)
    cfg_path, state_path = out / "config.json", out / "state.json"
    if cfg_path.exists():
        try:
            old = json.loads(cfg_path.read_text())
        except (ValueError, OSError) as err:
            raise RunMismatchError(f"{cfg_path} is not a readable run config ({err}); use another folder") from None
        if isinstance(old, dict) and "answer_check" not in old:  # a run folder from before the curve and the
            old.setdefault("measure", measure)                   # answer-check record: it judged by last number
            old["answer_check"] = "last-number-1" if domain.name == "math" else cfg["answer_check"]
        if old != cfg:
            keys = sorted(k for k in set(old) | set(cfg) if old.get(k) != cfg.get(k)) if isinstance(old, dict) else []
            raise RunMismatchError(f"{out} holds a run with another config: differs in {keys}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "harness").mkdir(exist_ok=True)
    if not cfg_path.exists():
        _write_atomic(cfg_path, json.dumps(cfg, indent=1))
    chains = {t.seed_id: t for t in queue}
    done, per_round, reports, points = 0, [], [], []
    solver_prompt = harness.prompts.solver  # the fixed solver: H_0's prompt, whatever later edits do

    async def measure_point(p: int) -> None:
        if measure:
            points.extend(await measure_queue(client, domain, [chains[i] for i in ids], p, attempts=config.attempts,
                                              role=config.roles["solver"], solver_prompt=solver_prompt,
                                              concurrency=config.concurrency))
            _write_atomic(out / "measure.jsonl", "".join(q.model_dump_json() + "\n" for q in points))

    if state_path.exists():
        try:  # a hand-edited or truncated state.json is one line, not a traceback
            st = json.loads(state_path.read_text())
            done, per_round, reports = st["round"], list(st["per_round"]), list(st["reports"])
            if not isinstance(done, int) or isinstance(done, bool) or done < 0:
                raise ValueError(f"'round' is {done!r}, not an int >= 0")
            points = [QueuePoint.model_validate(q) for q in st.get("points", [])]
            solver_prompt = st.get("solver_prompt", solver_prompt)
            loop.harness = Harness.model_validate(st["harness"])
            chains = {k: ttype.model_validate(v) for k, v in st["chains"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as err:
            raise RunMismatchError(f"{state_path} is not a readable run state ({type(err).__name__}: "
                                   f"{' '.join(str(err).split())[:200]}); the folder is left as it is") from None
        for name in ("problems.jsonl", "repairs.jsonl", "failures.jsonl", "log.jsonl"):
            _keep_rounds(out / name, done)
    else:
        for name in ("problems.jsonl", "repairs.jsonl", "failures.jsonl", "log.jsonl"):
            (out / name).unlink(missing_ok=True)
        _write_atomic(out / "harness" / f"v{harness.version}.json", harness.to_json())
        (out / "measure.jsonl").unlink(missing_ok=True)
    if measure and not any(q.point == done for q in points):  # the seeds (or a point a crash cut short)
        points = [q for q in points if q.point < done]
        await measure_point(done)
    for rnd in range(done, rounds):
        recs = await loop.run([chains[i] for i in ids], rnd)
        chains = {r.seed_id: r.task for r in recs}
        _append(out / "problems.jsonl", [e for r in recs for e in r.exports])
        _append(out / "repairs.jsonl", [e for r in recs for e in r.repairs])
        _append(out / "failures.jsonl", [{"round": rnd, "seed_id": r.seed_id, **f} for r in recs for f in r.failures])
        if post_batch:  # S_n: the queue frozen at the batch boundary
            from treadle.rsi.llm_post_batch import llm_post_batch

            h_online = loop.harness
            _write_atomic(out / "harness" / f"v{h_online.version}.json", h_online.to_json())
            loop.harness, log = await llm_post_batch(client, domain, h_online, [chains[i] for i in ids], rnd, config,
                                                     margin=margin, reports=reports)
            _append(out / "log.jsonl", log)
            accepted = any(e.get("accepted") for e in log)
        else:
            accepted = None
        accs = [e["solver_accuracy"] for r in recs for e in r.exports]
        per_round.append({"round": rnd, "verified": len(accs), "repairs": sum(len(r.repairs) for r in recs),
                          "failed_calls": sum(len(r.failures) for r in recs),
                          "mean_accuracy_new": sum(accs) / len(accs) if accs else None,
                          "admitted": [s for r in recs for s in r.admitted], "harness_version": loop.harness.version,
                          "post_batch_accepted": accepted})
        _write_atomic(out / "harness" / f"v{loop.harness.version}.json", loop.harness.to_json())
        await measure_point(rnd + 1)
        _write_atomic(state_path, json.dumps({"round": rnd + 1, "per_round": per_round, "reports": reports,
                                              "points": [q.model_dump(mode="json") for q in points],
                                              "solver_prompt": solver_prompt,
                                              "harness": loop.harness.model_dump(mode="json"),
                                              "chains": {k: v.model_dump(mode="json") for k, v in chains.items()}}))
        if on_round is not None:
            on_round(per_round[-1])
    summary = {"rounds": per_round, "skills": [s.name for s in loop.harness.skills],
               "harness_version": loop.harness.version}
    if measure:
        rows = curve_rows(points)
        summary["curve"] = rows
        _write_atomic(out / "curve.json", json.dumps({"rows": rows, "attempts": config.attempts,
                                                      "n_tasks": len(ids), "table": curve_table(rows)}, indent=1))
        plot_curve(rows, out / "curve.png")
    if client.ledger is not None:
        # every rsi-tagged live call in the client's ledger file (give each run its own ledger)
        live = [r for r in read_ledger(client.ledger.path) if not r.cache_hit]
        summary["ledger"] = cost_from_llm_ledger(live).summary()
        summary["measure_calls"] = sum(1 for r in live if r.tag.startswith("rsi:") and ":measure:" in r.tag)
    _write_atomic(out / "summary.json", json.dumps(summary, indent=1, default=str))
    return summary
