"""WEFT atomic-turn GRPO on TRL's ``GRPOTrainer`` with 2 gloo ranks (accelerate's CPU DDP) equals one process on
the same global batch: the trained parameters, the step losses and rewards. What makes it exact is
:class:`treadle.grpo.row_keyed.RowKeyedSampling`: each row samples from a generator of its own, keyed by its
context, so the tokens of a row do not depend on how the batch is split over ranks (plain ``do_sample`` draws
all rows from one stream, which no per-rank seed can reproduce). A checkpoint written by the 2-rank run resumes
in one process, and one written by one process resumes on 2 ranks, and both continue the uninterrupted run."""
import json
import shutil

import pytest
import torch

from treadle.testing import require_module

W = 2
# 4 turn groups of G = 2 per step: 2 groups (4 rows) per rank; 3 optimizer steps, one generation each
# (num_iterations 1); max_new_tokens 48 x max_steps 2: room for a gold call, its tool result and the reply
CFG = dict(steps=3, turns_per_step=4, G=2, num_iterations=1, max_new_tokens=48, max_steps=2, lr=1e-2,
           eval_episodes=1, eval_samples=2)
# plain SGD: an update is proportional to the gradient, so the runs differ by the rounding of TRL's float32
# log-probabilities (its chunked log-prob kernel computes in float32 whatever the model's dtype), ~1e-9 here.
# Adam divides each gradient entry by sqrt(v) + eps, which turns that rounding in near-zero entries into
# updates of up to ~lr * 1e-2 (measured ~5e-5 after 3 steps at lr 1e-2): not a property of the split
# SGD with momentum: the optimizer state a resumed run must restore
OPTIM = dict(optim="sgd", optim_args="momentum=0.9", learning_rate=1.0)
# float64 policy: the two runs differ by the rounding of batched logits and of DDP's gradient mean (~1e-12); an
# update moves weights by ~lr = 1e-2 and a wrong split of the batch (another sample, another group) by a like
# amount: the tolerance of the loop's 2-rank tests
TOL = dict(rtol=1e-6, atol=1e-7)


def _policy():
    from treadle.models.builders import build_tiny_model
    from treadle.weft.rl.vocab import build_tool_tokenizer, with_tool_calling

    tok = with_tool_calling(build_tool_tokenizer())
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).double()
    return model, tok


def _mixed_sampling(tok, data, backend):
    """Row-keyed sampling where a row whose key is even writes its turn's next gold message (the gold call,
    then the reply: the turn passes) and an odd one samples the untrained policy (noise: fails), so groups
    carry reward signal; every row's tokens depend on the row alone."""
    from treadle.grpo.row_keyed import RowGumbel, RowKeyedSampling
    from treadle.weft.rl.gold import REPLY
    from treadle.weft.rollouts.harnesses import HermesHarness

    h = HermesHarness()
    plans = []
    for r in data:
        calls = backend.gold(r["weft_split"], r["weft_episode"]).starts[r["weft_turn"]].atomic.checkpoint.gold_calls
        last_user = [m["content"] for m in r["prompt"] if m["role"] == "user"][-1]
        tools_before = sum(m["role"] == "tool" for m in r["prompt"])
        plans.append((len(r["prompt"]), last_user, tools_before, [h.render([c]).text for c in calls] + [REPLY]))

    def gold_ids(ids):
        text = tok.decode(ids)
        k = max((i for i, p in enumerate(plans) if p[1] in text), key=lambda i: plans[i][0])
        done = text.count("<|im_start|>tool") - plans[k][2]
        msgs = plans[k][3]
        return tok(msgs[min(done, len(msgs) - 1)], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    class Forced(RowGumbel):
        def __init__(self, keys, gc, input_ids, mask):
            super().__init__(keys, gc.temperature or 1.0)
            ctx = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
            self.start = input_ids.shape[1]
            self.forced = {i: gold_ids(c) for i, (c, key) in enumerate(zip(ctx, keys)) if key % 2 == 0}

        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            t = input_ids.shape[1] - self.start
            for i, ids in self.forced.items():
                out[i] = float("-inf")
                out[i, ids[min(t, len(ids) - 1)]] = 0.0
            return out

    class Mixed(RowKeyedSampling):
        def processor(self, keys, generation_config, input_ids, attention_mask):
            return Forced(keys, generation_config, input_ids, attention_mask)

    return Mixed()


def _train(out_dir, world: int, *, max_steps=None, resume=None, **overrides):
    """One run (this process is one of ``world`` ranks): the trained parameters and TRL's log."""
    require_module("trl")
    from treadle.weft.rl.config import WeftTrainConfig
    from treadle.weft.rl.trl_env import default_backend, weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_run import grpo_config
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer

    torch.set_num_threads(1)
    cfg = WeftTrainConfig.quick(**CFG)
    backend = default_backend()
    data = weft_turn_dataset(cfg.steps * cfg.turns_per_step // 2, "train", start=500_000, backend=backend)
    model, tok = _policy()
    args = grpo_config(cfg, out_dir, per_device_train_batch_size=cfg.turns_per_step * cfg.G // world,
                       save_strategy="steps", save_steps=1, **({"max_steps": max_steps} if max_steps else {}),
                       **{**OPTIM, **overrides})
    trainer = WeftGRPOTrainer(model=model, args=args, processing_class=tok, train_dataset=data,
                              environment_factory=weft_environment(backend),
                              callbacks=[_mixed_sampling(tok, data, backend)])
    trainer.train(resume_from_checkpoint=resume)
    log = [{k: r[k] for k in ("step", "loss", "reward", "grad_norm") if k in r} for r in trainer.state.log_history if "loss" in r]
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "log": log,
            "world": trainer.accelerator.num_processes}


def _ranks_worker(out_dir):
    return _train(out_dir, W)


def _resume_worker(out_dir, checkpoint):
    return _train(out_dir, W, resume=checkpoint)


def _close(got, ref, label):
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["params"][n], p, **TOL, msg=lambda m, n=n: f"{label} {n}: {m}")
    assert [r["step"] for r in got["log"]] == [r["step"] for r in ref["log"]]
    for a, b in zip(got["log"], ref["log"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9), label
        assert a["reward"] == pytest.approx(b["reward"], rel=1e-9), label
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=1e-9), label


@pytest.mark.slow
def test_two_ranks_train_what_one_process_trains_and_resume_across_world_sizes(run_ranks, tmp_path, outside_torchrun):
    one = _train(tmp_path / "one", 1)
    start, _ = _policy()
    moved = max((one["params"][n] - p.detach()).abs().max().item() for n, p in start.named_parameters())
    assert moved > 1e-2  # the groups carried signal: the tolerance can fail
    rewards = [r["reward"] for r in one["log"]]
    assert any(0 < r < 1 for r in rewards), rewards  # passing and failing candidates

    res = run_ranks(_ranks_worker, W, tmp_path / "two")
    for r in res:  # every rank ends with the single process's parameters
        assert r["world"] == W
        _close(r, one, "2 ranks")

    # the 2-rank run's checkpoint of step 2, resumed by ONE process for step 3, continues the uninterrupted run
    part = tmp_path / "part"
    part.mkdir()
    shutil.copytree(tmp_path / "two" / "checkpoint-2", part / "checkpoint-2")
    state = json.loads((part / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    resumed = _train(part, 1, resume=str(part / "checkpoint-2"))
    _close({"params": resumed["params"], "log": resumed["log"][-1:]},
           {"params": one["params"], "log": one["log"][-1:]}, "2 ranks -> 1")

    # and the single process's checkpoint of step 2 resumed by 2 ranks
    back = tmp_path / "back"
    back.mkdir()
    shutil.copytree(tmp_path / "one" / "checkpoint-2", back / "checkpoint-2")
    for r in run_ranks(_resume_worker, W, back, str(back / "checkpoint-2")):
        _close({"params": r["params"], "log": r["log"][-1:]}, {"params": one["params"], "log": one["log"][-1:]},
               "1 -> 2 ranks")
