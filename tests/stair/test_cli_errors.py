"""Bad input to ``treadle stair train/eval``: one clear line naming the option, exit 2, before any work
(no model loaded, no --out folder created), never a traceback."""
import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from treadle.cli import app
from treadle.stair.controller import NormalsFileError, read_normals_config


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")
    runner = CliRunner()

    def invoke(*args):
        r = runner.invoke(app, ["stair", *args])
        assert r.exit_code == 2, r.output
        assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit), repr(r.exception)
        assert "Traceback" not in r.output
        assert not (tmp_path / "cache").exists(), "the model was loaded before the input was checked"
        return " ".join(r.output.split())
    return invoke


def _scale_like(path):
    save_file({"gate": torch.zeros(3)}, str(path), metadata={"format": "treadle-scale-gates-1", "config": "{}"})
    return path


def _truncated(path):
    save_file({"normals": torch.randn(2, 4, 16)}, str(path),
              metadata={"stair_config": json.dumps({"format": 1, "kind": "stair", "layers": [1]})})
    path.write_bytes(path.read_bytes()[:100])
    return path


def test_read_normals_config_rejects_non_normals(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_normals_config(tmp_path / "nope.safetensors")
    with pytest.raises(NormalsFileError, match="is not a STAIR normals file"):
        read_normals_config(_scale_like(tmp_path / "gates.safetensors"))
    with pytest.raises(NormalsFileError, match="is not a STAIR normals file.*safetensors"):
        read_normals_config(_truncated(tmp_path / "cut.safetensors"))
    (tmp_path / "text.safetensors").write_text("hello")
    with pytest.raises(NormalsFileError, match="is not a STAIR normals file"):
        read_normals_config(tmp_path / "text.safetensors")
    save_file({"n": torch.zeros(1)}, str(tmp_path / "f2.safetensors"),
              metadata={"stair_config": json.dumps({"format": 2, "layers": [1]})})
    with pytest.raises(NormalsFileError, match="format 2, expected 1"):
        read_normals_config(tmp_path / "f2.safetensors")


def test_eval_missing_normals(cli, tmp_path):
    out = cli("eval", "--quick", "--normals", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "ev"))
    assert "--normals" in out and "does not exist" in out
    assert not (tmp_path / "ev").exists()
    out = cli("eval", "--quick", "--bank-free", str(tmp_path / "nope.safetensors"), "--out", str(tmp_path / "ev"))
    assert "--bank-free" in out and "does not exist" in out


@pytest.mark.parametrize("make", [_scale_like, _truncated])
def test_eval_not_a_normals_file(cli, tmp_path, make):
    f = make(tmp_path / "w.safetensors")
    out = cli("eval", "--quick", "--normals", str(f), "--out", str(tmp_path / "ev"))
    assert "--normals" in out and "is not a STAIR normals file" in out and "decoder layer" not in out
    assert not (tmp_path / "ev").exists()


def test_eval_normals_of_other_kind(cli, tmp_path):
    f = tmp_path / "bf.safetensors"
    save_file({"bias": torch.zeros(1, 4, 16)}, str(f),
              metadata={"stair_config": json.dumps({"format": 1, "kind": "bank_free", "layers": [1]})})
    out = cli("eval", "--quick", "--normals", str(f))
    assert "--normals" in out and "'bank_free'" in out


@pytest.mark.parametrize("budgets", ["x", "16,x", "0", "-4"])
def test_eval_bad_budgets(cli, tmp_path, budgets):
    out = cli("eval", "--quick", "--budgets", budgets, "--out", str(tmp_path / "ev"))
    assert "--budgets" in out and "ints >= 1" in out
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("args,hint", [(["--eps", "1"], "--eps"), (["--eps", "nan"], "--eps"),
                                       (["--eps", "-0.1"], "--eps"), (["--kind", "foo"], "--kind"),
                                       (["--levels", "a"], "--levels"), (["--layers", "3,x"], "--layers")])
def test_train_bad_args_leave_no_folder(cli, tmp_path, args, hint):
    out = cli("train", "--quick", *args, "--out", str(tmp_path / "run"))
    assert hint in out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cmd", ["train", "eval"])
def test_out_is_a_file(cli, tmp_path, cmd):
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "f" / "sub"):
        out = cli(cmd, "--quick", "--out", str(target))
        assert "--out" in out and "is a file" in out
    assert (tmp_path / "f").read_text() == "x"


def test_train_out_of_range_layer_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["stair", "train", "--quick", "--layers", "99", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "out of range" in r.output, r.output
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [["--conditions", "vanilla,foo"], ["--max-new-tokens", "0"], ["--temperature", "-1"],
                                  ["--k", "0"], ["--turns", "1"], ["--layers", "x"]])
def test_eval_bad_config_before_model(cli, tmp_path, args):
    cli("eval", "--quick", *args, "--out", str(tmp_path / "ev"))
    assert not (tmp_path / "ev").exists()


@pytest.mark.parametrize("args", [["--steps", "0"], ["--turns", "1"], ["--responses", "foo"], ["--lr", "0"]])
def test_train_bad_config_before_model(cli, tmp_path, args):
    cli("train", "--quick", *args, "--out", str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
