"""`treadle weft reverify | judge | filter` follow the run-folder rule of every command: results in a run folder
(`--out`; reverify and judge default to a sub-folder of the `weft sample` run) with a run.json; a finished run of
the same config is shown again without recomputing (judge: without calling the LLM), files byte-equal; another
config (another input file's SHA-256, another threshold) is one line naming --out with the differences, exit 2,
nothing touched; --overwrite replaces it; Ctrl-C says what was saved."""
import json
import shutil

import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.llm.fake_endpoint import FAKE_MODEL
from treadle.testing import assert_usage_error

CLOSE = "ada-3-close-ticket"
runner = CliRunner()


def weft(args):
    """``treadle weft <args>`` through the root CLI (usage errors print as one line, as in the shell)."""
    return runner.invoke(app, ["weft", *map(str, args)])


def _files(d):
    """Every file under ``d`` with its bytes (to compare a folder before and after)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _record(d):
    return json.loads((d / "run.json").read_text())


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    """A small `treadle weft sample` run (first shop task, replay policy with wrong arguments, k = 3)."""
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.tasks import from_shop

    d = tmp_path_factory.mktemp("sample")
    sample(d, from_shop()[:1], SampleConfig(policy=Component(name="replay", args={
        "rates": {"wrong_argument": 0.4}, "seed": 0}), ks=(3,), methods=("prefix", "end_to_end")))
    return d


@pytest.fixture
def run_dir(sample_run, tmp_path):
    """A private copy of the sample run (each test writes its own sub-folders)."""
    d = tmp_path / "run"
    shutil.copytree(sample_run, d)
    return d


# ------------------------------------------------------------------------------------------------ reverify
def _revision(path, version="v3", close=None):
    path.write_text(json.dumps({"version": version, "checkpoints": {CLOSE: close or {"forbidden_tools": []}}}))
    return path


def test_reverify_run_folder_rule(run_dir, tmp_path):
    rev = _revision(tmp_path / "rev.json")
    r = weft(["reverify", "--run", run_dir, "--revision", rev])
    assert r.exit_code == 0, r.output
    out = run_dir / "reverify-v3"  # the default: a sub-folder of the sample run
    rec = _record(out)
    assert rec["command"] == "weft reverify" and rec["status"] == "finished" and rec["ended"]
    assert rec["treadle_version"] and rec["machine"]["cpu_count"] and rec["argv"] and rec["started"]  # argv: sys.argv
    assert set(rec["config"]) == {"trajectories_sha256", "revision_sha256", "verifier_version"}
    rows = (out / "reverify-v3.jsonl").read_text().splitlines()
    assert rows and all(json.loads(x)["verifier_version"] == "v3" for x in rows)
    before = _files(run_dir)
    # same config: shown (the table), nothing recomputed or rewritten
    r = weft(["reverify", "--run", run_dir, "--revision", rev])
    assert r.exit_code == 0 and "already holds this finished" in r.output and "trajectories changed" in r.output
    assert "old r_k" in r.output  # the table
    assert _files(run_dir) == before
    # another revision file, same version: refused naming --out and what differs; nothing touched
    other = _revision(tmp_path / "rev2.json", close={"gold_calls": []})
    assert_usage_error(weft(["reverify", "--run", run_dir, "--revision", other]), "--out", "another config",
              "revision_sha256", "--overwrite")
    assert _files(run_dir) == before
    # another trajectories file: refused too
    traj = run_dir / "trajectories.jsonl"
    traj.write_text("".join(traj.read_text().splitlines(keepends=True)[:-1]))
    assert_usage_error(weft(["reverify", "--run", run_dir, "--revision", rev]), "--out", "trajectories_sha256")
    assert _files(out) == {k[len("reverify-v3/"):]: v for k, v in before.items() if k.startswith("reverify-v3/")}
    # --overwrite replaces it
    r = weft(["reverify", "--run", run_dir, "--revision", other, "--overwrite"])
    assert r.exit_code == 0, r.output
    rec2 = _record(out)
    assert rec2["config"]["revision_sha256"] != rec["config"]["revision_sha256"] and rec2["status"] == "finished"
    assert len((out / "reverify-v3.jsonl").read_text().splitlines()) == len(rows) - 1


def test_reverify_explicit_out_and_odd_versions(run_dir, tmp_path):
    rev = _revision(tmp_path / "rev.json", version="team/v 4")
    r = weft(["reverify", "--run", run_dir, "--revision", rev])
    assert r.exit_code == 0, r.output
    assert (run_dir / "reverify-team-v-4" / "reverify-team-v-4.jsonl").is_file()  # a safe folder and file name
    # the sample run folder itself is not a reverify run folder
    (run_dir / "run.json").write_text(json.dumps({"command": "weft sample", "config": {}, "status": "finished"}))
    assert_usage_error(weft(["reverify", "--run", run_dir, "--revision", rev, "--out", run_dir]), "--out", "weft sample")
    f = tmp_path / "file"
    f.write_text("x")
    assert_usage_error(weft(["reverify", "--run", run_dir, "--revision", rev, "--out", f]), "--out", "file")


# ------------------------------------------------------------------------------------------------ filter
EXEC = [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]


@pytest.fixture
def scores(tmp_path):
    rows = [{"task": "good", "judge": 0.9 if e else 0.1, "executable": e} for e in EXEC]
    rows += [{"task": "noisy", "judge": 1 - e, "executable": e} for e in EXEC]
    rows += [{"task": "broken", "executable": 1}] * 9
    p = tmp_path / "scores.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_filter_run_folder_rule(scores, tmp_path):
    out = tmp_path / "f"
    r = weft(["filter", "--scores", scores, "--out", out])
    assert r.exit_code == 0 and "kept 1 of 3 tasks" in r.output, r.output
    rec = _record(out)
    assert rec["command"] == "weft filter" and rec["status"] == "finished"
    assert rec["config"] == {"scores_sha256": rec["config"]["scores_sha256"], "min_pearson": 0.5,
                             "min_spearman": 0.5, "min_rollouts": 8, "confidence": 0.95}
    assert sorted(p.name for p in out.iterdir()) == ["filter.jsonl", "run.json"]
    before = _files(out)
    r = weft(["filter", "--scores", scores, "--out", out])
    assert r.exit_code == 0 and "already holds this finished" in r.output and "kept 1 of 3 tasks" in r.output
    assert "malformed" in r.output  # the table as first shown, reasons included
    assert _files(out) == before
    assert_usage_error(weft(["filter", "--scores", scores, "--out", out, "--min-pearson", "0.3"]), "--out", "another config",
              "min_pearson: 0.5 -> 0.3")
    assert _files(out) == before
    scores.write_text(scores.read_text() + json.dumps({"task": "new", "judge": 1, "executable": 1}) + "\n")
    assert_usage_error(weft(["filter", "--scores", scores, "--out", out]), "--out", "scores_sha256")
    assert _files(out) == before
    r = weft(["filter", "--scores", scores, "--out", out, "--min-pearson", "0.3", "--overwrite"])
    assert r.exit_code == 0 and "kept 1 of 4 tasks" in r.output, r.output
    assert _record(out)["config"]["min_pearson"] == 0.3
    assert {json.loads(x)["task"] for x in (out / "filter.jsonl").read_text().splitlines()} == {
        "good", "noisy", "broken", "new"}


def test_filter_old_file_form_and_no_out(scores, tmp_path):
    line = assert_usage_error(weft(["filter", "--scores", scores, "--out", tmp_path / "d.jsonl"]), "--out", "give a folder")
    assert str(tmp_path / "d") in line and not (tmp_path / "d.jsonl").exists() and not (tmp_path / "d").exists()
    assert_usage_error(weft(["filter", "--scores", scores, "--overwrite"]), "--overwrite", "--out")
    before = _files(tmp_path)
    r = weft(["filter", "--scores", scores])  # no --out: the table only, nothing written
    assert r.exit_code == 0 and "kept 1 of 3 tasks" in r.output
    assert _files(tmp_path) == before


def test_filter_ctrl_c_says_what_was_saved(scores, tmp_path, monkeypatch):
    import treadle.weft.evolve.filtering as filtering

    real = filtering.filter_tasks

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(filtering, "filter_tasks", interrupted)
    out = tmp_path / "f"
    r = weft(["filter", "--scores", scores, "--out", out])
    assert r.exit_code == 130 and "Interrupted. Saved: nothing" in r.output, r.output
    assert _record(out)["status"] == "interrupted" and not (out / "filter.jsonl").exists()
    monkeypatch.setattr(filtering, "filter_tasks", real)
    r = weft(["filter", "--scores", scores, "--out", out])  # same config: runs again in the same folder
    assert r.exit_code == 0 and "kept 1 of 3 tasks" in r.output and _record(out)["status"] == "finished"


# ------------------------------------------------------------------------------------------------ judge
def _answer_all_good(req):
    body = json.loads(req["messages"][1]["content"])
    return json.dumps({"scores": [1.0] * len(body["rubric"]), "reason": "."})


def _llm_toml(path, fake, extra=""):
    path.write_text(f'[roles.judge]\nmodel = "{FAKE_MODEL}"\nbase_url = "{fake.base_url}"\nmax_retries = 0\n{extra}')
    return path


def test_judge_run_folder_rule(fake, run_dir, tmp_path):
    fake.responder = _answer_all_good
    cfg = _llm_toml(tmp_path / "llm.toml", fake)
    r = weft(["judge", "--run", run_dir, "--llm-config", cfg, "--min-rollouts", "3"])
    assert r.exit_code == 0, r.output
    calls = len(fake.requests)
    assert calls > 0
    out = run_dir / "judge"  # the default: a sub-folder of the sample run
    assert {"run.json", "judge-scores.jsonl", "filter.jsonl", "llm_cache.sqlite", "llm_ledger.jsonl"} <= \
        {p.name for p in out.iterdir()}
    rec = _record(out)
    assert rec["command"] == "weft judge" and rec["status"] == "finished"
    assert set(rec["config"]) == {"trajectories_sha256", "llm_config_sha256", "role", "min_pearson", "min_spearman",
                                  "min_rollouts", "confidence"}
    assert len((out / "judge-scores.jsonl").read_text().splitlines()) == calls
    before = _files(run_dir)
    # same config: the table again, no judge call, nothing rewritten
    r = weft(["judge", "--run", run_dir, "--llm-config", cfg, "--min-rollouts", "3"])
    assert r.exit_code == 0 and "already holds this finished" in r.output and "spearman" in r.output
    assert f"{calls} pilot rollouts judged" in r.output
    assert len(fake.requests) == calls and _files(run_dir) == before
    # other thresholds, or another LLM config: refused naming --out and the differences, nothing touched
    assert_usage_error(weft(["judge", "--run", run_dir, "--llm-config", cfg, "--min-rollouts", "4"]), "--out",
              "another config", "min_rollouts: 3 -> 4")
    cfg2 = _llm_toml(tmp_path / "llm2.toml", fake, extra="# another file, the same judge\n")
    assert_usage_error(weft(["judge", "--run", run_dir, "--llm-config", cfg2, "--min-rollouts", "3"]), "--out",
              "llm_config_sha256")
    assert len(fake.requests) == calls and _files(run_dir) == before
    # --overwrite with other thresholds only: replaced, the LLM cache kept (the judge is not paid again)
    r = weft(["judge", "--run", run_dir, "--llm-config", cfg, "--min-rollouts", "4", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert len(fake.requests) == calls and _record(out)["config"]["min_rollouts"] == 4
    assert (out / "filter.jsonl").is_file() and (out / "llm_cache.sqlite").is_file()
    assert _record(out)["started"] >= rec["started"] and not list(run_dir.glob(".treadle-judge-cache-*"))
    assert len((out / "judge-scores.jsonl").read_text().splitlines()) == calls
    # --overwrite with another LLM config: the cache goes with the old run, the judge is called again
    r = weft(["judge", "--run", run_dir, "--llm-config", cfg2, "--min-rollouts", "4", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert len(fake.requests) == 2 * calls and _record(out)["config"]["llm_config_sha256"] != \
        rec["config"]["llm_config_sha256"]


def test_judge_refusals_touch_nothing(fake, run_dir, tmp_path):
    fake.responder = _answer_all_good
    cfg = _llm_toml(tmp_path / "llm.toml", fake)
    out = tmp_path / "j"
    assert weft(["judge", "--run", run_dir, "--llm-config", cfg, "--out", out]).exit_code == 0
    calls, before = len(fake.requests), _files(out)
    traj = run_dir / "trajectories.jsonl"  # the sample run changed since (resumed with more, say)
    traj.write_text("".join(traj.read_text().splitlines(keepends=True)[:-1]))
    assert_usage_error(weft(["judge", "--run", run_dir, "--llm-config", cfg, "--out", out]), "--out", "trajectories_sha256")
    assert_usage_error(weft(["judge", "--run", run_dir, "--llm-config", cfg, "--out", out, "--role", "judge",
                    "--confidence", "0.9"]), "--out", "confidence")
    assert len(fake.requests) == calls and _files(out) == before
    f = tmp_path / "file"
    f.write_text("x")
    assert_usage_error(weft(["judge", "--run", run_dir, "--llm-config", cfg, "--out", f]), "--out", "file")


def test_judge_ctrl_c_says_what_was_saved(fake, run_dir, tmp_path, monkeypatch):
    import treadle.weft.evolve.judge as judge

    async def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(judge, "pilot_scores", interrupted)
    cfg = _llm_toml(tmp_path / "llm.toml", fake)
    r = weft(["judge", "--run", run_dir, "--llm-config", cfg])
    assert r.exit_code == 130 and "Interrupted. Saved:" in r.output and "llm_cache.sqlite" in r.output, r.output
    assert _record(run_dir / "judge")["status"] == "interrupted"
