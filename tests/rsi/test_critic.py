import math

import pytest
from treadle.rsi.critic import Critic, Evaluation, PostBatchGate, cost_bound, relative_difficulty_gain
from treadle.rsi.harness import Harness

BASE = Evaluation(validity=0.9, accuracy=0.6, cost=100.0)


@pytest.mark.parametrize("r_d,bound", [(1.0, 1.0), (1.2, 1.3), (1.5, 1.5), (2.0, 1.5), (math.inf, 1.5)])
def test_cost_bound(r_d, bound):
    assert cost_bound(r_d) == pytest.approx(bound)


def test_relative_difficulty_gain_edges():
    assert relative_difficulty_gain(0.6, 0.3) == pytest.approx(2.0)
    assert relative_difficulty_gain(0.6, 0.0) == math.inf
    assert relative_difficulty_gain(0.0, 0.0) == 1.0


@pytest.mark.parametrize("r_d,limit", [(1.2, 130.0), (1.5, 150.0), (2.0, 150.0)])
def test_cost_bound_decides_at_each_r_d(r_d, limit):
    critic = Critic(margin=0.0)
    acc = 0.6 / r_d
    ok = critic.judge(Evaluation(validity=0.9, accuracy=acc, cost=limit), BASE)
    over = critic.judge(Evaluation(validity=0.9, accuracy=acc, cost=limit + 0.5), BASE)
    assert ok.accepted, ok.reason
    assert not over.accepted and "cost" in over.reason
    assert ok.r_d == pytest.approx(r_d)


def test_r_d_one_is_rejected_on_difficulty_even_at_equal_cost():
    v = Critic(margin=0.0).judge(Evaluation(validity=0.9, accuracy=0.6, cost=100.0), BASE)
    assert not v.accepted and "difficulty" in v.reason and v.cost_ratio_bound == pytest.approx(1.0)


@pytest.mark.parametrize("cand,accepted,why", [
    ({"validity": 0.9, "accuracy": 0.5, "cost": 100}, True, "all conditions hold"),
    ({"validity": 0.89, "accuracy": 0.5, "cost": 100}, False, "validity"),
    ({"validity": 1.0, "accuracy": 0.59, "cost": 100}, False, "difficulty"),   # inside the noise margin
    ({"validity": 1.0, "accuracy": 0.7, "cost": 50}, False, "difficulty"),
    ({"validity": 1.0, "accuracy": 0.5, "cost": 131}, False, "cost"),  # r_D = 1.2: bound 1.3 x 100
])
def test_truth_table(cand, accepted, why):
    v = Critic(margin=0.02).judge(Evaluation(**cand), BASE)
    assert v.accepted is accepted
    assert why in v.reason


def test_margin_zero_accepts_a_small_gain():
    assert Critic(margin=0.0).judge(Evaluation(validity=0.9, accuracy=0.59, cost=100), BASE).accepted


def test_bad_margin():
    with pytest.raises(ValueError, match="margin"):
        Critic(margin=-0.1)


def test_rollback_after_exactly_three_rejections():
    online = Harness(version=4)
    bad = Evaluation(validity=0.9, accuracy=0.7, cost=100)
    gate = PostBatchGate(online, BASE)
    for i in range(2):
        assert not gate.offer(Harness(version=5 + i), bad, f"p{i}").accepted
        assert not gate.done and not gate.rolled_back
    gate.offer(Harness(version=7), bad, "p2")
    assert gate.done and gate.rolled_back and gate.result is online
    assert [e.get("proposal") for e in gate.log[:3]] == ["p0", "p1", "p2"]
    assert "3 rejections" in gate.log[-1]["rollback"]
    with pytest.raises(RuntimeError, match="already decided"):
        gate.offer(Harness(version=8), bad)


def test_first_accepted_candidate_wins_and_rejections_stay_logged():
    online = Harness(version=1)
    gate = PostBatchGate(online, BASE)
    gate.offer(Harness(version=2, parent=1), Evaluation(validity=0.9, accuracy=0.7, cost=10), "worse")
    good = Harness(version=2, parent=1, workflow={"max_extends": 3})
    assert gate.offer(good, Evaluation(validity=0.9, accuracy=0.3, cost=120), "better").accepted
    assert gate.done and not gate.rolled_back and gate.result is good
    assert not gate.log[0]["verdict"]["accepted"] and gate.log[0]["verdict"]["reason"]
