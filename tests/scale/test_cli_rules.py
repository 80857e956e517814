"""``treadle scale sft | train | sweep`` under the CLI rules: errors name the flag (--model, --adapter, --Ls) and
come before the run starts (nothing written), $TREADLE_MODEL is --model's default also under --quick (used and
checked, never silently replaced by the quick tiny model), --jobs is bounded by the tasks and CPUs, and the
sweep's worker processes keep the CLI's warning filters."""
from __future__ import annotations

import json
import os

import pytest

from treadle.testing import require_module

require_module("peft")
from typer.testing import CliRunner  # noqa: E402

from treadle.cli import app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "cli_env")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny Qwen3 checkpoint with a LoRA adapter (q_proj) made on it, and a GPT-2 one (Conv1D, no Linear)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from treadle.models import build_tiny_model, build_tokenizer

    root = tmp_path_factory.mktemp("ckpts")
    tok = build_tokenizer()
    qwen = root / "qwen"
    m = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=32,
                         intermediate_size=48, num_hidden_layers=1)
    m.save_pretrained(qwen)
    tok.save_pretrained(qwen)
    m.name_or_path = str(qwen)
    adapter = root / "adapter"
    get_peft_model(m, LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"])).save_pretrained(adapter)
    gpt2 = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=len(tok))).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    return {"qwen": qwen, "adapter": adapter, "gpt2": gpt2}


def _refused(args, *words, out=None):
    from treadle.testing import assert_usage_error

    line = assert_usage_error(CliRunner().invoke(app, ["scale", *args]), *words)
    if out is not None:
        assert not out.exists(), "a refused command wrote its run folder"
    return line


def test_sft_on_a_model_without_linear_layers_names_model(ckpts, tmp_path):
    _refused(["sft", "--quick", "--model", str(ckpts["gpt2"]), "--steps", "1", "--out", str(tmp_path / "s")],
             "--model", str(ckpts["gpt2"]), "nothing for LoRA to target", out=tmp_path / "s")


def test_sft_quick_uses_and_checks_treadle_model(ckpts, tmp_path, monkeypatch):
    """$TREADLE_MODEL was silently replaced by the quick tiny model under --quick: now it is used (quick settings
    on it) and checked like --model, the message naming $TREADLE_MODEL."""
    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    _refused(["sft", "--quick", "--out", str(tmp_path / "s")], "$TREADLE_MODEL", "'/bad'", out=tmp_path / "s")
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts["gpt2"]))
    _refused(["sft", "--quick", "--out", str(tmp_path / "s")], "$TREADLE_MODEL", "nothing for LoRA to target",
             out=tmp_path / "s")
    assert not (tmp_path / "cache").exists()  # the quick tiny model was never made


@pytest.mark.parametrize("cmd", ["train", "sweep"])
def test_an_adapter_of_another_base_names_adapter_and_model(cmd, ckpts, tmp_path):
    line = _refused([cmd, "--quick", "--adapter", str(ckpts["adapter"]), "--model", str(ckpts["gpt2"]),
                     "--out", str(tmp_path / "t")], "--adapter", "--model", str(ckpts["gpt2"]), out=tmp_path / "t")
    assert "Target modules {" not in line  # PEFT's list of every module, shortened


@pytest.mark.parametrize("cmd", ["train", "sweep"])
def test_no_adapter_and_a_model_without_linear_layers_fails_before_the_run(cmd, ckpts, tmp_path):
    _refused([cmd, "--quick", "--model", str(ckpts["gpt2"]), "--out", str(tmp_path / "t")], "--model",
             "nothing for LoRA to target", out=tmp_path / "t")


@pytest.mark.parametrize("grid", [["--Ls=-2,-2"], ["--Ls=-2,-1,-2"], ["--Us", "2,3,2"]])
def test_sweep_duplicate_grid_values_name_the_flag_before_loading(grid, ckpts, tmp_path):
    flag = grid[0].split("=")[0] if "=" in grid[0] else grid[0]
    _refused(["sweep", "--quick", "--adapter", str(ckpts["adapter"]), *grid, "--out", str(tmp_path / "w")],
             flag, "more than once", out=tmp_path / "w")
    assert not (tmp_path / "cache").exists()


def test_sweep_jobs_is_bounded_by_tasks_and_cpus(ckpts, tmp_path, monkeypatch):
    import importlib

    sw = importlib.import_module("treadle.scale.sweep")  # the module (treadle.scale exports a function `sweep`)
    seen = {}

    def fake_sweep(base, adapter, Ls, Us, cfg, out, *, jobs, metric, console, progress):
        seen["jobs"] = jobs
        cell = {"L": Ls[0], "U": Us[0], "accuracy_mean": 0.5, "entropy": 0.1}
        return {"baseline": {"accuracy_mean": 0.5, "entropy": 0.1}, "Ls": Ls, "Us": Us, "cells": [cell],
                "best": cell, "seconds": 0.0, "jobs": jobs}

    monkeypatch.setattr(sw, "sweep", fake_sweep)
    r = CliRunner().invoke(app, ["scale", "sweep", "--quick", "--adapter", str(ckpts["adapter"]), "--model",
                                 str(ckpts["qwen"]), "--Ls=-2", "--Us", "2", "--jobs", "100", "--out",
                                 str(tmp_path / "w")])
    assert r.exit_code == 0, r.output
    assert seen["jobs"] == min(2, os.cpu_count() or 1)  # 1 cell + the Stage-I baseline
    assert "--jobs 100: using" in r.output
    assert json.loads((tmp_path / "w" / "run.json").read_text())["config"]["model"] == str(ckpts["qwen"])


def test_sweep_workers_keep_the_parents_warning_filters():
    import concurrent.futures as cf
    import multiprocessing as mp
    import warnings

    from treadle.scale.sweep import _inherit_warning_filters

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                    initializer=_inherit_warning_filters, initargs=(list(warnings.filters),)) as pool:
            # a builtin is picklable by reference (a function of this test module may not import in the worker)
            got = pool.submit(eval, "[(f[0], f[2].__name__) for f in __import__('warnings').filters]").result()
    assert got[0] == ("ignore", "FutureWarning")
