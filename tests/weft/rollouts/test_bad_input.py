"""``sample`` bad input found in review: a run folder that cannot be one, a broken config.json,
a model config or role that is wrong, an unreachable endpoint. One line naming the flag, exit 2, before any
rollout; the user's files untouched."""
import pytest
from typer.testing import CliRunner

from treadle.weft.rollouts.batch import RunDirError, check_run_dir
from treadle.weft.rollouts.cli import app

runner = CliRunner()


def _err(args, flag):
    r = runner.invoke(app, ["sample", *map(str, args)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {flag}:"), r.output
    return lines[0]


def test_check_run_dir(tmp_path):
    f = tmp_path / "f"
    f.write_text("mine")
    with pytest.raises(RunDirError, match="is a file"):
        check_run_dir(f)
    with pytest.raises(RunDirError, match="is a file"):
        check_run_dir(f / "sub")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text("[1]")
    with pytest.raises(RunDirError, match="not a JSON object"):
        check_run_dir(tmp_path / "r")
    assert check_run_dir(tmp_path / "new") == tmp_path / "new" and not (tmp_path / "new").exists()


def test_cli_run_dir_and_llm_config(tmp_path):
    f = tmp_path / "f"
    f.write_text("mine")
    assert "is a file" in _err([f], "RUN_DIR")
    assert f.read_text() == "mine"
    r = tmp_path / "r"
    r.mkdir()
    (r / "config.json").write_text("{bad")
    assert "not a readable JSON config" in _err([r], "RUN_DIR")
    assert (r / "config.json").read_text() == "{bad" and sorted(p.name for p in r.iterdir()) == ["config.json"]
    run = tmp_path / "run"
    assert "not found" in _err([run, "--policy", "llm", "--llm-config", tmp_path / "nope.toml"], "--llm-config")
    bad = tmp_path / "bad.toml"
    bad.write_text("[roles")
    assert "cannot parse" in _err([run, "--policy", "llm", "--llm-config", bad], "--llm-config")
    cfg = tmp_path / "m.toml"
    cfg.write_text('[roles.judge]\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')  # nothing listens on 9
    assert "['judge']" in _err([run, "--policy", "llm", "--llm-config", cfg], "--role")
    assert "only the llm policy" in _err([run, "--llm-config", cfg], "--llm-config")
    assert "cannot reach" in _err([run, "--policy", "llm", "--llm-config", cfg, "--role", "judge"], "--llm-config")
    assert not run.exists()


def test_resume_after_a_torn_last_line_redoes_only_that_rollout(tmp_path):
    import json

    args = ["sample", str(tmp_path), "--k", "1", "--k", "2", "--method", "prefix", "--no-sft"]
    assert runner.invoke(app, args).exit_code == 0
    p = tmp_path / "trajectories.jsonl"
    lines = p.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    p.write_text("".join(lines[:3]) + lines[3][:40])  # killed mid-write
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in p.read_text().splitlines()]  # every line whole again
    assert len(rows) == 4 and len({x["key"] for x in rows}) == 4
    assert p.read_text().splitlines(keepends=True)[:3] == lines[:3]  # earlier rollouts kept as they were


@pytest.mark.parametrize("args, flag", [
    (["--replicas", "100000000"], "--replicas"),
    (["--replicas", "0"], "--replicas"),
    (["--concurrency", "100000000"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--k", "100000000"], "--k"),
])
def test_huge_and_zero_counts(tmp_path, args, flag):
    _err([tmp_path / "run", *args], flag)
    assert not (tmp_path / "run").exists()


def test_resume_with_other_concurrency(tmp_path):
    args = ["sample", str(tmp_path), "--k", "1", "--method", "prefix", "--no-sft"]
    assert runner.invoke(app, [*args, "--concurrency", "1"]).exit_code == 0
    r = runner.invoke(app, [*args, "--concurrency", "3"])
    assert r.exit_code == 0, r.output
    assert len((tmp_path / "trajectories.jsonl").read_text().splitlines()) == 2
    r = runner.invoke(app, [*args[:-3], "--k", "2", "--method", "prefix", "--no-sft"])
    assert r.exit_code == 2 and "ks: [1] -> [1, 2]" in r.output and "--overwrite" in r.output  # run.json's rule


def test_cli_policy_rates_and_run_folder_flag(tmp_path):
    """``--policy hf`` (a Python-API policy) is refused, not a TypeError traceback; a --rate given twice or
    with a policy that ignores rates is refused; the run-folder error names the flag that was used."""
    run = tmp_path / "run"
    assert "'hf' is a Python-API policy" in _err([run, "--policy", "hf"], "--policy")
    assert "given twice (0.5 and 0.6)" in _err([run, "--rate", "wrong_argument=0.5", "--rate", "wrong_argument=0.6"],
                                               "--rate")
    cfg = tmp_path / "m.toml"
    cfg.write_text('[roles.policy]\nmodel = "m"\nbase_url = "http://127.0.0.1:9/v1"\n')
    assert "apply to --policy replay only" in _err([run, "--policy", "llm", "--llm-config", cfg, "--rate",
                                                    "wrong_argument=0.1"], "--rate")
    assert not run.exists()
    f = tmp_path / "f"
    f.write_text("mine")
    assert "is a file" in _err(["--out", f], "--out")
    assert f.read_text() == "mine"
