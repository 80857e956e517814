"""Problem generator: knobs, verified answers (checked independently with math-verify / sympy),
determinism, held-out split, immutability, bad input."""
import dataclasses
import re

import pytest
import sympy

from treadle.data import (LEVELS, Difficulty, ProblemGenerator, difficulty, evaluate_expression, generate_problems,
                          is_correct, make_sessions)

ALL_LEVELS = list(range(1, len(LEVELS) + 1))


def _max_nesting(s: str) -> int:
    depth = best = 0
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        best = max(best, depth)
    return best


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_answers_verified_independently(level):
    for p in generate_problems(level, 25, seed=level):
        assert re.fullmatch(r"-?\d+", p.answer), p
        if p.difficulty.kind == "linear":
            lhs, rhs = p.expression.split("=")
            x = sympy.Symbol("x")
            assert sympy.solve(sympy.Eq(sympy.sympify(lhs), sympy.sympify(rhs)), x) == [int(p.answer)], p
        else:
            assert sympy.sympify(p.expression) == int(p.answer), p  # sympy's parser, not ours
        assert is_correct(p.answer, p.answer)
        assert not is_correct(str(int(p.answer) + 1), p.answer)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_knobs_are_respected(level):
    d = difficulty(level)
    for p in generate_problems(level, 30, seed=3):
        assert p.level == level and p.difficulty == d
        if d.kind == "arithmetic":
            assert sum(p.expression.count(o) for o in "+-*") == d.ops
            assert _max_nesting(p.expression) == d.depth
            assert set(re.findall(r"[+\-*]", p.expression)) <= set(d.operators)
            nums = re.findall(r"\d+", p.expression)
            assert max(len(n) for n in nums) == d.digits or d.digits == 1
        assert p.prompt.count(" has ") == d.distractors
        assert p.expression in p.prompt.split(" has ")[-1]


def test_custom_difficulty_and_knob_gradient():
    d = Difficulty(digits=4, ops=5, depth=3, distractors=2, operators="+-")
    ps = generate_problems(d, 10, seed=1)
    for p in ps:
        assert p.level == 0 and _max_nesting(p.expression) == 3 and p.expression.count("+") + p.expression.count("-") == 5
        assert evaluate_expression(p.expression) == int(p.answer)
    # longer prompts as the levels get harder (a coarse sanity check of the ladder)
    mean_len = [sum(len(p.prompt) for p in generate_problems(lv, 40, seed=0)) / 40 for lv in (1, 3, 6)]
    assert mean_len == sorted(mean_len)


def test_deterministic_for_seed():
    a = generate_problems(5, 20, seed=11)
    b = generate_problems(5, 20, seed=11)
    c = generate_problems(5, 20, seed=12)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]


def test_heldout_split_is_stable_and_disjoint():
    gen = ProblemGenerator(0)
    held = gen.batch(1, 30, split="heldout")
    train = gen.batch(1, 200, split="train")
    assert all(p.heldout for p in held) and not any(p.heldout for p in train)
    assert not {p.prompt for p in held} & {p.prompt for p in train}
    assert all(p.uid % 10 == 0 for p in held)
    assert all(0 <= p.uid < 2**63 for p in held + train)


def test_problems_are_immutable():
    p = generate_problems(2, 1)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.answer = "0"
    msgs = p.messages()
    msgs[0]["content"] = "tampered"
    msgs.append({})
    assert p.messages()[0]["content"] == p.prompt and len(p.messages()) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        LEVELS[0].digits = 5


@pytest.mark.parametrize("bad", [0, -1, len(LEVELS) + 1, 100])
def test_level_out_of_range(bad):
    with pytest.raises(ValueError, match=r"difficulty level must be in \[1, 6\]"):
        generate_problems(bad, 1)
    with pytest.raises(ValueError, match="level"):
        make_sessions(1, 2, bad)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="level"):
        difficulty("easy")
    with pytest.raises(ValueError, match="depth"):
        Difficulty(ops=2, depth=2)
    with pytest.raises(ValueError, match="operators"):
        Difficulty(operators="/")
    with pytest.raises(ValueError, match="digits"):
        Difficulty(digits=0)
    with pytest.raises(TypeError, match="ops"):
        Difficulty(ops=1.5)
    with pytest.raises(ValueError, match="split"):
        ProblemGenerator(0).problem(1, split="test")
    with pytest.raises(ValueError, match="weights"):
        ProblemGenerator(0).mixture(3, {})
    with pytest.raises(ValueError, match="expression"):
        evaluate_expression("__import__('os')")
    with pytest.raises(TypeError, match="completion"):
        is_correct(3, "3")


def test_sessions():
    sessions = make_sessions(3, 4, [1, 2, 3, 1], seed=5)
    assert len(sessions) == 3
    s = sessions[0]
    assert [p.level for p in s.problems] == [1, 2, 3, 1]
    msgs = s.messages()
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 4
    assert [m["content"] for m in msgs[1::2]] == [p.answer for p in s.problems]
    open_last = s.messages(answered=3)
    assert open_last[-1] == {"role": "user", "content": s.problems[-1].prompt} and len(open_last) == 7
    msgs[0]["content"] = "tampered"
    assert s.messages()[0]["content"] == s.problems[0].prompt
    assert make_sessions(3, 4, [1, 2, 3, 1], seed=5) == sessions
    with pytest.raises(ValueError, match="one entry per turn"):
        make_sessions(1, 3, [1, 2])
    with pytest.raises(ValueError, match="answered"):
        s.messages(answered=9)


def test_math_verify_checks_completions():
    assert is_correct("7", "7")
    assert is_correct("The answer is 7", "7")
    assert is_correct("x=5", "5")
    assert is_correct("-23", "-23")
    assert not is_correct("-23", "23")
    assert not is_correct("", "7")
    assert not is_correct("seven-ish", "7")
