"""`treadle rsi` faults found by a new user: an unusable $TREADLE_MODEL (a traceback that left a half-made run
folder), no --overwrite and no run.json, options silently ignored (--seeds with --seed-file), and minutes of
silence while the tiny model trains. Every error is one line naming the flag (or $TREADLE_MODEL), exit 2,
before anything is written; every run folder follows the run-folder rule (run.json)."""
from __future__ import annotations

import json
import re

import pytest
import sympy
from typer.testing import CliRunner

from treadle.cli import app


pytestmark = pytest.mark.usefixtures("cli_env")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from treadle.llm.tiny_checkpoint import save_untrained_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    good, _ = save_untrained_checkpoint(root / "good")
    cut, _ = save_untrained_checkpoint(root / "cut")
    w = cut / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    plain, _ = save_untrained_checkpoint(root / "no-template")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((plain / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tc))
    from transformers import ViTConfig, ViTModel

    vit = root / "vit"  # a real checkpoint, but of an image encoder, not a causal LM
    ViTModel(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8, image_size=8,
                       patch_size=4)).save_pretrained(vit)
    return {"good": good, "cut": cut, "no-template": plain, "vit": vit}


def _invoke(args):
    return CliRunner().invoke(app, ["rsi", *map(str, args)])


def _refused(args, out, *words):
    from treadle.testing import assert_usage_error

    line = assert_usage_error(_invoke(args), *words)
    if out is not None:
        assert not out.exists(), sorted(p.name for p in out.iterdir())
    return line


def _ok(args):
    r = _invoke(args)
    assert r.exit_code == 0, r.output
    return r.output


# ------------------------------------------------------------------ 1. an unusable tiny-model checkpoint
@pytest.mark.parametrize("cmd", ["run", "ablate"])
def test_bad_treadle_model_is_one_line_and_writes_nothing(cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    out = tmp_path / "rs13"
    line = _refused([cmd, "--out", out, "--solver", "tiny-model", "--rounds", "1", "--seeds", "2"], out,
                    "$TREADLE_MODEL", "/bad", "does not exist")
    assert line.startswith("Error: $TREADLE_MODEL '/bad'")


@pytest.mark.parametrize("kind, words", [("cut", ["model.safetensors"]), ("vit", ["not a causal LM"]),
                                         ("no-template", ["no chat template"])])
def test_unusable_checkpoints_in_treadle_model(kind, words, ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts[kind]))
    out = tmp_path / "run"
    _refused(["run", "--out", out, "--solver", "tiny-model", "--rounds", "1", "--seeds", "2"], out,
             "Error: $TREADLE_MODEL", *words)


def test_a_damaged_cached_tiny_model_names_the_solver(tmp_path):
    slot = tmp_path / "cache" / "tiny-qwen3-quick"
    slot.mkdir(parents=True)
    (slot / ".treadle-partial").write_text("")
    out = tmp_path / "run"
    _refused(["run", "--out", out, "--solver", "tiny-model", "--quick", "--rounds", "1", "--seeds", "2"], out,
             "Error: --solver tiny-model:", "half-written")


def test_a_usable_treadle_model_runs_and_is_recorded(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts["good"]))
    out = tmp_path / "run"
    _ok(["run", "--out", out, "--solver", "tiny-model", "--rounds", "1", "--seeds", "3"])
    solver = json.loads((out / "config.json").read_text())["solver"]
    assert solver == {"name": "tiny-model", "args": {"path": str(ckpts["good"].resolve())}}
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    # another checkpoint is another config: refused, naming --out and --overwrite
    monkeypatch.setenv("TREADLE_MODEL", str(ckpts["no-template"]))
    line = _refused(["run", "--out", out, "--solver", "tiny-model", "--rounds", "1", "--seeds", "3"], None,
                    "Error: --out", "--overwrite", "solver")
    assert "another config" in line


# ------------------------------------------------------------------ 2. --overwrite and run.json
def test_run_folder_rule_for_rsi_run(tmp_path):
    out = tmp_path / "rs"
    first = _ok(["run", "--out", out, "--rounds", "1", "--seeds", "4"])
    rec = json.loads((out / "run.json").read_text())
    assert rec["command"] == "rsi run" and rec["status"] == "finished"
    for key in ("treadle_version", "git_commit", "argv", "started", "ended", "machine"):
        assert key in rec, key
    # the same settings: shown, not run again
    again = _ok(["run", "--out", out, "--rounds", "1", "--seeds", "4"])
    assert "already holds this finished run" in again and "after round" not in again
    assert re.search(r"\d+ verified problems", again).group(0) == re.search(r"\d+ verified problems", first).group(0)
    # more rounds continue the same run
    more = _ok(["run", "--out", out, "--rounds", "2", "--seeds", "4"])
    assert "after round 2" in more and "after round 1:" not in more
    assert len(json.loads((out / "run.json").read_text())["history"]) == 1
    # another config: refused with one line naming --out and --overwrite, nothing changed
    before = (out / "problems.jsonl").read_text()
    _refused(["run", "--out", out, "--rounds", "2", "--seeds", "5"], None, "Error: --out", "--overwrite",
             "seeds: 4 -> 5")
    assert (out / "problems.jsonl").read_text() == before
    # --overwrite replaces it
    rep = _ok(["run", "--out", out, "--rounds", "1", "--seeds", "5", "--overwrite"])
    assert "after round 1" in rep
    assert json.loads((out / "config.json").read_text())["loop"]["rounds"] == 1
    assert len(json.loads((out / "config.json").read_text())["seed_ids"]) < 5 + 1
    assert json.loads((out / "run.json").read_text())["config"]["seeds"] == 5
    # --no-resume refuses an existing run
    _refused(["run", "--out", out, "--rounds", "1", "--seeds", "5", "--no-resume"], None, "Error: --no-resume",
             "--overwrite")


def test_a_run_folder_from_before_run_json_is_resumed(tmp_path):
    out = tmp_path / "old"
    _ok(["run", "--out", out, "--rounds", "1", "--seeds", "4"])
    (out / "run.json").unlink()
    more = _ok(["run", "--out", out, "--rounds", "2", "--seeds", "4"])
    assert "after round 2" in more and "after round 1:" not in more
    assert (out / "run.json").exists()
    (out / "run.json").unlink()
    _refused(["run", "--out", out, "--rounds", "2", "--seeds", "4", "--margin", "0.1"], None, "Error: --out",
             "margin")
    _ok(["run", "--out", out, "--rounds", "1", "--seeds", "4", "--margin", "0.1", "--overwrite"])
    assert json.loads((out / "config.json").read_text())["loop"]["margin"] == 0.1


def test_run_folder_rule_for_rsi_ablate(tmp_path):
    out = tmp_path / "ab"
    args = ["ablate", "--out", out, "--rounds", "1", "--seeds", "4", "--runs", "1"]
    first = _ok(args)
    assert "full (seed 0): final accuracy" in first
    rec = json.loads((out / "run.json").read_text())
    assert rec["command"] == "rsi ablate" and rec["status"] == "finished" and rec["config"]["runs"] == 1
    again = _ok(args)
    assert "already holds this finished run" in again and "seed 0): final" not in again
    _refused(["ablate", "--out", out, "--rounds", "2", "--seeds", "4", "--runs", "1"], None, "Error: --out",
             "--overwrite", "rounds: 1 -> 2")
    rep = _ok(["ablate", "--out", out, "--rounds", "2", "--seeds", "4", "--runs", "1", "--overwrite"])
    assert "full (seed 0): final accuracy" in rep
    assert json.loads((out / "run.json").read_text())["config"]["rounds"] == 2


def test_rsi_llm_has_overwrite_and_run_json(tmp_path):
    from treadle.llm.fake_endpoint import FakeEndpoint

    def solver(req):
        e = re.fullmatch(r"Compute (.+)\.", req["messages"][-1]["content"]).group(1)
        return str(sympy.sympify(e))

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"id": f"q{i}", "expression": e}) + "\n" for i, e in enumerate(["2+3", "4-1"])))
    out = tmp_path / "run"
    with FakeEndpoint(models=("solver",), responder=solver) as ep:
        cfg = tmp_path / "solver.toml"
        cfg.write_text(f'[roles.solver]\nmodel = "solver"\nbase_url = "{ep.base_url}"\nmax_retries = 0\n')
        base = ["llm", "--out", out, "--llm-config", cfg, "--scripted-roles", "--solver-prompt", "", "--seed-file",
                seeds, "--rounds", "1", "--no-post-batch", "--answer-check", "last-number"]
        _ok(base)
        rec = json.loads((out / "run.json").read_text())
        assert rec["command"] == "rsi llm" and rec["status"] == "finished"
        n = len(ep.bodies)
        assert "already holds this finished run" in _ok(base) and len(ep.bodies) == n
        _refused([*base, "--attempts", "2"], None, "Error: --out", "--overwrite", "attempts: 4 -> 2")
        _ok([*base, "--attempts", "2", "--overwrite"])
        assert len(ep.bodies) > n
        assert json.loads((out / "run.json").read_text())["config"]["attempts"] == 2


# ------------------------------------------------------------------ 3. options that would be ignored
def _seed_file(tmp_path):
    p = tmp_path / "good.jsonl"
    p.write_text('{"id": "a", "expression": "1+2"}\n{"id": "b", "expression": "3+4"}\n{"id": "c", "expression": "5"}\n')
    return p


@pytest.mark.parametrize("extra, flags", [
    (["--seed-file", "SEEDS", "--seeds", "5"], ["--seeds", "--seed-file"]),
    (["--no-post-batch", "--margin", "0.1"], ["--margin", "--no-post-batch"]),
    (["--overwrite", "--no-resume"], ["--no-resume", "--overwrite"]),
    (["--quick"], ["--quick", "--solver capacity"]),
])
def test_rsi_run_refuses_ignored_options(extra, flags, tmp_path):
    out = tmp_path / "rs11"
    extra = [str(_seed_file(tmp_path)) if a == "SEEDS" else a for a in extra]
    line = _refused(["run", "--out", out, *extra], out, *flags)
    assert "ignored" in line


def test_quick_with_treadle_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", str(tmp_path))
    out = tmp_path / "r"
    _refused(["run", "--out", out, "--solver", "tiny-model", "--quick"], out, "Error: --quick", "$TREADLE_MODEL")
    _refused(["ablate", "--out", out, "--quick"], out, "Error: --quick", "--solver capacity")


@pytest.mark.parametrize("extra, flags", [
    (["--seed-file", "SEEDS", "--seeds", "5"], ["--seeds", "--seed-file"]),
    (["--seed-file", "SEEDS", "--seed", "3"], ["--seed", "--seed-file"]),
    (["--domain", "code", "--seed", "3"], ["--seed", "--domain code"]),
    (["--domain", "code", "--answer-check", "last-number"], ["--answer-check", "--domain code"]),
    (["--no-post-batch", "--margin", "0.1"], ["--margin", "--no-post-batch"]),
])
def test_rsi_llm_refuses_ignored_options(extra, flags, tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text('[roles.solver]\nmodel = "solver"\nbase_url = "http://127.0.0.1:9/v1"\n')
    out = tmp_path / "run"
    extra = [str(_seed_file(tmp_path)) if a == "SEEDS" else a for a in extra]
    line = _refused(["llm", "--out", out, "--llm-config", cfg, *extra], out, *flags)
    assert "ignored" in line


# ------------------------------------------------------------------ 4. training the tiny model says so
def test_tiny_model_solver_says_it_trains_the_tiny_model(tmp_path):
    out = tmp_path / "rq"
    text = _ok(["run", "--out", out, "--solver", "tiny-model", "--quick", "--rounds", "1", "--seeds", "2"])
    assert "training it first" in text and "training tiny Qwen3" in text
    assert text.index("training tiny Qwen3") < text.index("after round 1")
    assert json.loads((out / "config.json").read_text())["solver"] == {"name": "tiny-model", "args": {"quick": True}}
    # cached now: no training the second time (a new folder)
    text = _ok(["run", "--out", tmp_path / "rq2", "--solver", "tiny-model", "--quick", "--rounds", "1", "--seeds", "2"])
    assert "training" not in text
