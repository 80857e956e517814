"""Scripted Director / generator / Meta roles (``treadle rsi llm --scripted-roles``): valid rewrites with
exact references, the offline Director's rules, and a CLI run whose only model is the solver."""
from __future__ import annotations

import json
import random
import re

import pytest
import sympy
from typer.testing import CliRunner

from treadle.cli import app
from treadle.llm.fake_endpoint import FakeEndpoint
from treadle.rsi.scripted_roles import rewrite, scripted_reply
from treadle.rsi.verifier import check_task


@pytest.mark.parametrize("skill", ["add_term", "widen_digits", "nest", "induced_x"])
def test_rewrites_are_valid_tasks_whose_reference_the_verifier_confirms(skill):
    for i, e in enumerate(["0+5", "1-5", "(3+1)*4", "7"]):
        new = rewrite(e, skill, random.Random(i))
        assert new != e
        ans = str(sympy.sympify(new))
        assert check_task(f"Compute {new}.", ans).valid
        if skill == "nest":
            assert sympy.sympify(new) == sympy.sympify(e) and new.count("(") == e.count("(") + 1


def _director(state, lib=("a", "b"), target=0.0):
    body = json.dumps({"library": [{"name": n} for n in lib], "workflow": {"target_accuracy": target},
                       "state": state}) + "\nAnswer with JSON"
    return json.loads(scripted_reply({"model": "scripted-director", "messages": [{"role": "user", "content": body}]}))


def test_director_rules():
    base = {"round": 1, "steps": 0, "max_steps": 6, "extends": 0, "max_extends": 2, "pending_unverified": False,
            "last_invalid": False, "last_accuracy": None}
    assert _director({**base, "last_invalid": True})["step"] == "revise"
    assert _director({**base, "pending_unverified": True})["step"] == "verify"
    assert _director({**base, "last_accuracy": 0.0})["step"] == "finish"
    assert _director(base) == {"step": "extend", "skill": "b", "reason": "harder"}  # round 1 starts at skill 1
    assert _director({**base, "extends": 2})["step"] == "finish"
    assert scripted_reply({"model": "other", "messages": []}) == 404


def test_cli_run_with_scripted_roles_and_the_solver_on_an_endpoint(tmp_path):
    def solver(req):  # right on one operation, wrong beyond: a known capability limit
        e = re.fullmatch(r"Compute (.+)\.", req["messages"][-1]["content"]).group(1)
        v = sympy.sympify(e)
        return str(v if len(re.findall(r"[-+*]", e.lstrip("-"))) <= 1 else v + 1)

    with FakeEndpoint(models=("solver",), responder=solver) as ep:
        cfg = tmp_path / "solver.toml"
        cfg.write_text(f'[roles.solver]\nmodel = "solver"\nbase_url = "{ep.base_url}"\nmax_retries = 0\n')
        seeds = tmp_path / "seeds.jsonl"
        seeds.write_text("".join(json.dumps({"id": f"q{i}", "expression": e}) + "\n"
                                 for i, e in enumerate(["2+3", "4-1", "6+2"])))
        args = ["rsi", "llm", "--out", str(tmp_path / "run"), "--llm-config", str(cfg), "--scripted-roles",
                "--solver-prompt", "", "--seed-file", str(seeds), "--rounds", "2", "--no-post-batch"]
        res = CliRunner().invoke(app, args)
        bodies = ep.bodies
    assert res.exit_code == 0, res.output
    assert all(b["messages"][0]["role"] == "user" for b in bodies)  # --solver-prompt '': no system message
    assert "| math | 0 | 3 | 0 | 1.000 |" in res.output  # the seeds: one operation each
    assert "| math | 1 | 3 | 0 | 0.000 |" in res.output  # every chain extended past the solver's limit
    summ = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [r["mean_steps"] for r in summ["curve"]][0] == 0.0 and summ["curve"][1]["mean_steps"] >= 1.0
    assert (tmp_path / "run" / "curve.png").stat().st_size > 1000


def test_cli_scripted_roles_bad_input_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "solver.toml"
    cfg.write_text('[roles.solver]\nmodel = "solver"\nbase_url = "http://127.0.0.1:9/v1"\n')
    res = CliRunner().invoke(app, ["rsi", "llm", "--out", str(tmp_path / "r"), "--llm-config", str(cfg),
                                   "--scripted-roles", "--domain", "code"])
    assert res.exit_code == 2 and "--scripted-roles" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(app, ["rsi", "llm", "--out", str(tmp_path / "r"), "--llm-config", str(cfg),
                                   "--scripted-roles", "--answer-check", "sympy"])
    assert res.exit_code == 2 and "--answer-check" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(app, ["rsi", "run", "--out", str(tmp_path / "r"), "--answer-check", "nope"])
    assert res.exit_code == 2 and "--answer-check" in res.output
    res = CliRunner().invoke(app, ["rsi", "llm", "--out", str(tmp_path / "r"), "--llm-config", str(cfg)])
    assert res.exit_code == 2 and "--llm-config" in res.output and "director" in res.output
    assert not (tmp_path / "r").exists()
