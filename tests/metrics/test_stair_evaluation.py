"""STAIR evaluation metrics (sec. 5.4) on hand-built correctness tables whose counts are known:
Avg@k, Pass@k, the mean over turns and answer transitions; then :func:`evaluate` end to end with the
model runs replaced by those tables, so the wiring (which condition is compared with which, in which
direction) is checked too."""
import types

import pytest
import torch

from treadle.stair import evaluation as ev
from treadle.stair.evaluation import EvalConfig, answer_transitions, mean_over_turns, turn_scores

T, F = True, False


def test_turn_scores_known_counts():
    # 3 problems x 4 samples: 2 + 0 + 4 = 6 right of 12; problems with any right sample: 2 of 3
    c = torch.tensor([[T, F, T, F], [F, F, F, F], [T, T, T, T]])
    assert turn_scores(c) == {"avg": 0.5, "pass": pytest.approx(2 / 3)}
    assert turn_scores(torch.zeros(2, 3, dtype=torch.bool)) == {"avg": 0.0, "pass": 0.0}
    assert turn_scores(torch.ones(2, 3, dtype=torch.bool)) == {"avg": 1.0, "pass": 1.0}
    # k = 1: Pass@1 == Avg@1
    one = torch.tensor([[T], [F], [F], [T], [T]])
    assert turn_scores(one) == {"avg": 0.6, "pass": 0.6}
    # one right sample in each problem: Avg@4 = 1/4 but Pass@4 = 1
    diag = torch.eye(4, dtype=torch.bool)
    assert turn_scores(diag) == {"avg": 0.25, "pass": 1.0}


def test_pass_is_per_problem_not_per_sample():
    # transposing changes which axis is "problems": 1 problem x 4 samples vs 4 problems x 1 sample
    row = torch.tensor([[T, F, F, F]])
    assert turn_scores(row) == {"avg": 0.25, "pass": 1.0}
    assert turn_scores(row.T) == {"avg": 0.25, "pass": 0.25}


@pytest.mark.parametrize("bad", [torch.ones(2, 2), torch.ones(4, dtype=torch.bool), torch.zeros(0, 3, dtype=torch.bool),
                                 [[True]]])
def test_turn_scores_refuses(bad):
    with pytest.raises(ValueError, match=r"correct must be a non-empty \(n_problems, k\) bool tensor"):
        turn_scores(bad)


def test_mean_over_turns_is_unweighted():
    turns = {2: {"avg": 0.5, "pass": 1.0}, 3: {"avg": 0.0, "pass": 0.25}, 4: {"avg": 1.0, "pass": 1.0}}
    assert mean_over_turns(turns) == {"avg": 0.5, "pass": 0.75}
    with pytest.raises(ValueError, match="no turn"):
        mean_over_turns({})


NATIVE = {2: torch.tensor([[T, F], [F, F]]), 3: torch.tensor([[T, T], [F, T]])}
VANILLA = {2: torch.tensor([[F, F], [T, F]]), 3: torch.tensor([[T, F], [F, F]])}
RANDOM = {2: torch.tensor([[T, T], [T, T]]), 3: torch.tensor([[T, T], [F, T]])}


def test_answer_transitions_known_counts():
    # turn 2: native wrong -> vanilla right at (1, 0); right -> wrong at (0, 0)
    # turn 3: right -> wrong at (0, 1) and (1, 1)
    assert answer_transitions(NATIVE, VANILLA) == {"from": "native", "wrong_to_right": 1, "right_to_wrong": 3,
                                                   "pairs": 8}
    # the reverse direction swaps the two counts
    back = answer_transitions(VANILLA, NATIVE, before_name="vanilla")
    assert back == {"from": "vanilla", "wrong_to_right": 3, "right_to_wrong": 1, "pairs": 8}
    assert answer_transitions(NATIVE, NATIVE)["wrong_to_right"] == 0 == answer_transitions(NATIVE, NATIVE)["right_to_wrong"]
    # only the turns of ``after`` are compared
    assert answer_transitions(NATIVE, {3: RANDOM[3]}) == {"from": "native", "wrong_to_right": 0, "right_to_wrong": 0,
                                                          "pairs": 4}


def test_answer_transitions_refuses_mismatched_turns():
    with pytest.raises(ValueError, match="turn 4: native has no such turn"):
        answer_transitions(NATIVE, {4: NATIVE[3]})
    with pytest.raises(ValueError, match=r"turn 2: native has \(2, 2\), expected shape \(2, 3\)"):
        answer_transitions(NATIVE, {2: torch.ones(2, 3, dtype=torch.bool)})


def test_evaluate_wires_the_metrics(monkeypatch):
    """evaluate() with the model runs replaced by the tables above (vanilla / native / random run
    without a normals file; the rest are skipped)."""
    import treadle.stair.controller as controller
    import treadle.stair.training as training

    tables = {(False, False): VANILLA, (False, True): NATIVE, (True, True): RANDOM}

    def fake_run(model, tok, ctrl, sessions, history, cfg, *, stair, with_history, budget=None):
        return {t: {"correct": c, "prefill_s": 0.001 * t + (0.01 if stair else 0.0), "peak_bytes": None,
                    "bank_tokens": 0.0} for t, c in tables[(stair, with_history)].items()}

    ctrl = types.SimpleNamespace(load=lambda p: None, detach=lambda: None)
    monkeypatch.setattr(ev, "_run_condition", fake_run)
    monkeypatch.setattr(controller, "attach", lambda *a, **k: ctrl)
    monkeypatch.setattr(training, "make_training_sessions", lambda *a, **k: [])
    monkeypatch.setattr(training, "self_responses", lambda *a, **k: [])
    cfg = EvalConfig(sessions=2, turns=3, levels=[1, 1, 1], k=2)
    res = ev.evaluate(None, None, cfg, layers=(0,), progress=False)
    assert res["skipped"] == ["stair", "bank_free", "shuffled", "reflected"]
    c = res["conditions"]
    assert set(c) == {"vanilla", "native", "random"}
    # native: turn 2 avg 1/4 pass 1/2; turn 3 avg 3/4 pass 1
    assert c["native"]["turns"][2]["avg"] == 0.25 and c["native"]["turns"][2]["pass"] == 0.5
    assert c["native"]["turns"][3]["avg"] == 0.75 and c["native"]["turns"][3]["pass"] == 1.0
    assert c["native"]["avg"] == 0.5 and c["native"]["pass"] == 0.75
    # vanilla: turn 2 avg 1/4 pass 1/2; turn 3 avg 1/4 pass 1/2
    assert c["vanilla"]["avg"] == 0.25 and c["vanilla"]["pass"] == 0.5
    # random: turn 2 all right; turn 3 as native
    assert c["random"]["avg"] == pytest.approx((1.0 + 0.75) / 2) and c["random"]["pass"] == 1.0
    assert res["transitions"] == {
        "vanilla": {"from": "native", "wrong_to_right": 1, "right_to_wrong": 3, "pairs": 8},
        "random": {"from": "native", "wrong_to_right": 3, "right_to_wrong": 0, "pairs": 8},
    }
    assert c["native"]["turns"][2]["prefill_s"] == pytest.approx(0.002)
    assert res["cost"] == {}  # no "stair" condition ran
