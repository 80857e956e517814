"""Faults a new user met: a bad $TREADLE_MODEL refused before any demo section runs (one line, exit 2,
nothing written); no --overwrite hint for a folder --overwrite refuses; a checkpoint without tokenizer
files named as such; `treadle bench` finding bench/ in the current directory of an installed package."""
import json
import os
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from treadle.cli import app
from treadle.models import build_tiny_model
from treadle.models.tiny import MARKER, build_tokenizer
from treadle.testing import assert_usage_error


pytestmark = pytest.mark.usefixtures("cli_env")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    tok = build_tokenizer()
    good = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=32,
                            intermediate_size=48, num_hidden_layers=1)
    out = {}
    for name in ("qwen3", "cut", "marked-cut"):
        good.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    w = root / "cut" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size - 64])  # header intact, data short
    # a treadle-marked checkpoint whose weights no longer match the marker's size/SHA-256
    marked = root / "marked-cut"
    files = {f.name: {"size": f.stat().st_size, "sha256": "0" * 64} for f in marked.iterdir() if f.is_file()}
    (marked / MARKER).write_text(json.dumps({"format": 1, "files": files}))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(tok)))
    gpt2.save_pretrained(root / "gpt2-bare")  # no tokenizer files at all
    gpt2.save_pretrained(root / "gpt2")
    tok.save_pretrained(root / "gpt2")
    for name in ("qwen3", "cut", "marked-cut", "gpt2-bare", "gpt2"):
        out[name] = root / name
    return out


@pytest.mark.parametrize("model, sections, words", [
    ("/bad", "all", ["does not exist"]),
    ("/bad", "stair", ["does not exist"]),
    ("cut", "grpo-op,grpo-train", ["model.safetensors", "truncated"]),
    ("marked-cut", "stair", ["size/SHA-256"]),
    ("gpt2-bare", "scale", ["no tokenizer files"]),
    ("gpt2", "stair", ["section stair", "model_type 'gpt2'"]),
    ("gpt2", "scale", ["section scale", "nn.Linear"]),
])
def test_demo_checks_treadle_model_before_any_section(ckpts, tmp_path, monkeypatch, model, sections, words):
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts.get(model, model)))
    r = CliRunner().invoke(app, ["demo", "--sections", sections, "--out", str(tmp_path / "d11")])
    assert_usage_error(r, "$TREADLE_MODEL", *words)
    assert "grpo-op" not in r.output.replace(sections, "")  # no section's rule was printed
    assert not (tmp_path / "d11").exists()
    assert not (tmp_path / "cache").exists()  # nothing trained


def test_demo_ignores_treadle_model_when_no_chosen_section_uses_it(tmp_path, monkeypatch):
    from treadle.demo import check_env_model

    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    assert check_env_model(["grpo-op", "weft-shop"], quick=False) is None
    assert check_env_model(["stair", "scale"], quick=True) is None  # --quick: the quick tiny model, not $TREADLE_MODEL
    assert check_env_model(["grpo-train"], quick=True) is not None


def test_env_model_helper_accepts_a_usable_checkpoint(ckpts, monkeypatch):
    from treadle.cli_checks import env_model_error, model_problem
    from treadle.demo import MODEL_SECTIONS

    needs = [(f"section {n}", c) for n, (_, c) in MODEL_SECTIONS.items() if c is not None]
    assert model_problem(ckpts["qwen3"], needs=needs) is None
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts["qwen3"]))
    assert env_model_error(needs=needs) is None
    monkeypatch.delenv("TREADLE_MODEL")
    assert env_model_error() is None


def test_train_tiny_on_a_foreign_folder_never_suggests_overwrite(tmp_path):
    nonrun = tmp_path / "nonrun"
    nonrun.mkdir()
    (nonrun / "keep.txt").write_text("mine")
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--out", str(nonrun)])
    line = assert_usage_error(r, "--out", "not a treadle checkpoint")
    assert "--overwrite`" not in line and "run 'treadle" not in line and "run `treadle" not in line, line
    assert [p.name for p in nonrun.iterdir()] == ["keep.txt"]
    # and what it says holds: --overwrite is refused too
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--out", str(nonrun), "--overwrite"])
    assert_usage_error(r, "never replaced")


def test_model_eval_names_missing_tokenizer_files(ckpts, tmp_path):
    r = CliRunner().invoke(app, ["model", "eval", str(ckpts["gpt2-bare"])])
    line = assert_usage_error(r, "PATH", "no tokenizer files")
    assert "chat template" not in line


def test_load_default_model_refuses_a_checkpoint_without_tokenizer_files(ckpts):
    from treadle.models.tiny import CheckpointError, load_default_model

    with pytest.raises(CheckpointError, match="no tokenizer files"):
        load_default_model(ckpts["gpt2-bare"])


def test_bench_finds_bench_in_the_current_directory(tmp_path, monkeypatch):
    """After `pip install .` the package is in site-packages; `treadle bench` run in the clone uses ./bench."""
    import treadle.bench_report as br

    monkeypatch.setattr(br, "BENCH", tmp_path / "site" / "bench")  # as installed: nothing next to the package
    clone = tmp_path / "clone"
    (clone / "bench").mkdir(parents=True)
    (clone / "bench" / "bench_grpo.py").write_text("")
    (clone / "sub").mkdir()
    assert br.find_bench(clone) == clone / "bench"
    assert br.find_bench(clone / "sub") == clone / "bench"
    monkeypatch.chdir(clone)
    assert br._suites(["grpo"]) == [clone / "bench" / "bench_grpo.py"]
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["bench", "--ops", "foo"])
    line = assert_usage_error(r, "no bench/ folder", str(tmp_path / "bench"), str(tmp_path / "site" / "bench"))
    monkeypatch.chdir(clone)
    r = CliRunner().invoke(app, ["bench", "--ops", "foo"])
    assert_usage_error(r, "--ops", "no such benchmark suite", "grpo")
