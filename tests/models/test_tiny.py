"""The embedded tiny model: tokenizer, training (tiny setting), checkpoint round trip, atomic saves,
and clear errors for missing / non-causal / half-written / corrupted checkpoints."""
import json
import shutil

import pytest
import torch

from treadle.models import (CorruptCheckpointError, NotACausalLMError, TinyTrainConfig, build_tokenizer, cache_root,
                            load_default_model, train_tiny)
from treadle.models.tiny import MARKER, PARTIAL

CFG = TinyTrainConfig.quick(steps=3, eval_per_level=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    result = train_tiny(CFG, root / "tiny", progress=False)
    return result


def test_tokenizer_roundtrip_and_template():
    tok = build_tokenizer()
    s = "Ann has 7 pens. What is (41*5)-82?\nSolve 3*x+4=19 for x."
    ids = tok(s, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == s
    text = tok.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == len("\nWhat is 3+4?\n\n") + 5


def test_checkpoint_roundtrip(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = trained.path
    assert (path / MARKER).exists() and not (path / PARTIAL).exists()
    assert not list(path.parent.glob("tiny.tmp-*"))
    info = json.loads((path / MARKER).read_text())
    assert set(info["accuracy"]) == {"1", "2", "3", "4", "5", "6"} and info["config"]["steps"] == 3
    hf = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    model, tok2 = load_default_model(path)
    ids = tok(["What is 3+4?"], return_tensors="pt")["input_ids"]
    torch.testing.assert_close(model(input_ids=ids).logits, hf(input_ids=ids).logits)
    assert tok2.chat_template == tok.chat_template == build_tokenizer().chat_template
    # an existing complete checkpoint is reused, not retrained
    again = train_tiny(CFG, path, progress=False)
    assert again.seconds == 0.0 and again.accuracy == trained.accuracy


def test_training_is_deterministic(trained, tmp_path):
    other = train_tiny(CFG, tmp_path / "again", progress=False)
    from safetensors.torch import load_file

    a, b = load_file(trained.path / "model.safetensors"), load_file(other.path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_default_cache_trains_once_and_reports_corruption(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    with pytest.raises(FileNotFoundError, match="train-tiny"):
        load_default_model(train_if_missing=False)
    shutil.copytree(trained.path, tmp_path / "tiny-qwen3")
    model, tok = load_default_model(train_if_missing=False)  # the cached copy loads
    assert model.config.model_type == "qwen3"

    (tmp_path / "tiny-qwen3" / MARKER).unlink()  # half-written: no completion marker
    with pytest.raises(CorruptCheckpointError, match=r"no completion marker.*never replaces") as info:
        load_default_model()  # --overwrite would refuse this folder too (refuse_foreign_folder): never suggested
    assert "--overwrite`" not in str(info.value)
    shutil.rmtree(tmp_path / "tiny-qwen3")

    # a killed save: the temp folder is left, never the final one; the next run cleans it and trains
    killed = tmp_path / "tiny-qwen3.tmp-999999999"
    shutil.copytree(trained.path, killed)
    (killed / PARTIAL).write_text("")
    res = train_tiny(CFG, tmp_path / "tiny-qwen3", progress=False)
    assert not killed.exists() and (res.path / MARKER).exists()

    shutil.copytree(res.path, tmp_path / "partial")
    (tmp_path / "partial" / PARTIAL).write_text("")
    with pytest.raises(CorruptCheckpointError, match="half-written") as err:
        load_default_model(tmp_path / "partial")
    assert f"`treadle model train-tiny --out {tmp_path / 'partial'} --overwrite`" in str(err.value)

    weights = tmp_path / "tiny-qwen3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="SHA-256"):
        load_default_model()
    with open(weights, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_default_model()


def test_bad_paths(tmp_path):
    from transformers import ViTConfig

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_default_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotACausalLMError, match="no config.json"):
        load_default_model(tmp_path / "empty")
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(NotACausalLMError, match="is a file"):
        load_default_model(tmp_path / "file.bin")
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(tmp_path / "vit")
    with pytest.raises(NotACausalLMError, match="not a causal LM"):
        load_default_model(tmp_path / "vit")
    with pytest.raises(TypeError, match="TinyTrainConfig"):
        train_tiny({"steps": 1}, tmp_path / "x")
    with pytest.raises(ValueError, match="difficulty level"):
        TinyTrainConfig(level_weights={9: 1.0})


def test_cli_train_tiny_reuses_checkpoint(tmp_path):
    from typer.testing import CliRunner

    from treadle.models.cli import app

    # a checkpoint trained with exactly the settings `train-tiny --quick --steps 3` asks for is reused;
    # one trained with other settings is refused (the run-folder rule), never silently replaced
    path = train_tiny(TinyTrainConfig.quick(steps=3), tmp_path / "tiny", progress=False).path
    res = CliRunner().invoke(app, ["train-tiny", "--quick", "--steps", "3", "--out", str(path), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "already holds this model (same settings)" in res.output and "accuracy" in res.output
    res = CliRunner().invoke(app, ["train-tiny", "--quick", "--steps", "4", "--out", str(path), "--no-progress"])
    assert res.exit_code == 2 and "other settings" in res.output, res.output


def test_stale_cache_from_other_settings_is_retrained(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path))
    shutil.copytree(trained.path, tmp_path / "tiny-qwen3")
    load_default_model(config=CFG)  # same settings: reused as is
    assert json.loads((tmp_path / "tiny-qwen3" / MARKER).read_text())["config"]["steps"] == 3
    load_default_model(config=TinyTrainConfig.quick(steps=2, eval_per_level=1))
    assert json.loads((tmp_path / "tiny-qwen3" / MARKER).read_text())["config"]["steps"] == 2


def test_config_is_validated_field_by_field():
    import dataclasses

    import pydantic

    for bad, field in ((dict(steps=0), "steps"), (dict(steps=True), "steps"), (dict(batch_size=2.5), "batch_size"),
                       (dict(lr=float("nan")), "lr"), (dict(lr=0.0), "lr"), (dict(min_lr_rate=1.5), "min_lr_rate"),
                       (dict(threads=0), "threads"), (dict(level_weights={1: -1.0}), "level_weights"),
                       (dict(final_fraction=-0.1), "final_fraction"), (dict(final_fraction=1.0), "final_fraction"),
                       (dict(final_level_weights={7: 1.0}), "final_level_weights"),
                       (dict(final_fraction=0.2, final_level_weights=None), "final_level_weights"),
                       (dict(stepz=3), "stepz")):
        with pytest.raises(pydantic.ValidationError, match=field):
            TinyTrainConfig(**bad)
    with pytest.raises(ValueError, match="must divide by num_heads"):
        TinyTrainConfig(hidden_size=10)
    cfg = TinyTrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3
    assert dataclasses.asdict(cfg)["level_weights"] == cfg.level_weights
    assert TinyTrainConfig(**cfg.as_dict()) == cfg  # the marker's JSON round-trips
    assert json.loads(json.dumps(cfg.as_dict())) == cfg.as_dict()


def test_final_phase_draws_from_its_own_mixture(tmp_path, monkeypatch):
    from treadle.data.arithmetic import ProblemGenerator

    seen = []
    real = ProblemGenerator.mixture
    monkeypatch.setattr(ProblemGenerator, "mixture", lambda self, n, w, **kw: (seen.append(dict(w)), real(self, n, w, **kw))[1])
    cfg = TinyTrainConfig.quick(steps=5, eval_per_level=1, level_weights={2: 1.0, 3: 1.0}, final_fraction=0.4,
                                final_level_weights={1: 3.0, 4: 0.0})
    assert cfg.final_steps == 2
    train_tiny(cfg, tmp_path / "t", progress=False)
    assert seen == [{2: 1.0, 3: 1.0}] * 3 + [{1: 3.0}] * 2  # zero weights dropped
    assert cfg.as_dict()["final_level_weights"] == {"1": 3.0, "4": 0.0}
    assert TinyTrainConfig(**cfg.as_dict()) == cfg


def test_default_recipe_has_a_final_phase():
    cfg = TinyTrainConfig()
    assert 0 < cfg.final_steps < cfg.steps and cfg.final_level_weights[1] == max(cfg.final_level_weights.values())


def test_training_pins_threads_and_restores_them(tmp_path, monkeypatch):
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    before = torch.get_num_threads()
    train_tiny(TinyTrainConfig.quick(steps=1, eval_per_level=1, threads=3), tmp_path / "t", progress=False)
    assert seen == [3, before] and torch.get_num_threads() == before


def test_lock_errors_are_checkpoint_errors(tmp_path):
    from filelock import FileLock

    from treadle.models import CheckpointError
    from treadle.models.tiny import cache_lock

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot write the checkpoint folder"):
        train_tiny(CFG, tmp_path / "file" / "tiny", progress=False)
    with FileLock(str(tmp_path / ".busy.lock")):
        with pytest.raises(CheckpointError, match="another process"):
            with cache_lock(tmp_path / "busy", timeout=0.05):
                pass
    with cache_lock(tmp_path / "busy", timeout=0.05):  # released: free again
        pass


def test_checkpoint_vocab_size_reads_nested_text_configs(tmp_path, trained):
    import transformers as tf

    from treadle.models.tiny import checkpoint_vocab_size

    assert checkpoint_vocab_size(trained.path) == len(build_tokenizer())
    tf.Qwen3_5Config(text_config=dict(vocab_size=123, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)).save_pretrained(tmp_path / "vl")
    assert "vocab_size" not in json.loads((tmp_path / "vl" / "config.json").read_text())  # only the nested one
    assert checkpoint_vocab_size(tmp_path / "vl") == 123
    with pytest.raises(NotACausalLMError, match="not a loadable"):
        checkpoint_vocab_size(tmp_path)


def test_no_progress_bar_into_a_file_or_pipe(tmp_path, capfd):
    """``progress=True`` (the default of load_default_model, e.g. in the GRPO demo) draws a tqdm bar only
    when stderr is a terminal: a `make demo > log` once filled its log with train-tiny bars. Same rule for
    every treadle bar (``treadle.cli_output.progress_enabled``)."""
    train_tiny(TinyTrainConfig.quick(steps=2, eval_per_level=1), tmp_path / "t", progress=True)
    out, err = capfd.readouterr()
    # (transformers' own "Writing model shards" bar is silenced by the CLI: treadle.cli_output.quiet_third_party)
    assert "train-tiny" not in err and "train-tiny" not in out, err
