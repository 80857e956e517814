"""WEFT on TRL: the environment class, its dataset, atomic-turn GRPO steps of trl.GRPOTrainer on CPU."""
import inspect

import pytest
import torch

from treadle.testing import require_module


@pytest.fixture(scope="module")
def backend():
    from treadle.weft.rl.trl_env import WeftBackend

    be = WeftBackend()
    yield be
    be.close()


def test_environment_tools_are_the_servers_with_typed_signatures(backend):
    require_module("trl")
    from transformers.utils import get_json_schema

    from treadle.weft.rl.trl_env import weft_environment

    Env = weft_environment(backend)
    names = {s["name"] for s in backend.tools()}
    methods = {n for n, _ in inspect.getmembers(Env, inspect.isfunction) if not n.startswith("_")}
    assert methods == names | {"reset", "get_reward"}
    env = Env()
    def fn_schema(f):
        s = get_json_schema(f)
        return s.get("function", s)

    schema = fn_schema(env.place_order)
    assert schema["name"] == "place_order" and schema["parameters"]["required"] == ["customer_id", "items"]
    assert schema["parameters"]["properties"]["customer_id"]["type"] == "integer"
    assert schema["parameters"]["properties"]["items"]["type"] == "array"
    assert "search" in fn_schema(env.search_products)["description"].lower()


def test_reset_forks_the_rows_state_and_reward_is_the_verdict(backend):
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset

    ds = weft_turn_dataset(1, "train", start=3, backend=backend)
    assert len(ds) == 2 and ds[0]["weft_turn"] == 0 and ds[1]["weft_turn"] == 1
    Env = weft_environment(backend)
    gold = backend.gold("train", 3).starts[0].atomic.checkpoint.gold_calls
    a, b = Env(), Env()
    a.reset(**ds[0])
    b.reset(**ds[0])
    for call in gold:  # a plays the gold calls, b does nothing
        out = getattr(a, call.name)(**call.arguments)
        assert not out.startswith("Error"), out
    assert a.get_reward() == 1.0 and b.get_reward() == 0.0
    b.reset(**ds[0])  # the same start again: a's calls are not in b's fork
    for call in gold:
        getattr(b, call.name)(**call.arguments)
    assert b.get_reward() == 1.0 and not b.flags
    # arguments outside the schema: a typed tool error the policy sees, and the turn is flagged
    out = getattr(b, gold[0].name)(not_a_field=1)
    assert out.startswith("Error (invalid_args)") and "interface_violation" in b.flags
    getattr(b, gold[0].name)(**gold[0].arguments)
    assert "repetition" in b.flags


def test_bad_rows_raise_one_clear_error(backend):
    from treadle.weft.rl.trl_env import WeftRowError, weft_environment

    env = weft_environment(backend)()
    with pytest.raises(WeftRowError, match="names no WEFT turn start"):
        env.reset(prompt=[{"role": "user", "content": "hi"}])
    with pytest.raises(WeftRowError, match="weft_turn must be an int in 0..1"):
        env.reset(weft_split="train", weft_episode=0, weft_turn=5)
    with pytest.raises(WeftRowError, match="weft_split"):
        env.reset(weft_split="test", weft_episode=0, weft_turn=0)


def _trainer(tmp_path, backend, **overrides):
    require_module("trl")
    from trl import GRPOConfig

    from treadle.models.builders import build_tiny_model
    from treadle.weft.rl.trl_env import weft_environment, weft_turn_dataset
    from treadle.weft.rl.trl_trainer import WeftGRPOTrainer
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tok = build_tool_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=48,
              max_steps=2, report_to=[], use_cpu=True, save_strategy="no", remove_unused_columns=False,
              max_tool_calling_iterations=2, learning_rate=1e-3, logging_steps=1)
    kw.update(overrides)
    return WeftGRPOTrainer(model=model, args=GRPOConfig(**kw), processing_class=tok, skip_zero_advantage=True,
                           train_dataset=weft_turn_dataset(2, "train", backend=backend),
                           environment_factory=weft_environment(backend))


def test_two_grpo_trainer_steps_with_flags_and_env_failures(tmp_path, backend, monkeypatch):
    trainer = _trainer(tmp_path, backend)
    seen = []
    original = trainer._generate_and_score_completions

    def spy(inputs):
        envs_before = None
        out = original(inputs)
        envs_before = list(trainer.environments)
        seen.append((out["advantages"].clone(), trainer._treadle_rewards_per_func[:, -1].clone(),
                     [bool(e.flags) for e in envs_before], [e.env_failure for e in envs_before],
                     out["completion_mask"].clone()))
        return out

    trainer._generate_and_score_completions = spy
    # one rollout's environment fails: left out of the group and of the loss
    Env = trainer.environment_factories[None]
    real = Env.get_reward
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 1:
            self.env_failure = "shop: crash: injected"
            return None
        return real(self)

    monkeypatch.setattr(Env, "get_reward", flaky)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) >= 2
    changed = any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.model.parameters()))
    adv, rewards, flagged, failures, cmask = seen[0]
    assert torch.isnan(rewards[0]) and failures[0] is not None
    assert adv[0].item() == 0.0 and cmask[0].sum().item() == 0  # no group part, no loss part
    for a, f in zip(adv.tolist(), flagged):
        assert not f or a <= 0.0  # flagged turns never get a positive advantage
    assert changed or all(s[0].abs().sum() == 0 for s in seen)


@pytest.mark.parametrize("override,match", [({"remove_unused_columns": True}, "remove_unused_columns=False"),
                                            ({"multi_objective_aggregation": "normalize_then_sum"},
                                             "sum_then_normalize")])
def test_configs_trl_would_misread_are_refused(tmp_path, backend, override, match):
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, backend, **override)


def test_a_tokenizer_without_a_response_parser_is_refused(tmp_path, backend):
    require_module("trl")
    from trl import GRPOConfig

    from treadle.weft.rl.trl_env import check_weft_trl_config
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tok = build_tool_tokenizer()
    tok.response_template = None
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                      remove_unused_columns=False, report_to=[])
    with pytest.raises(ValueError, match="response_template"):
        check_weft_trl_config(args, tok, None)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_skipping_zero_advantage_rows_gives_the_same_loss_and_gradient(tmp_path, backend, loss_type):
    """``skip_zero_advantage``: the rows of all-equal groups (advantage 0) and the padding no other row uses are
    left out of the update's forward and backward; loss and gradient equal the whole micro-batch's."""
    trainer = _trainer(tmp_path, backend, loss_type=loss_type, max_completion_length=16)
    model = trainer.model.train().double()
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    B, P, C = 6, 9, 7
    plen, clen = [9, 4, 6, 2, 8, 3], [7, 2, 5, 1, 3, 6]
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in plen])
    completion_mask = torch.tensor([[1] * n + [0] * (C - n) for n in clen])
    inputs = {"prompt_ids": torch.randint(5, 90, (B, P), generator=g) * prompt_mask,
              "prompt_mask": prompt_mask,
              "completion_ids": torch.randint(5, 90, (B, C), generator=g) * completion_mask,
              "completion_mask": completion_mask,
              "tool_mask": torch.ones(B, C, dtype=torch.long),
              "advantages": torch.tensor([0.0, 1.5, 0.0, -0.7, 0.0, 0.0], dtype=torch.float64),
              "old_per_token_logps": -torch.rand(B, C, generator=g, dtype=torch.float64) * 3,
              "num_items_in_batch": completion_mask.sum().double()}
    inputs["tool_mask"][1, 3:5] = 0

    def run(skip):
        trainer.skip_zero_advantage = skip
        model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full, gf = run(False)
    part, gp = run(True)
    # float64 model; the RoPE tables are float32 (transformers), and dropping left padding shifts the positions:
    # ~3e-8 relative
    assert torch.allclose(part, full, rtol=1e-6, atol=1e-12), (part, full)
    assert len(gf) == len(gp) and all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(gf, gp))
    assert any(a.abs().sum() > 0 for a in gf)
    inputs["advantages"] = torch.zeros(B, dtype=torch.float64)  # all-equal groups only: no forward, zero loss
    loss, grads = run(True)
    assert loss.item() == 0.0 and all(gr.abs().sum() == 0 for gr in grads)


def test_skip_zero_advantage_is_off_where_zero_rows_add_to_the_loss(tmp_path, backend):
    trainer = _trainer(tmp_path, backend, top_entropy_quantile=0.5)  # (it ranks every row's tokens)
    assert not trainer._zero_rows_add_nothing()
