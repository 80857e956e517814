"""``treadle scale sft | train | sweep`` and the ``scale`` demo section (quick settings, tiny models)."""
from __future__ import annotations

import json

import pytest

from treadle.testing import require_module

require_module("peft")
from typer.testing import CliRunner  # noqa: E402

from treadle.cli import app  # noqa: E402


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))  # the quick tiny model trains here in seconds
    monkeypatch.delenv("TREADLE_MODEL", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # integration: C++ kernels (or the reference), not the interpreter


def _ok(r):
    assert r.exit_code == 0, r.output
    return r.output


def _refused(r, text):
    assert r.exit_code == 2, r.output
    assert text in r.output
    assert "Traceback" not in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_scale_help_lists_the_commands():
    out = _ok(CliRunner().invoke(app, ["scale", "--help"]))
    for cmd in ("sft", "train", "sweep"):
        assert cmd in out


@pytest.mark.parametrize("args,text", [
    (["train", "--L", "0"], "'--L': Input should be less than 0"),
    (["train", "--L", "0.5"], "'--L': Input should be less than 0"),
    (["train", "--L", "nan"], "'--L': Input should be a finite number"),
    (["train", "--U", "1"], "'--U': Input should be greater than 1"),
    (["train", "--tau", "0"], "'--tau': Input should be greater than 0"),
    (["train", "--tau", "-1"], "'--tau': Input should be greater than 0"),
    (["train", "--k", "0"], "'--k': Input should be greater than or equal to 2"),
    (["train", "--k", "1"], "'--k'"),
    (["train", "--lr", "0"], "'--lr'"),
    (["train", "--temperature", "0"], "'--temperature'"),
    (["train", "--objective", "ce", "--responses", "sampled"], "--objective: 'ce'"),
    (["train", "--objective", "kl"], "'--objective'"),
    (["train", "--responses", "nope"], "'--responses'"),
    (["train", "--max-new-tokens", "0"], "'--max-new-tokens'"),
    (["train", "--epochs", "0"], "'--epochs'"),
    (["train", "--adapter", "/no/such/adapter"], "--adapter '/no/such/adapter' does not exist"),
    (["sweep", "--Ls=-2,0"], "every L must be < 0"),
    (["sweep", "--Us", "1,2"], "every U"),
    (["sweep", "--jobs", "0"], "'--jobs'"),
    (["sweep", "--metric", "loss"], "'--metric'"),
    (["sft", "--r", "0"], "'--r'"),
    (["sft", "--steps", "-5"], "'--steps'"),
    (["train", "--eval-levels", ""], "--eval-levels"),
    (["train", "--levels", ""], "--levels"),
    (["train", "--levels", "9"], "--levels"),
    (["sweep", "--Ls=-2,nan"], "bad values [nan]"),
    (["sweep", "--Us", "x"], "like 1.5,2,4"),
    (["train", "--adapter", "/tmp/[red]nope"], "/tmp/[red]nope"),
    (["sft", "--threads", "-1"], "--threads"),
    (["train", "--threads", "-1"], "--threads"),
    (["sweep", "--threads", "-1"], "--threads"),
    (["train", "--report-to", "nope"], "--report-to"),
    (["train", "--temperature", "0.5"], "--temperature: ignored here"),  # only --responses sampled samples
    (["sft", "--model", "/no/such/model"], "does not exist"),
])
def test_bad_input_exits_2_with_a_message_before_any_work(tmp_path, args, text):
    r = CliRunner().invoke(app, ["scale", *args, "--out", str(tmp_path / "run")])
    _refused(r, text)
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "cache").exists()  # refused before loading (or training) any model
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [
    ["train", "--k", "2"], ["train", "--L", "-1e-9"], ["train", "--U", "1.000001"], ["train", "--tau", "1e-6"],
    ["train", "--epochs", "1", "--batch-size", "1", "--train-size", "1", "--eval-size", "1", "--max-new-tokens", "1"],
    ["train", "--levels", "6", "--eval-levels", "1"], ["train", "--threads", "0"], ["train", "--report-to", "none"],
    ["train", "--objective", "ce", "--responses", "dataset"], ["train", "--responses", "sampled", "--temperature", "1e-6"], ["sweep", "--jobs", "1", "--Ls=-1e-9", "--Us", "1.5"],
    ["sft", "--r", "1", "--steps", "1", "--batch-size", "1", "--threads", "0"],
])
def test_valid_boundary_values_pass_the_option_checks(tmp_path, args):
    """Each boundary value is accepted: the command gets as far as the run-folder check (a file here)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = CliRunner().invoke(app, ["scale", *args, "--out", str(afile)])
    _refused(r, "--out")
    assert "exists and is a file" in r.output, r.output


@pytest.mark.parametrize("cmd", ["sft", "train", "sweep"])
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path, cmd):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        r = CliRunner().invoke(app, ["scale", cmd, "--quick", "--out", str(out)])
        _refused(r, "--out")
        assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()  # before loading any model


def test_demo_run_dir_that_is_a_file_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(CliRunner().invoke(app, ["demo", "--quick", "--sections", "scale", "--run-dir", str(afile)]), "--out")
    assert not (tmp_path / "cache").exists()


def test_adapter_whose_base_model_is_missing_asks_for_model(tmp_path):
    ad = tmp_path / "ad"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                        "base_model_name_or_path": "/moved/away/model"}))
    r = CliRunner().invoke(app, ["scale", "train", "--quick", "--adapter", str(ad), "--out", str(tmp_path / "r")])
    _refused(r, "--model")
    assert "/moved/away/model" in r.output
    assert not (tmp_path / "cache").exists()


def test_truncated_weights_of_a_plain_checkpoint_exit_2(tmp_path, tok):
    from treadle.models import build_tiny_model

    ckpt = tmp_path / "m"
    build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=32,
                     intermediate_size=48, num_hidden_layers=1).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    w = ckpt / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    r = CliRunner().invoke(app, ["scale", "sft", "--quick", "--model", str(ckpt), "--out", str(tmp_path / "s")])
    _refused(r, "model.safetensors")


def test_adapter_folders_that_are_not_lora_adapters_are_refused(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    r = CliRunner().invoke(app, ["scale", "train", "--quick", "--adapter", str(bare), "--out", str(tmp_path / "r")])
    _refused(r, "no adapter_config.json")
    ia3 = tmp_path / "ia3"
    ia3.mkdir()
    (ia3 / "adapter_config.json").write_text(json.dumps({"peft_type": "IA3"}))
    r = CliRunner().invoke(app, ["scale", "train", "--quick", "--adapter", str(ia3), "--out", str(tmp_path / "r")])
    _refused(r, "SCALE gates need a LoRA adapter")
    r = CliRunner().invoke(app, ["scale", "sft", "--quick", "--target-modules", "no_such_proj", "--out",
                                 str(tmp_path / "s")])
    _refused(r, "--target-modules: no module of the model is named 'no_such_proj'; expected 'all-linear' or names "
                "among down_proj")
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "s").exists()  # refused before the run folder is written


def test_sft_then_train_then_sweep_quick(tmp_path):
    runner = CliRunner()
    out = _ok(runner.invoke(app, ["scale", "sft", "--quick", "--out", str(tmp_path / "sft")]))
    assert "held-out response CE" in out
    adapter = tmp_path / "sft" / "adapter"
    assert (adapter / "adapter_config.json").exists()
    out = _ok(runner.invoke(app, ["scale", "train", "--quick", "--adapter", str(adapter), "--no-reverse",
                                  "--L", "-3", "--U", "4", "--out", str(tmp_path / "train")]))
    for text in ("before (Stage I)", "reverse (<0)", "q_proj", "layer 0"):
        assert text in out
    for f in ("gates.safetensors", "lambda_hist.png", "log.jsonl", "summary.json"):
        assert (tmp_path / "train" / f).exists(), f
    cfg = json.loads((tmp_path / "train" / "config.json").read_text())
    assert cfg["no_reverse"] and cfg["lambda_bounds"] == [0.0, None] and (cfg["L"], cfg["U"]) == (-3.0, 4.0)
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["after"]["lambda"]["overall"]["reverse"] == 0.0
    assert summary["adapter"] == str(adapter) and summary["base_model"]
    # a truncated adapter: one line naming the file, exit 2
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(adapter, cut)
    w = cut / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:50])
    _refused(runner.invoke(app, ["scale", "train", "--quick", "--adapter", str(cut), "--out", str(tmp_path / "c")]),
             "adapter_model.safetensors")
    # the run-folder rule: the same finished run is resumed (its results shown, no work), another config refused
    again = _ok(runner.invoke(app, ["scale", "train", "--quick", "--adapter", str(adapter), "--no-reverse",
                                    "--L", "-3", "--U", "4", "--out", str(tmp_path / "train")]))
    assert "already holds this finished Stage II run" in again and "reverse (<0)" in again
    assert json.loads((tmp_path / "train" / "summary.json").read_text()) == summary
    r = runner.invoke(app, ["scale", "train", "--quick", "--adapter", str(adapter), "--L", "-2",
                            "--out", str(tmp_path / "train")])
    _refused(r, "holds a run with another config")
    assert "--overwrite" in r.output and "--out" in r.output and len(r.output.strip().splitlines()) == 1
    assert json.loads((tmp_path / "train" / "summary.json").read_text()) == summary  # untouched
    record = json.loads((tmp_path / "train" / "run.json").read_text())
    assert record["status"] == "finished" and record["command"] == "scale train" and record["ended"]
    assert {"treadle_version", "git_commit", "argv", "machine", "started"} <= set(record)
    sw = tmp_path / "sweep"
    (sw / "cells" / "L-9_U9").mkdir(parents=True)  # an earlier sweep of another grid into the same --out
    (sw / "run.json").write_text(json.dumps({"command": "scale sweep", "config": {"Ls": [-9.0]}, "status": "finished"}))
    args = ["scale", "sweep", "--quick", "--adapter", str(adapter), "--Ls=-2,-0.5", "--Us", "2", "--jobs", "1",
            "--out", str(sw)]
    _refused(runner.invoke(app, args), "holds a run with another config")
    assert (sw / "cells" / "L-9_U9").is_dir()  # nothing lost
    out = _ok(runner.invoke(app, [*args, "--overwrite"]))
    assert "best: L=" in out and "%)" in out
    assert (sw / "heatmap.png").exists()
    assert len(json.loads((sw / "results.json").read_text())["cells"]) == 2
    assert sorted(p.name for p in (sw / "cells").iterdir()) == ["L-0.5_U2", "L-2_U2"]
    assert json.loads((sw / "run.json").read_text())["status"] == "finished"


def test_train_without_adapter_runs_stage_one_first(tmp_path):
    out = _ok(CliRunner().invoke(app, ["scale", "train", "--quick", "--out", str(tmp_path / "t")]))
    assert "running Stage I first" in out
    assert (tmp_path / "t" / "sft" / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "t" / "gates.safetensors").exists()


def test_demo_section_quick(tmp_path):
    from rich.console import Console

    from treadle.demo import resolve_sections
    from treadle.scale.demo import run

    assert "scale" in resolve_sections("all")
    with open(tmp_path / "log.txt", "w") as fh:
        res = run(tmp_path / "scale", True, Console(file=fh, width=200))
    assert (tmp_path / "scale" / "stage2" / "lambda_hist.png").exists()
    assert (tmp_path / "scale" / "stage1" / "adapter" / "adapter_config.json").exists()
    assert res["train"]["after"]["lambda"]["overall"]
    assert "learned lambda" in (tmp_path / "log.txt").read_text()
    with open(tmp_path / "log2.txt", "w") as fh:  # deterministic: the same numbers again
        again = run(tmp_path / "scale2", True, Console(file=fh, width=200))
    assert again["train"]["losses"] == res["train"]["losses"]
    assert again["train"]["after"]["accuracy"] == res["train"]["after"]["accuracy"]
