"""`treadle weft reverify`: stored rollouts re-scored with a revised verifier, without new rollouts."""
import json

import anyio
import pytest
from typer.testing import CliRunner

from treadle.cli import app
from treadle.weft.evolve.reverify import VerifierRevision, load_revision, reverify
from treadle.weft.rollouts.batch import ENVS, Component, SampleConfig, sample
from treadle.weft.rollouts.tasks import from_shop

CLOSE = "ada-3-close-ticket"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    cfg = SampleConfig(policy=Component(name="replay", args={"rates": {"wrong_argument": 0.3}, "seed": 1}),
                       methods=("prefix", "end_to_end"), ks=(1, 2), concurrency=2)
    return d, sample(d, from_shop(), cfg)


def _rescore(trajs, rev):
    return anyio.run(lambda: reverify(trajs, from_shop(), rev, ENVS))


def test_unrevised_verifier_reproduces_the_stored_rewards(run):
    _, trajs = run
    rows = _rescore(trajs, VerifierRevision(version="same", checkpoints={}))
    assert len(rows) == len(trajs) >= 8
    for r, t in zip(rows, trajs):
        assert r.new_rewards == r.old_rewards and r.old_rewards[:len(t.rewards)] == t.rewards, t.task
    assert any(r.old_reward < 1 for r in rows) and any(r.old_reward == 1 for r in rows)
    assert sum(r.replayed_calls for r in rows) > 0


def test_a_revision_changes_only_its_checkpoint(run):
    _, trajs = run
    wrong = {"assertions": [{"sql": "SELECT id, status FROM tickets ORDER BY id", "expected": [[1, "open"]]}]}
    rows = _rescore(trajs, VerifierRevision(version="v2", checkpoints={CLOSE: wrong}))
    names = [a.name for a in from_shop()[0].ordered()]
    k = names.index(CLOSE)
    changed = [r for r in rows if r.changed]
    assert changed and all(r.verifier_version == "v2" for r in rows)
    for r in changed:
        diff = [i for i, (a, b) in enumerate(zip(r.old_rewards, r.new_rewards)) if a != b]
        assert diff == [k] and r.old_rewards[k] == 1 and r.new_rewards[k] == 0


def test_bad_revisions_are_refused_before_any_work(tmp_path, run):
    d, _ = run
    known = [a.name for t in from_shop() for a in t.atomic]
    cases = {"notjson": "{", "shape": json.dumps({"checkpoints": {}}),
             "unknown": json.dumps({"version": "x", "checkpoints": {"nope": {}}}),
             "field": json.dumps({"version": "x", "checkpoints": {CLOSE: {"predicates": []}}}),
             "value": json.dumps({"version": "x", "checkpoints": {CLOSE: {"gold_calls": ["not a call("]}}})}
    for name, text in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        with pytest.raises(ValueError, match=str(p)):
            load_revision(p, known)
        res = CliRunner().invoke(app, ["weft", "reverify", "--run", str(d), "--revision", str(p)])
        assert res.exit_code == 2 and "--revision" in res.output and len(res.output.strip().splitlines()) == 1, \
            (name, res.output)
    assert not list(d.glob("reverify-*"))  # no run folder made, nothing written
    res = CliRunner().invoke(app, ["weft", "reverify", "--run", str(tmp_path), "--revision", str(p)])
    assert res.exit_code == 2 and "--run" in res.output


def test_cli_writes_the_rescores(tmp_path, run):
    d, trajs = run
    p = tmp_path / "rev.json"
    p.write_text(json.dumps({"version": "v3", "checkpoints": {CLOSE: {"forbidden_tools": []}}}))
    out = tmp_path / "rv"  # a run folder (run.json + reverify-<version>.jsonl); default <run>/reverify-<version>/
    res = CliRunner().invoke(app, ["weft", "reverify", "--run", str(d), "--revision", str(p), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    lines = (out / "reverify-v3.jsonl").read_text().splitlines()
    assert len(lines) == len(trajs) and json.loads(lines[0])["verifier_version"] == "v3"
