"""Unusable checkpoints in every command that loads a model: one line naming where the path came from
(--model or $TREADLE_MODEL), exit 2, no traceback, no run folder left behind."""
import pytest
from transformers import GPT2Config, GPT2LMHeadModel
from typer.testing import CliRunner

from treadle.cli import app
from treadle.models import build_tiny_model
from treadle.models.tiny import build_tokenizer

COMMANDS = [["stair", "train"], ["stair", "eval"], ["scale", "sft"], ["model", "eval"]]


pytestmark = pytest.mark.usefixtures("cli_env")  # tests/conftest.py


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    tok = build_tokenizer()
    good = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id, hidden_size=32,
                            intermediate_size=48, num_hidden_layers=1)
    cut = root / "cut"
    good.save_pretrained(cut)
    tok.save_pretrained(cut)
    w = cut / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    plain = root / "no-template"
    good.save_pretrained(plain)
    tok.chat_template = None
    tok.save_pretrained(plain)
    gpt2 = root / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok))).save_pretrained(gpt2)
    build_tokenizer().save_pretrained(gpt2)
    return {"cut": cut, "no-template": plain, "gpt2": gpt2}


def _refused(args, tmp_path, *words):
    r = CliRunner().invoke(app, args if args[0] == "model" else [*args, "--out", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.output
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
    return lines[0]


@pytest.mark.parametrize("cmd", COMMANDS)
def test_truncated_weights(cmd, ckpts, tmp_path):
    args = [*cmd, str(ckpts["cut"])] if cmd == ["model", "eval"] else [*cmd, "--model", str(ckpts["cut"])]
    _refused(args, tmp_path, "model.safetensors")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_tokenizer_without_chat_template(cmd, ckpts, tmp_path):
    args = ([*cmd, str(ckpts["no-template"])] if cmd == ["model", "eval"]
            else [*cmd, "--model", str(ckpts["no-template"])])
    _refused(args, tmp_path, "no chat template")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_bad_treadle_model_env(cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_MODEL", "/bad")
    _refused(list(cmd), tmp_path, "$TREADLE_MODEL", "/bad")


@pytest.mark.parametrize("cmd", [["stair", "train"], ["stair", "eval"]])
def test_stair_on_a_gpt2_checkpoint_is_an_unsupported_model(cmd, ckpts, tmp_path):
    _refused([*cmd, "--model", str(ckpts["gpt2"])], tmp_path, "--model", "unsupported model", "gpt2")


@pytest.mark.parametrize("task", ["math", "tools"])
def test_train_tiny_overwrite_never_deletes_a_folder_that_is_not_a_checkpoint(tmp_path, task):
    """``train-tiny --out <the user's folder> --overwrite`` replaced the folder and its files with the model;
    a non-empty folder that is not a treadle checkpoint is refused (exit 2) before training, untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    r = CliRunner().invoke(app, ["model", "train-tiny", "--quick", "--task", task, "--out", str(mine), "--overwrite"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--out" in lines[0] and "not a treadle checkpoint" in lines[0], r.output
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (mine / "notes.txt").read_text() == "precious"


def test_train_tiny_force_refuses_a_foreign_folder_before_training(tmp_path):
    from treadle.models.tiny import NotACausalLMError, TinyTrainConfig, train_tiny

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(NotACausalLMError, match="not a treadle checkpoint"):
        train_tiny(TinyTrainConfig.quick(), mine, force=True, progress=False)
    assert (mine / "notes.txt").read_text() == "precious"


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_model_command_takes_model_flag(cmd, ckpts, tmp_path):
    """``--model PATH`` names the checkpoint in every command (model eval took only a positional PATH)."""
    _refused([*cmd, "--model", str(ckpts["cut"])], tmp_path, "--model", "model.safetensors")


def test_model_eval_path_and_model_flag_must_agree(tmp_path):
    _refused(["model", "eval", "/a", "--model", "/b"], tmp_path, "--model: give the checkpoint once")
