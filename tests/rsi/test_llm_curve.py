"""The LLM runs' difficulty curve on a fixed queue: computed right from known per-task measurements, and
measured by the fixed solver (H_0's prompt) against the shared fake endpoint."""
from __future__ import annotations

import asyncio

import pytest

from treadle.llm import LLMClient, LLMConfig, RoleConfig
from treadle.llm.fake_endpoint import FakeEndpoint
from treadle.rsi.llm_curve import QueuePoint, curve_rows, curve_table, measure_queue
from treadle.rsi.llm_loop import MathDomain, TextMathTask
from treadle.rsi.loop import bootstrap_ci


def _p(point, sid, acc, steps, domain="math", answered=4):
    correct = 0 if acc is None else round(acc * answered)
    return QueuePoint(point=point, domain=domain, seed_id=sid, task=f"k{sid}{point}", steps=steps, attempts=4,
                      answered=answered if acc is not None else 0, correct=correct, accuracy=acc)


def test_curve_rows_on_known_inputs():
    pts = [_p(0, "a", 1.0, 0), _p(0, "b", 0.75, 0), _p(0, "c", 0.5, 0),
           _p(1, "a", 0.25, 1), _p(1, "b", 0.0, 2), _p(1, "c", None, 1),  # c: every attempt failed at the endpoint
           _p(0, "x", 0.0, 0, domain="code"), _p(0, "y", 1.0, 0, domain="code")]
    rows = curve_rows(pts)
    assert [(r["domain"], r["point"]) for r in rows] == [("code", 0), ("math", 0), ("math", 1)]
    code, m0, m1 = rows
    assert code["accuracy"] == 0.5 and code["solved"] == 0.5 and code["n_tasks"] == 2
    assert m0["accuracy"] == pytest.approx(0.75) and m0["solved"] == 1.0 and m0["mean_steps"] == 0.0
    assert m0["unmeasured"] == 0 and m0["ci95"] == list(bootstrap_ci([1.0, 0.75, 0.5]))
    # the unmeasured task is left out of the mean (never scored 0) and counted; its steps still count
    assert m1["accuracy"] == pytest.approx(0.125) and m1["unmeasured"] == 1 and m1["n_tasks"] == 3
    assert m1["solved"] == 0.5 and m1["mean_steps"] == pytest.approx(4 / 3)
    lo, hi = m1["ci95"]
    assert 0.0 <= lo <= 0.125 <= hi <= 0.25
    table = curve_table(rows)
    assert "| math | 1 | 3 | 1 | 0.125 |" in table and table.count("\n") == 4


def test_curve_rows_all_unmeasured_and_empty():
    assert curve_rows([]) == []
    (r,) = curve_rows([_p(2, "a", None, 3)])
    assert r["accuracy"] is None and r["ci95"] is None and r["solved"] is None and r["unmeasured"] == 1
    assert "| math | 2 | 1 | 1 | - | - | - | 3.00 |" in curve_table([r])


def test_measure_queue_uses_the_fixed_solver_prompt_and_records_endpoint_failures():
    def respond(req):
        user = req["messages"][-1]["content"]
        if "9+9" in user:
            return 500  # this task's attempts all fail: unmeasured, not 0
        return {"Compute 2+3.": "5", "Compute 4+4.": "7"}[user]  # right on the first, wrong on the second

    async def go(ep):
        cfg = LLMConfig(roles={"solver": RoleConfig(model="solver", base_url=ep.base_url, max_retries=0,
                                                    backoff_s=0.01, timeout_s=10)})
        async with LLMClient(cfg) as c:
            tasks = [TextMathTask(seed_id="a", text="Compute 2+3.", answer="5"),
                     TextMathTask(seed_id="b", text="Compute 4+4.", answer="8", skills_used=("s1", "s2")),
                     TextMathTask(seed_id="c", text="Compute 9+9.", answer="18")]
            return await measure_queue(c, MathDomain(), tasks, 3, attempts=2, solver_prompt="FIXED SOLVER")

    with FakeEndpoint(responder=respond) as ep:
        pts = asyncio.run(go(ep))
        bodies = ep.bodies
    assert [(p.seed_id, p.point, p.steps, p.answered, p.correct, p.accuracy) for p in pts] == \
        [("a", 3, 0, 2, 2, 1.0), ("b", 3, 2, 2, 0, 0.0), ("c", 3, 0, 0, 0, None)]
    assert len(bodies) == 6 and all(b["messages"][0]["content"] == "FIXED SOLVER" for b in bodies)
    with pytest.raises(ValueError, match="attempts"):
        asyncio.run(measure_queue(None, MathDomain(), [], 0, attempts=0))
