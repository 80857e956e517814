"""Faults a new user found in `treadle weft ...`: a --model whose tokenizer lacks a pad token, --quick runs
writing where full results live, run folders without --overwrite / run.json, options silently ignored,
pydantic's prefix in messages, an unbounded --jobs. Each: one line naming the flag, exit 2, nothing written."""
import json

import pytest
from typer.testing import CliRunner

from treadle.cli import app as root
from treadle.testing import assert_usage_error

runner = CliRunner()


def weft(args):
    """``treadle weft <args>`` through the root CLI (it prints usage errors as one line, as the shell does)."""
    return runner.invoke(root, ["weft", *args])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """``(with_pad, without_pad)``: tiny local GPT-2 checkpoints with the tool tokenizer (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from treadle.weft.rl.vocab import build_tool_tokenizer

    out = []
    for pad in (True, False):
        d = tmp_path_factory.mktemp("gpt2-pad" if pad else "gpt2-nopad")
        tok = build_tool_tokenizer()
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(tok))).save_pretrained(d)
        if not pad:
            tok.pad_token = None
        tok.save_pretrained(d)
        out.append(d)
    return tuple(out)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("cmd", [["groups"], ["train", "--seeds", "0", "--grouping", "atomic", "--steps", "1",
                                               "--eval-episodes", "1"]])
def test_model_without_pad_token_is_one_line_before_anything_is_written(tmp_path, gpt2, cmd):
    out = tmp_path / "out"
    r = weft([*cmd, "--model", str(gpt2[1]), "--out", str(out)])
    assert_usage_error(r, "--model", "pad token")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_tool_model_checks(tmp_path, gpt2):
    from treadle.weft.rl.sft import ToolModelError, check_tool_model, check_tool_tokenizer, load_tool_model
    from treadle.weft.rl.vocab import build_tool_tokenizer

    check_tool_model(gpt2[0])
    with pytest.raises(ToolModelError, match="pad token"):
        load_tool_model(gpt2[1], train_if_missing=False)
    tok = build_tool_tokenizer()
    tok.chat_template = None
    with pytest.raises(ToolModelError, match="chat template"):
        check_tool_tokenizer(tok)
    tok = build_tool_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no eos after a turn
    with pytest.raises(ToolModelError, match="eos token"):
        check_tool_tokenizer(tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                         "{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}")
    with pytest.raises(ToolModelError, match="tool conversation"):
        check_tool_tokenizer(tok)
    small = tmp_path / "small"  # a vocabulary smaller than the tokenizer's
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(small)
    build_tool_tokenizer().save_pretrained(small)
    with pytest.raises(ToolModelError, match="vocabulary"):
        check_tool_model(small)


def test_groups_runs_on_a_good_gpt2_and_overwrite_replaces(tmp_path, gpt2):
    out = tmp_path / "g"
    base = ["groups", "--model", str(gpt2[0]), "--episodes", "1", "-G", "2", "--out", str(out)]
    r = weft(base)
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "finished" and rec["command"] == "weft groups"
    assert {"treadle_version", "git_commit", "argv", "started", "ended", "machine"} <= set(rec)
    assert_usage_error(weft([*base[:-4], "-G", "3", "--out", str(out)]), "--out", "another config", "--overwrite")
    r = weft([*base[:-4], "-G", "3", "--out", str(out), "--overwrite"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["G"] == 3


@pytest.mark.parametrize("cmd,default", [(["groups"], "runs/weft-groups-quick"),
                                         (["train"], "runs/weft-train-quick")])
def test_quick_runs_default_to_their_own_folder(tmp_path, cmd, default):
    """--quick without --out: runs/<name>-quick (a folder that is not a run folder there is refused, naming it:
    proof of where it would write, without training anything)."""
    (tmp_path / default).mkdir(parents=True)
    (tmp_path / default / "mine.txt").write_text("x")
    assert_usage_error(weft([*cmd, "--quick"]), default, "not a treadle run folder")
    full = default.removesuffix("-quick")
    (tmp_path / full).mkdir(parents=True)
    (tmp_path / full / "mine.txt").write_text("x")
    assert_usage_error(weft(cmd), repr(full), "not a treadle run folder")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("args,parts", [
    (["train", "--jobs", "99999"], ("--jobs", "trl.GRPOTrainer")),
    (["train", "--jobs", "1", "--parallel", "ddp"], ("--parallel", "trl.GRPOTrainer")),
    (["groups", "--quick", "--model", "m"], ("--quick", "--model")),
    (["sample", "--role", "judge"], ("--role", "--policy llm")),
    (["sample", "--user-role", "judge"], ("--user-role", "simuser-llm")),
    (["sample", "--disclosure", "vague"], ("--disclosure", "agentic")),
    (["sample", "--method", "end_to_end", "--sft"], ("--sft", "prefix")),
    (["evolve", "--revise-attempts", "3"], ("--revise-attempts", "--llm-config")),
])
def test_ignored_or_unbounded_options_are_errors(tmp_path, args, parts):
    out = tmp_path / "o"
    assert_usage_error(weft([*args, "--out", str(out)]), *parts)
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_sample_messages_are_clean(tmp_path):
    line = assert_usage_error(weft(["sample", "--out", str(tmp_path / "o"), "--method", "foo"]), "--method")
    assert "Value error" not in line


def test_sample_bfcl_hint_once(tmp_path, monkeypatch):
    from treadle.weft.rollouts import bfcl_tasks

    def missing(*a, **kw):  # as if bfcl-eval were not installed (its entries may be cached in this process)
        raise ModuleNotFoundError("No module named 'bfcl_eval'", name="bfcl_eval")

    monkeypatch.setattr(bfcl_tasks, "from_bfcl", missing)
    line = assert_usage_error(weft(["sample", "--out", str(tmp_path / "o"), "--env", "bfcl"]), "--env")
    assert line.count("pip install") == 1


def test_sample_run_folder_rule(tmp_path):
    out = tmp_path / "ws"
    base = ["sample", "--out", str(out), "--k", "1", "--method", "prefix"]
    r = weft(base)
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "run.json").read_text())
    assert rec["status"] == "finished" and rec["command"] == "weft sample" and rec["config"]["ks"] == [1]
    assert weft([*base, "--concurrency", "2"]).exit_code == 0  # same trajectories: resumed
    assert_usage_error(weft([*base[:3], "--k", "2", "--method", "prefix"]), "--out", "another config",
              "--overwrite")
    r = weft([*base[:3], "--k", "2", "--method", "prefix", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "run.json").read_text())["config"]["ks"] == [2]


def test_evolve_run_folder_rule(tmp_path):
    out = tmp_path / "ev"
    base = ["evolve", "--out", str(out), "--max-rounds", "1"]
    assert weft(base).exit_code == 0
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    r = weft(base)
    assert r.exit_code == 0 and "already holds this finished" in r.output
    assert_usage_error(weft([*base[:-1], "2"]), "--out", "another config")
    assert weft([*base[:-1], "2", "--overwrite"]).exit_code == 0
