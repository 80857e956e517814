"""``treadle weft evolve --synth DIR --tasks FILE [--backend FILE] [--llm-config CFG]``: the backend-revision role
reached from the CLI (the fake OpenAI-compatible endpoint on 127.0.0.1, no network), offline restoration, and
one-line errors (exit 2, the flag named, nothing written) for bad input and bad role configs."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.llm.fake_endpoint import FAKE_MODEL, Step, chat_reply

pytestmark = pytest.mark.usefixtures("sandbox")

ARGS = ["--rate", "wrong_argument=0", "--k", "1", "--max-rounds", "2"]


def _said(text):
    return Step(body=chat_reply(text, FAKE_MODEL))


@pytest.fixture
def inputs(tmp_path, S):
    """``(synth folder 'library', tasks file, broken backend file)``: the certified library artefacts (fixed backend),
    the tasks LEND and ADD, and the deliberately broken backend now served."""
    synth = tmp_path / "library"
    synth.mkdir()
    (synth / "result.json").write_text(S.result().model_dump_json(by_alias=True), encoding="utf-8")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"name": t.name, "request": t.request, "gold": [
        {"name": c.name, "arguments": c.arguments} for c in t.checkpoint.gold_calls]}) + "\n" for t in (S.LEND, S.ADD)))
    broken = tmp_path / "broken.py"
    broken.write_text(S.BROKEN, encoding="utf-8")
    return synth, tasks, broken


def _cfg(path, roles, base_url="http://127.0.0.1:9/v1"):
    path.write_text("".join(f'[roles.{r}]\nmodel = "{FAKE_MODEL}"\nbase_url = "{base_url}"\nmax_retries = 0\n'
                            for r in roles))
    return path


def _evolve(*args):
    return CliRunner().invoke(app, ["weft", "evolve", *args])


def test_the_backend_role_repairs_a_broken_synthesised_backend_from_the_cli(fake, inputs, tmp_path, S):
    synth, tasks, broken = inputs
    fake.script = [_said("I would mark the book out in lend_book."),  # malformed: recorded, re-asked
                   _said("```json\n" + json.dumps({"source": S.FIXED}) + "\n```")]
    cfg = _cfg(tmp_path / "llm.toml", ("backend", "grounder", "verifier"), fake.base_url)
    out = tmp_path / "o"
    res = _evolve("--synth", str(synth), "--tasks", str(tasks), "--backend", str(broken), "--llm-config", str(cfg),
                  "--out", str(out), *ARGS)
    assert res.exit_code == 0, res.output
    assert "synthesised environment library" in res.output
    assert "round 1: backend:library (backend, answer 1): rejected: malformed answer" in res.output
    assert "round 1: backend:library (backend, answer 2): accepted" in res.output
    assert "backend revised" in res.output
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["blamed"] == rounds[0]["revised"] == ["backend:library"]
    assert rounds[0]["revalidated"] == {"lend-emma": True, "add-dune": True}
    assert [(r["passed"], r["tasks"]) for r in rounds] == [(1, 2), (2, 2)]  # add-dune passed before; lend after
    [att] = [json.loads(x) for x in (out / "attributions.jsonl").read_text().splitlines()]
    assert (att["checkpoint"], att["blame"], att["rule"]) == ("lend-emma", "environment", "reference_differs")
    assert (out / "backend.py").read_text() == S.FIXED
    assert json.loads((out / "result.json").read_text())["backend"]["source"] == S.FIXED
    assert len(fake.requests) == 2
    asked = json.loads(fake.bodies[0]["messages"][1]["content"])
    assert asked["component"] == "backend:library" and asked["current"]["source"] == S.BROKEN


def test_offline_the_certified_backend_is_restored(inputs, tmp_path, S):
    synth, tasks, broken = inputs
    out = tmp_path / "o"
    res = _evolve("--synth", str(synth), "--tasks", str(tasks), "--backend", str(broken), "--out", str(out), *ARGS)
    assert res.exit_code == 0, res.output
    rounds = [json.loads(x) for x in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["revised"] == ["backend:library"] and rounds[0]["revisions"] == []
    assert [r["passed"] for r in rounds] == [1, 2] and (out / "backend.py").read_text() == S.FIXED


def test_bad_input_and_role_configs_are_one_line_exit_2_before_any_work(inputs, tmp_path, S):
    synth, tasks, broken = inputs
    out = tmp_path / "o"
    notacc = tmp_path / "notacc"
    notacc.mkdir()
    (notacc / "result.json").write_text(S.result(accepted=False).model_dump_json(by_alias=True))
    unknown_tool = tmp_path / "t1.jsonl"
    unknown_tool.write_text(json.dumps({"name": "x", "request": "r", "gold": [{"name": "burn_book", "arguments": {}}]}))
    bad_line = tmp_path / "t2.jsonl"
    bad_line.write_text(tasks.read_text() + '{"name": "y", "request": "r"}\n')
    read_only = tmp_path / "t3.jsonl"
    read_only.write_text(json.dumps({"name": "list", "request": "Which books?", "gold": [{"name": "list_books"}]}))
    only_task_roles = _cfg(tmp_path / "a.toml", ("grounder", "verifier"))
    no_roles = _cfg(tmp_path / "b.toml", ("policy",))
    broken_toml = tmp_path / "c.toml"
    broken_toml.write_text("[roles.backend\nmodel = 1\n")
    base = ["--synth", str(synth), "--tasks", str(tasks), "--out", str(out)]
    cases = [
        (["--tasks", str(tasks), "--out", str(out)], "--tasks", "only with --synth"),
        (["--backend", str(broken), "--out", str(out)], "--backend", "only with --synth"),
        (["--synth", str(synth), "--out", str(out)], "--tasks", "required with --synth"),
        (["--synth", str(tmp_path / "none"), "--tasks", str(tasks)], "--synth", "is not a folder"),
        (["--synth", str(tmp_path), "--tasks", str(tasks)], "--synth", "holds no readable result.json"),
        (["--synth", str(notacc), "--tasks", str(tasks)], "--synth", "was not accepted"),
        (["--synth", str(synth), "--tasks", str(unknown_tool)], "--tasks",
         "task 'x': unknown tool(s) ['burn_book']"),
        (["--synth", str(synth), "--tasks", str(bad_line)], "--tasks", "task 3: gold: Field required"),
        (["--synth", str(synth), "--tasks", str(read_only), "--out", str(out)], "--tasks",
         "task 'list' does not certify on the synthesised environment: initial_fails"),
        ([*base, "--backend", str(tmp_path / "nope.py")], "--backend", "cannot read"),
        ([*base, "--llm-config", str(only_task_roles)], "--llm-config",
         "no role(s) ['backend'] in " + repr(str(only_task_roles)) + "; expected backend and grounder and verifier"),
        ([*base, "--llm-config", str(no_roles)], "--llm-config", "no role(s) ['backend', 'grounder', 'verifier']"),
        ([*base, "--llm-config", str(tmp_path / "missing.toml")], "--llm-config", ""),
        ([*base, "--llm-config", str(broken_toml)], "--llm-config", ""),
    ]
    for args, flag, msg in cases:
        res = _evolve(*args)
        assert res.exit_code == 2, (args, res.output)
        assert res.output.startswith(f"Error: {flag}: ") and msg in res.output, (args, res.output)
        assert res.output.count("\n") == 1, res.output  # one line
    assert not out.exists()
