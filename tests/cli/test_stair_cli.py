"""``treadle stair train / eval`` under the run rule: eval with no arguments, Ctrl-C says what was saved,
another config is refused, valid boundary values pass the option checks."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one quick tiny model for the module


@pytest.fixture(autouse=True)
def _env(cache, monkeypatch, one_thread):
    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    monkeypatch.setenv("COLUMNS", "300")


SMALL = ["--steps", "2", "--sessions", "4", "--batch-size", "2", "--turns", "2", "--threads", "1"]
EVAL_SMALL = ["--sessions", "2", "--turns", "2", "--k", "1", "--max-new-tokens", "2", "--threads", "1"]


def test_train_then_eval_with_no_arguments_and_the_run_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["stair", "train", "--quick", *SMALL])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "runs" / "stair-quick" / "normals.safetensors").exists()
    assert json.loads((tmp_path / "runs" / "stair-quick" / "run.json").read_text())["status"] == "finished"
    # eval with no arguments but the small sizes: finds the normals stair train wrote
    r = runner.invoke(app, ["stair", "eval", "--quick", *EVAL_SMALL, "--conditions", "native,stair"])
    assert r.exit_code == 0, r.output
    assert "runs/stair-quick/normals.safetensors" in r.output
    res = json.loads((tmp_path / "runs" / "stair-eval-quick" / "results.json").read_text())
    assert set(res["conditions"]) == {"native", "stair"} and not res["skipped"]
    # the same finished run: kept; more steps: continued; another config: refused
    r = runner.invoke(app, ["stair", "train", "--quick", *SMALL])
    assert r.exit_code == 0 and "already holds this finished run" in r.output, r.output
    r = runner.invoke(app, ["stair", "train", "--quick", *SMALL, "--lr", "0.1"])
    assert r.exit_code == 2 and "another config" in r.output and "--overwrite" in r.output, r.output
    more = [*SMALL]
    more[1] = "3"
    r = runner.invoke(app, ["stair", "train", "--quick", *more])
    assert r.exit_code == 0, r.output
    steps = [json.loads(x)["step"] for x in (tmp_path / "runs" / "stair-quick" / "log.jsonl").read_text().splitlines()
             if "step" in json.loads(x)]
    assert steps == [1, 2, 3]
    record = json.loads((tmp_path / "runs" / "stair-quick" / "run.json").read_text())
    assert record["status"] == "finished" and len(record["history"]) == 1  # the first run, then this resume


def test_eval_with_no_normals_anywhere_runs_the_conditions_that_need_none(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["stair", "eval", "--quick", *EVAL_SMALL])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "runs" / "stair-eval-quick" / "results.json").read_text())
    assert set(res["conditions"]) == {"vanilla", "native", "random"}
    assert set(res["skipped"]) == {"stair", "bank_free", "shuffled", "reflected"}


def test_ctrl_c_says_what_was_saved_and_how_to_resume(tmp_path, monkeypatch):
    import treadle.stair.training as tr

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tr, "train", interrupted)
    r = runner.invoke(app, ["stair", "train", "--quick", *SMALL, "--out", str(tmp_path / "run")])
    assert r.exit_code == 130, r.output
    assert "Interrupted. Saved: no checkpoint yet" in r.output and "to resume" in r.output
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("args", [
    ["train", "--eps", "0"], ["train", "--eps", "0.999"], ["train", "--turns", "2"], ["train", "--steps", "1"],
    ["train", "--lambda-kl", "0"], ["train", "--kind", "bank_free"], ["train", "--responses", "gold"],
    ["train", "--levels", "6"], ["train", "--threads", "0"], ["train", "--layers", "auto"],
    ["eval", "--temperature", "0"], ["eval", "--k", "1"], ["eval", "--turns", "2"], ["eval", "--budgets", "1", "--normals", "NORMALS"],
    ["eval", "--conditions", "vanilla"], ["eval", "--max-new-tokens", "1"],
])
def test_valid_boundary_values_pass_the_option_checks(tmp_path, args):
    import torch
    from safetensors.torch import save_file

    normals = tmp_path / "n.safetensors"
    save_file({"normals": torch.zeros(1, 2, 8)}, str(normals),
              metadata={"stair_config": json.dumps({"format": 1, "kind": "stair", "layers": [1]})})
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [str(normals) if a == "NORMALS" else a for a in args]
    r = runner.invoke(app, ["stair", *args, "--quick", "--out", str(afile)])
    assert r.exit_code == 2 and "--out" in r.output and "is a file" in r.output, r.output


@pytest.mark.parametrize("args,flag", [
    (["train", "--eps", "1"], "--eps"), (["train", "--lr", "0"], "--lr"), (["train", "--lambda-kl", "-1"], "--lambda-kl"),
    (["train", "--turns", "1"], "--turns"), (["train", "--kind", "x"], "--kind"), (["train", "--report-to", "x"],
                                                                                    "--report-to"),
    (["eval", "--temperature", "-0.1"], "--temperature"), (["eval", "--conditions", "nope"], "--conditions"),
    (["eval", "--levels", "7"], "--levels"),
    (["eval", "--conditions", "vanilla,native", "--normals", "n.safetensors"], "--normals: ignored here"),
    (["eval", "--conditions", "native,stair", "--bank-free", "b.safetensors"], "--bank-free: ignored here"),
    (["eval", "--conditions", "native", "--budgets", "16"], "--budgets: ignored here"),
    (["eval", "--budgets", "16"], "--budgets: ignored here"),  # no normals anywhere: no stair condition runs
])
def test_bad_values_name_the_flag(tmp_path, args, flag):
    r = runner.invoke(app, ["stair", *args, "--quick", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and flag in lines[0], r.output
    assert not (tmp_path / "run").exists()


def test_eval_prints_nothing_before_an_option_error(tmp_path, monkeypatch):
    """With the default normals of `stair train` present, ``stair eval --conditions nope`` printed the
    "normals: ..." line before the error: an error is the only line (checked before anything is said)."""
    import json as _json

    import torch
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "runs" / "stair-quick").mkdir(parents=True)
    save_file({"n": torch.zeros(1)}, str(tmp_path / "runs" / "stair-quick" / "normals.safetensors"),
              metadata={"stair_config": _json.dumps({"format": 1, "kind": "stair"})})
    r = CliRunner().invoke(app, ["stair", "eval", "--quick", "--conditions", "nope"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "--conditions" in lines[0], r.output
    assert not (tmp_path / "cache").exists()
