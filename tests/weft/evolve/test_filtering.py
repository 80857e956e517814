"""RL task filtering: correlation maths on known inputs (scipy), thresholds, minimum rollouts, bad input."""
import math

import pytest
from scipy import stats

from treadle.weft.evolve.filtering import FilterConfig, decide, filter_tasks

EXEC = [0, 0, 1, 1, 0, 1, 1, 0, 1, 1]


def test_known_values_match_scipy_and_the_textbook():
    judge = [0.1, 0.2, 0.9, 0.8, 0.3, 0.7, 0.95, 0.15, 0.6, 0.85]
    d = decide("t", judge, EXEC)
    assert d.kept and d.n == 10 and not d.reasons and not d.to_attribution
    assert d.pearson == pytest.approx(stats.pearsonr(judge, EXEC).statistic)
    # point-biserial r by hand: (M1 - M0) / s_n * sqrt(p q)
    m1 = sum(j for j, e in zip(judge, EXEC) if e) / 6
    m0 = sum(j for j, e in zip(judge, EXEC) if not e) / 4
    mean = sum(judge) / 10
    sd = math.sqrt(sum((j - mean) ** 2 for j in judge) / 10)
    assert d.pearson == pytest.approx((m1 - m0) / sd * math.sqrt(0.6 * 0.4))
    assert d.spearman == pytest.approx(stats.spearmanr(judge, EXEC).statistic)
    lo, hi = d.pearson_ci
    z, se = math.atanh(d.pearson), 1 / math.sqrt(10 - 3)  # Fisher interval
    assert lo == pytest.approx(math.tanh(z - 1.959964 * se), abs=1e-5) and hi == pytest.approx(math.tanh(z + 1.959964 * se), abs=1e-5)
    assert d.spearman_ci[0] <= d.spearman <= d.spearman_ci[1]
    assert decide("t", judge, EXEC) == d  # seeded bootstrap: deterministic


def test_pearson_and_spearman_fail_differently():
    # ranks agree perfectly, but one outlier ruins the linear fit
    x = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 1.0]
    y = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.81]
    d = decide("rank-only", x, y, FilterConfig(min_pearson=0.8, min_spearman=0.8))
    assert d.spearman == pytest.approx(1.0) and d.pearson < 0.8
    assert not d.kept and d.to_attribution and d.reasons == (f"pearson {d.pearson:.3f} < 0.8",)
    anti = decide("anti", [1 - e for e in EXEC], EXEC)
    assert not anti.kept and anti.pearson == pytest.approx(-1) and len(anti.reasons) == 2


def test_minimum_rollouts_constant_and_malformed_scores_are_recorded_not_fatal():
    out = filter_tasks({
        "few": ([0.1, 0.9, 0.2], [0, 1, 0]),
        "const": ([0.5] * 10, EXEC),
        "easy": ([0.5] * 10, [1] * 10),
        "nan": ([float("nan")] + [0.5] * 9, EXEC),
        "range": ([2.0] * 10, EXEC),
        "length": ([0.1] * 9, EXEC),
        "text": ("good", EXEC),
        "shape": "nonsense",
        "ok": ([0.9 if e else 0.1 for e in EXEC], EXEC),
    })
    by = {d.task: d for d in out}
    assert [d.task for d in out] == ["few", "const", "easy", "nan", "range", "length", "text", "shape", "ok"]
    assert "min_rollouts 8" in by["few"].reasons[0]
    assert by["const"].reasons == ("constant judge scores: correlation undefined",) and by["const"].to_attribution
    # every pilot passes: dropped for want of signal, whatever the judge says, and no evaluator is blamed
    assert by["easy"].reasons == ("constant executable scores: correlation undefined",) and not by["easy"].to_attribution
    for k in ("nan", "range", "length", "text", "shape"):
        assert not by[k].kept and by[k].reasons[0].startswith("malformed scores"), k
    assert by["ok"].kept and by["ok"].pearson == pytest.approx(1.0)


def test_config_is_validated():
    with pytest.raises(ValueError, match="min_rollouts"):
        FilterConfig(min_rollouts=2)
    with pytest.raises(ValueError, match="extra"):
        FilterConfig(min_pearsonn=0.3)


def test_cli_reports_kept_and_dropped_with_reasons(tmp_path):
    import json

    from typer.testing import CliRunner

    from treadle.cli import app

    rows = [{"task": "good", "judge": 0.9 if e else 0.1, "executable": e} for e in EXEC]
    rows += [{"task": "noisy", "judge": 1 - e, "executable": e} for e in EXEC]
    rows += [{"task": "broken", "judge": "great", "executable": 1}] * 9
    p = tmp_path / "scores.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(app, ["weft", "filter", "--scores", str(p), "--out", str(tmp_path / "d")])
    assert res.exit_code == 0, res.output
    assert "kept 1 of 3 tasks" in res.output and "evaluator attribution" in res.output
    got = {json.loads(x)["task"]: json.loads(x) for x in (tmp_path / "d" / "filter.jsonl").read_text().splitlines()}
    assert got["good"]["kept"] and not got["noisy"]["kept"] and got["broken"]["reasons"][0].startswith("malformed")
    p.write_text("not json\n")
    res = CliRunner().invoke(app, ["weft", "filter", "--scores", str(p)])
    assert res.exit_code == 2 and "--scores" in res.output
