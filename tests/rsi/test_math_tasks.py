import json
import random

import pytest
from treadle.rsi.math_tasks import (
    PRIMITIVES,
    MathTask,
    NotApplicable,
    SeedError,
    apply_method,
    load_seed_file,
    make_seeds,
    parse_seed_expression,
)
from treadle.rsi.solvers import CapacitySolver, text_features
from treadle.rsi.verifier import check_answer, check_task


def _task(expr, sid="a"):
    from treadle.rsi.math_tasks import _with

    return _with(MathTask(seed_id=sid, tree=parse_seed_expression(expr), answer="0"))


def test_render_and_answer():
    t = _task("48-(63+43)")
    assert t.text == "Compute 48-(63+43)." and t.answer == "-58"
    assert t.features() == {"ops": 2, "digits": 2, "depth": 1, "distractors": 0, "solve": 0}
    assert text_features(t.text) == t.features()


@pytest.mark.parametrize("name", sorted(PRIMITIVES))
def test_every_primitive_is_checked_by_the_independent_verifier(name):
    """Whenever a primitive's output is valid, the generator's answer is the verifier's (sympy) answer;
    otherwise the verifier names a reason."""
    seen_valid = 0
    for i, t in enumerate(make_seeds(30, 3)):
        try:
            u = PRIMITIVES[name](t, random.Random(i))
        except NotApplicable:
            continue
        c = check_task(u.text, u.answer)
        if c.valid:
            seen_valid += 1
            assert c.answer == u.answer
        else:
            assert c.reason in {"non_integer_answer", "no_unique_solution", "too_large"}
    assert seen_valid > 0


def test_equation_answer_is_x():
    t = apply_method(_task("3*4+5"), ("to_equation",), random.Random(0), "eq")
    assert t.kind == "solve" and t.skills_used == ("eq",)
    c = check_task(t.text, t.answer)
    assert c.valid and c.answer == str(t.x_value)


def test_verifier_reasons():
    assert check_task("Compute 7/2.", "7/2").reason == "non_integer_answer"
    assert check_task("Compute 3+4.", "8").reason == "wrong_reference_answer"
    assert check_task("Solve 0*x+1=1 for x.", "1").reason == "no_unique_solution"
    assert check_task("Compute 9999*9999*99.", "0").reason == "too_large"
    assert check_task("what?", "1").reason == "unparsable"
    assert check_task("Ann has 3 cats. Solve 2*x+1=7 for x.", "3").valid


def test_check_answer_is_exact():
    assert check_answer("x=5", "5") and check_answer("The answer is -3", "-3")
    assert not check_answer("5.5", "5") and not check_answer("", "5") and not check_answer("6", "5")


def test_capacity_solver_has_its_limit():
    s = CapacitySolver()
    easy, hard = "Compute 1+2.", "Ann has 1 cats. Ben has 2 hats. Solve (12*x-345)*7+8=1 for x."
    assert s.attempt([easy], 4, 0) == [["3"] * 4]
    assert s.overshoot(hard) > 0
    assert s.attempt([hard], 4, 0) == s.attempt([hard], 4, 0)  # deterministic for a seed


def test_seed_file_errors(tmp_path):
    p = tmp_path / "s.jsonl"
    with pytest.raises(SeedError, match="does not exist"):
        load_seed_file(p)
    p.write_text("\n")
    with pytest.raises(SeedError, match="no seeds"):
        load_seed_file(p)
    p.write_text(json.dumps({"id": "a", "expression": "1+2"}) + "\n" + json.dumps({"id": "a", "expression": "3"}))
    with pytest.raises(SeedError, match="duplicated seed id 'a'.*line 1"):
        load_seed_file(p)
    p.write_text(json.dumps({"id": "a", "expression": "__import__('os')"}))
    with pytest.raises(SeedError, match="only non-negative integers"):
        load_seed_file(p)
    p.write_text("{not json")
    with pytest.raises(SeedError, match=":1: not JSON"):
        load_seed_file(p)
    p.write_text(json.dumps({"id": "a", "expression": "(1+2)*3"}))
    (t,) = load_seed_file(p)
    assert t.answer == "9" and t.seed_id == "a"


def test_tiny_model_solver_plumbing():
    """n answers per task, deterministic for a seed (a randomly initialised tiny Qwen3: plumbing only)."""
    import torch
    from treadle.models.tiny import TinyTrainConfig, build_model, build_tokenizer
    from treadle.rsi.solvers import Solver, TinyModelSolver

    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_model(TinyTrainConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                         intermediate_size=32), tok)
    s = TinyModelSolver(model=model, tokenizer=tok, max_new_tokens=4, batch_size=2)
    assert isinstance(s, Solver)
    texts = ["Compute 1+2.", "Solve 2*x+1=7 for x.", "Ann has 3 cats. Compute 4-9."]
    a = s.attempt(texts, 4, 0)
    assert len(a) == 3 and all(len(r) == 4 and all(isinstance(x, str) for x in r) for r in a)
    assert a == s.attempt(texts, 4, 0)
