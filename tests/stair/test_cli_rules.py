"""``treadle stair train/eval`` under the CLI rules: an option that would be ignored is an error (--quick with a
checkpoint from --model or $TREADLE_MODEL; a condition asked for by name that could not run), --no-resume never
replaces a run without --overwrite, and errors about weights files name the flag (--normals, --layers,
--bank-free). Each error: one line, exit 2, before the model is loaded where the check does not need it,
nothing written."""
import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from treadle.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--steps", "2", "--sessions", "4", "--batch-size", "2", "--turns", "2", "--threads", "1"]
EVAL_SMALL = ["--sessions", "2", "--turns", "2", "--k", "1", "--max-new-tokens", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")  # one quick tiny model for the module


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/stair-quick here: eval picks no default normals
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))  # tests that load a model use `cache`
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    monkeypatch.setenv("COLUMNS", "300")


def _refused(args, *words, out=None):
    from treadle.testing import assert_usage_error

    line = assert_usage_error(CliRunner().invoke(app, ["stair", *args]), *words)
    if out is not None:
        assert not out.exists(), "a refused command wrote its run folder"
    return line


@pytest.fixture(scope="module")
def finished(cache, tmp_path_factory):
    """A finished 2-step STAIR run (quick tiny model)."""
    out = tmp_path_factory.mktemp("stair") / "s1"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TREADLE_CACHE", str(cache))
        mp.delenv("TREADLE_MODEL", raising=False)
        n = torch.get_num_threads()
        r = CliRunner().invoke(app, ["stair", "train", "--quick", *SMALL, "--out", str(out)])
        torch.set_num_threads(n)
    assert r.exit_code == 0, r.output
    return out


def _files(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ --quick with a checkpoint
@pytest.mark.parametrize("cmd", ["train", "eval"])
def test_quick_with_model_is_refused_before_loading(cmd, tmp_path):
    line = _refused([cmd, "--quick", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o")],
                    "--quick", "--model", "ignored", out=tmp_path / "o")
    assert "quick tiny model" in line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cmd", ["train", "eval"])
def test_quick_with_treadle_model_set_is_refused(cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    _refused([cmd, "--quick", "--out", str(tmp_path / "o")], "--quick", "$TREADLE_MODEL", "'/bad'",
             out=tmp_path / "o")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cmd", ["train", "eval"])
def test_treadle_model_without_quick_is_used_and_checked(cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    _refused([cmd, "--out", str(tmp_path / "o")], "$TREADLE_MODEL", "/bad", "does not exist", out=tmp_path / "o")


# ------------------------------------------------------------------ eval: conditions that cannot run
@pytest.mark.parametrize("conditions,flag,words", [
    ("", "--conditions", ["no condition given"]),
    (" , ", "--conditions", ["no condition given"]),
    ("stair", "--normals", ["stair", "need trained normals"]),
    ("native,shuffled,reflected", "--normals", ["shuffled, reflected"]),
    ("vanilla,bank_free", "--bank-free", ["bank_free"]),
])
def test_eval_named_conditions_that_cannot_run_are_errors(conditions, flag, words, tmp_path):
    _refused(["eval", "--quick", *EVAL_SMALL, "--conditions", conditions, "--out", str(tmp_path / "e")],
             flag, *words, out=tmp_path / "e")
    assert not (tmp_path / "cache").exists()  # before the model is loaded


# ------------------------------------------------------------------ --no-resume
def test_no_resume_never_replaces_a_run_without_overwrite(finished, cache, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    before = _files(finished)
    for extra in (["--lr", "0.5", "--steps", "4"], ["--steps", "4"], []):  # another config, more steps, the same
        line = _refused(["train", "--quick", *SMALL, *extra, "--no-resume", "--out", str(finished)], "--out")
        assert "--overwrite" in line
    assert _files(finished) == before  # untouched


def test_no_resume_with_overwrite_trains_again(finished, cache, monkeypatch, tmp_path):
    import shutil

    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    r = CliRunner().invoke(app, ["stair", "train", "--quick", *SMALL, "--no-resume", "--overwrite", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["history"] == []  # a new run, not a resume


def test_no_resume_on_a_new_folder_trains(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    r = CliRunner().invoke(app, ["stair", "train", "--quick", *SMALL, "--no-resume", "--out", str(tmp_path / "n")])
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------ weights files: errors name the flag
def test_layers_that_differ_from_the_normals_name_both_flags(finished, tmp_path):
    normals = finished / "normals.safetensors"
    line = _refused(["eval", "--quick", *EVAL_SMALL, "--layers", "1", "--normals", str(normals), "--conditions",
                     "stair", "--out", str(tmp_path / "e")], "--layers", "--normals", "[0, 1]", out=tmp_path / "e")
    assert "give --layers 0,1" in line
    assert not (tmp_path / "cache").exists()  # checked from the file, before the model is loaded


def _weights(path, kind, layers, shape):
    name = "normals" if kind == "stair" else "bias"
    save_file({name: torch.zeros(*shape)}, str(path),
              metadata={"stair_config": json.dumps({"format": 1, "kind": kind, "layers": layers})})
    return path


def test_normals_and_bank_free_of_other_layers_are_refused(tmp_path):
    n = _weights(tmp_path / "n.safetensors", "stair", [0, 1], (2, 2, 16))
    b = _weights(tmp_path / "b.safetensors", "bank_free", [1], (1, 2, 16))
    _refused(["eval", "--quick", *EVAL_SMALL, "--normals", str(n), "--bank-free", str(b), "--conditions",
              "stair,bank_free", "--out", str(tmp_path / "e")], "--bank-free", "[1]", "[0, 1]", out=tmp_path / "e")
    assert not (tmp_path / "cache").exists()


def test_layers_auto_is_checked_against_the_normals_once_resolved(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    n = _weights(tmp_path / "n.safetensors", "stair", [1], (1, 2, 16))
    _refused(["eval", "--quick", *EVAL_SMALL, "--layers", "auto", "--normals", str(n), "--conditions", "stair",
              "--out", str(tmp_path / "e")], "--layers", "--normals", "give --layers 1", out=tmp_path / "e")


def test_normals_that_do_not_fit_the_model_fail_before_the_run(cache, monkeypatch, tmp_path):
    """Weights of another shape (another model) were found midway through the evaluation, after the vanilla and
    native conditions had run, in a message without the flag: now before the run starts, naming --normals."""
    monkeypatch.setenv("TREADLE_CACHE", str(cache))
    n = _weights(tmp_path / "n.safetensors", "stair", [0, 1], (2, 7, 5))
    line = _refused(["eval", "--quick", *EVAL_SMALL, "--normals", str(n), "--conditions", "native,stair",
                     "--out", str(tmp_path / "e")], "--normals", "does not fit the model", "quick tiny model",
                    out=tmp_path / "e")
    assert str(n) in line
