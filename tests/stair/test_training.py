"""STAIR training, save/load, evaluation and the CLI on tiny models."""
import json

import pytest
import torch
import torch.nn.functional as F

from treadle.models import build_tiny_model
from treadle.stair import NormalsFileError, attach
from treadle.stair.evaluation import EvalConfig, evaluate
from treadle.stair.training import StairTrainConfig, make_training_sessions, stair_loss, train, train_step


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(tok, arch="qwen3", **kw):
    return build_tiny_model(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **kw)


def test_save_load_round_trip_and_refusals(tmp_path, tok):
    model = _model(tok)
    ctrl = attach(model, layers=(1, 3), eps=0.05, seed=3, backend="cpp")
    path = ctrl.save(tmp_path / "n.safetensors", extra={"step": 7})
    saved = ctrl.normals.detach().clone()
    ctrl.detach()
    ctrl2 = attach(model, layers=(1, 3), seed=4, backend="cpp")
    assert not torch.equal(ctrl2.normals, saved)
    meta = ctrl2.load(path)
    assert torch.equal(ctrl2.normals.detach(), saved)
    assert meta["layers"] == [1, 3] and meta["extra"] == {"step": 7} and meta["num_heads"] == 4
    assert "h // 2" in meta["head_mapping"]
    ctrl2.detach()
    # another layer set, another model, a bank-free file, a missing file: refused, nothing changed
    ctrl3 = attach(model, layers=(1, 2), backend="cpp")
    before = ctrl3.normals.detach().clone()
    with pytest.raises(NormalsFileError, match="layers"):
        ctrl3.load(path)
    assert torch.equal(ctrl3.normals, before)
    ctrl3.detach()
    other = _model(tok, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(NormalsFileError, match="num_heads"):
        attach(other, layers=(1, 3), backend="cpp").load(path)
    same_shape_other = _model(tok, intermediate_size=96)
    with pytest.raises(NormalsFileError, match="another model"):
        attach(same_shape_other, layers=(1, 3), backend="cpp").load(path)
    bf = attach(_model(tok), layers=(1, 3), kind="bank_free", backend="cpp")
    with pytest.raises(NormalsFileError, match="kind"):
        bf.load(path)
    with pytest.raises(FileNotFoundError):
        bf.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"normals": torch.randn(2, 4, 16)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(NormalsFileError, match="metadata"):
        bf.load(tmp_path / "bare.safetensors")


def test_stair_loss_matches_ce_and_kl():
    logits = torch.randn(2, 5, 11)
    native = torch.randn(2, 5, 11)
    labels = torch.tensor([[-100, 3, 4, -100, -100], [1, 2, -100, -100, 7]])
    loss, parts = stair_loss(logits, logits.clone(), labels, 1.0)
    sel = labels != -100
    torch.testing.assert_close(loss, F.cross_entropy(logits[sel], labels[sel]))
    assert abs(parts["kl"]) < 1e-6 and parts["tokens"] == 5
    loss2, parts2 = stair_loss(logits, native, labels, 0.5)
    kl = F.kl_div(F.log_softmax(logits[sel], -1), F.log_softmax(native[sel], -1), log_target=True,
                  reduction="batchmean")
    torch.testing.assert_close(loss2, F.cross_entropy(logits[sel], labels[sel]) + 0.5 * kl)


@pytest.mark.parametrize("arch, layers", [("qwen3", (1, 3)), ("qwen3_5", (3,))])
def test_training_step_changes_only_the_controller(arch, layers, tok):
    model = _model(tok, arch)
    for p in model.parameters():
        p.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ctrl = attach(model, layers=layers, backend="cpp")
    assert ctrl.num_trainable == len(layers) * model.config.num_attention_heads * ctrl.head_dim
    n0 = ctrl.normals.detach().clone()
    opt = torch.optim.AdamW(ctrl.parameters(), lr=0.1)
    sessions = make_training_sessions(2, 3, [2, 3], seed=0)
    responses = [["3+4 is 7 ok", "12 is my answer", "it is 5"], ["99", "1+1=2 yes", "no idea"]]
    out = train_step(ctrl, model, tok, sessions, responses)
    assert out["tokens"] > 0 and out["loss"] > 0
    assert ctrl.normals.grad is not None and ctrl.normals.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(ctrl.normals.detach(), n0)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    ctrl.detach()


def test_train_logs_saves_and_resumes(tmp_path, tok):
    model = _model(tok)
    cfg = StairTrainConfig(layers=(1, 3), steps=2, sessions=4, batch_size=2, turns=3, responses="gold", save_every=1)
    r = train(model, tok, cfg, tmp_path, resume=False, progress=False, backend="cpp")
    assert r["trainable"] == 2 * 4 * 16 and (tmp_path / "normals.safetensors").exists()
    assert model.config._attn_implementation == "sdpa"            # detached afterwards
    assert all(p.requires_grad for p in model.parameters())      # flags restored
    cfg4 = StairTrainConfig(layers=(1, 3), steps=4, sessions=4, batch_size=2, turns=3, responses="gold", save_every=1)
    train(model, tok, cfg4, tmp_path, resume=True, progress=False, backend="cpp")
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if "step" in x] == [1, 2, 3, 4]
    probes = [x for x in log if x.get("probe")]
    assert len(probes) == 2 and probes[1]["loss_before_run"] == pytest.approx(probes[0]["loss_after_run"], rel=1e-5)
    with pytest.raises(ValueError, match="another config"):
        train(model, tok, StairTrainConfig(layers=(1, 2), steps=5, sessions=4, batch_size=2, turns=3,
                                           responses="gold"), tmp_path, resume=True, progress=False)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="turns"):
        StairTrainConfig(turns=1)


def test_evaluate_all_conditions_shapes_and_determinism(tmp_path, tok):
    model = _model(tok)
    ctrl = attach(model, layers=(1, 3), backend="cpp")
    ctrl.save(tmp_path / "n.safetensors")
    ctrl.detach()
    bf = attach(model, layers=(1, 3), kind="bank_free", backend="cpp")
    with torch.no_grad():
        bf.bias.normal_()
    bf.save(tmp_path / "bf.safetensors")
    bf.detach()
    cfg = EvalConfig(sessions=2, turns=3, levels=[1, 2], k=2, max_new_tokens=4, budgets=(3,))
    res = evaluate(model, tok, cfg, normals=tmp_path / "n.safetensors", bank_free=tmp_path / "bf.safetensors",
                   backend="cpp", progress=False)
    assert set(res["conditions"]) == {"vanilla", "native", "stair", "random", "bank_free", "shuffled", "reflected",
                                      "stair@3"}
    for r in res["conditions"].values():
        assert set(r["turns"]) == {2, 3} and 0 <= r["avg"] <= r["pass"] <= 1
    for tr in res["transitions"].values():
        assert tr["pairs"] == 2 * 2 * 2 and tr["wrong_to_right"] + tr["right_to_wrong"] <= tr["pairs"]
    assert res["cost"]["prefill_s_stair"] > 0 and model.config._attn_implementation == "sdpa"
    again = evaluate(model, tok, EvalConfig(sessions=2, turns=3, levels=[1, 2], k=2, max_new_tokens=4,
                                            conditions=("native",)), progress=False, layers=(1, 3))
    assert again["conditions"]["native"] == res["conditions"]["native"] | {"turns": {
        t: {**v, "prefill_s": again["conditions"]["native"]["turns"][t]["prefill_s"]}
        for t, v in res["conditions"]["native"]["turns"].items()}}
    from treadle.stair.evaluation import bar_chart, write_jsonl

    assert bar_chart(res, tmp_path / "a.png", 2).stat().st_size > 1000
    lines = (write_jsonl(res, tmp_path / "r.jsonl")).read_text().splitlines()
    assert any(json.loads(x)["type"] == "transitions" for x in lines)


@pytest.mark.slow
def test_cli_train_and_eval_quick(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from treadle.cli import app

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    r = runner.invoke(app, ["stair", "train", "--quick", "--steps", "2", "--sessions", "4", "--batch-size", "2",
                            "--turns", "2", "--out", str(tmp_path / "run"), "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "trainable parameters" in r.output
    r = runner.invoke(app, ["stair", "eval", "--quick", "--normals", str(tmp_path / "run" / "normals.safetensors"),
                            "--sessions", "2", "--turns", "2", "--k", "2", "--max-new-tokens", "3",
                            "--conditions", "vanilla,native,stair,reflected", "--out", str(tmp_path / "ev")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ev" / "avg.png").exists() and (tmp_path / "ev" / "results.jsonl").exists()
    r = runner.invoke(app, ["stair", "train", "--quick", "--layers", "7", "--out", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "out of range" in r.output


@pytest.mark.slow
def test_demo_section_quick(tmp_path, monkeypatch):
    from rich.console import Console

    from treadle.stair.demo import run

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    out = run(tmp_path / "stair", True, Console(file=open(tmp_path / "log.txt", "w")))
    assert (tmp_path / "stair" / "eval" / "avg.png").exists()
    assert {"vanilla", "native", "stair", "random", "bank_free", "shuffled", "reflected"} <= set(out["eval"]["conditions"])
    assert out["train"]["trainable"] > 0


def test_interrupted_run_resumes_without_repeating_steps_in_the_log(tmp_path, tok, monkeypatch):
    """Ctrl-C at step 5 with checkpoints every 2 steps: the resume continues from step 4, and log.jsonl
    holds each step once (steps 5.. are redone and logged once)."""
    from treadle.stair.trainer import StairStep

    model = _model(tok)
    cfg = StairTrainConfig(layers=(1, 3), steps=6, sessions=4, batch_size=2, turns=2, responses="gold", save_every=2)
    real, calls = StairStep.forward, {"n": 0}

    def interrupted(self, idx, real_rows=True):
        calls["n"] += 1
        if calls["n"] == 6:  # during step 6, after steps 1..5 were logged
            raise KeyboardInterrupt
        return real(self, idx, real_rows)

    monkeypatch.setattr(StairStep, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(model, tok, cfg, tmp_path, progress=False, backend="cpp")
    steps = [json.loads(x)["step"] for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert model.config._attn_implementation == "sdpa" and all(p.requires_grad for p in model.parameters())
    monkeypatch.setattr(StairStep, "forward", real)
    r = train(model, tok, cfg, tmp_path, progress=False, backend="cpp")
    assert r["start_step"] == 4
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log if "step" in x] == [1, 2, 3, 4, 5, 6]
    uninterrupted = train(_model(tok), tok, cfg, tmp_path / "whole", progress=False, backend="cpp")
    for n, t in uninterrupted["normals"].items():
        torch.testing.assert_close(r["normals"][n], t)


def test_default_config_layers_adapt_to_the_model(tmp_path, tok):
    model = _model(tok)  # 4 layers: the paper's (3, 11, 19) do not exist
    cfg = StairTrainConfig(steps=1, sessions=2, batch_size=2, turns=2, responses="gold")
    assert cfg.layers == "auto"
    r = train(model, tok, cfg, tmp_path, progress=False, backend="cpp")
    assert r["layers"] == (0, 2, 3)
    assert json.loads((tmp_path / "config.json").read_text())["layers"] == list(r["layers"])


def test_report_to_tensorboard(tmp_path, tok):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = StairTrainConfig(layers=(1,), steps=2, sessions=2, batch_size=2, turns=2, responses="gold", save_every=2)
    train(_model(tok), tok, cfg, tmp_path, progress=False, backend="cpp", report_to="tensorboard")
    (events,) = tmp_path.glob("runs/*/events.out.tfevents.*")  # the Trainer's TensorBoard folder
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    loss = [e.value for e in acc.Scalars("train/loss")]
    logged = [json.loads(x)["loss"] for x in (tmp_path / "log.jsonl").read_text().splitlines() if "step" in x]
    assert loss == pytest.approx(logged, rel=1e-5)
