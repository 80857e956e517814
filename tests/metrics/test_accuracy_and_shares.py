"""Metrics with known counts: the tiny models' accuracy per level (models.generation.accuracy_by_level)
with generation replaced by scripted completions, and SCALE's lambda shares (reverse / suppress /
keep / extrapolate, SCALE sec. 5) on hand-built lambdas, per module, per module type and overall."""
import types

import pytest
import torch

from treadle.data.arithmetic import ProblemGenerator
from treadle.models import generation
from treadle.scale import gates
from treadle.scale.gates import lambda_report, lambda_shares


def test_accuracy_by_level_counts_known_right_answers(monkeypatch):
    gen = ProblemGenerator(seed=7)
    sets = {1: gen.batch(1, 5, split="heldout"), 3: gen.batch(3, 4, split="heldout"), 2: []}
    # scripted completions: level 1 right on problems 0, 2, 3; level 3 right on problem 1 only;
    # wrong answers are the gold plus one, or text math-verify cannot parse
    right = {1: {0, 2, 3}, 3: {1}}
    script = []  # in the order accuracy_by_level asks (levels in dict order; prompts may repeat)
    for lv, probs in sets.items():
        for i, p in enumerate(probs):
            script.append((p.prompt, f"The answer is {p.answer}" if i in right[lv]
                           else (f"{int(p.answer) + 1}" if i % 2 else "no idea")))
    calls = []

    def fake_generate(model, tokenizer, prompts, *, max_new_tokens):
        calls.append(len(prompts))
        start = sum(calls[:-1])
        assert [q for q, _ in script[start:start + len(prompts)]] == prompts
        return types.SimpleNamespace(texts=[a for _, a in script[start:start + len(prompts)]])

    monkeypatch.setattr(generation, "generate", fake_generate)
    acc = generation.accuracy_by_level(None, None, sets, batch_size=2)
    assert acc == {1: 3 / 5, 3: 1 / 4, 2: 0.0}
    assert calls == [2, 2, 1, 2, 2]  # batches of at most 2; no call for the empty level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_lambda_shares_known_counts_and_boundaries(dtype):
    lam = torch.tensor([-2.0, -0.0, 0.0, 0.5, 0.99, 1.0, 1.0, 1.0, 1.5, 3.0], dtype=dtype)
    # -0.0 and 0.0 are suppress (>= 0); 1.0 exactly is keep; anything above is extrapolate
    assert lambda_shares(lam) == {"reverse": 0.1, "suppress": 0.4, "keep": 0.3, "extrapolate": 0.2}
    assert sum(lambda_shares(lam).values()) == pytest.approx(1.0)


def test_lambda_shares_mask_and_shapes():
    lam = torch.tensor([[-1.0, 1.0, 2.0], [0.5, 0.5, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert lambda_shares(lam, mask) == {"reverse": 1 / 3, "suppress": 1 / 3, "keep": 1 / 3, "extrapolate": 0.0}
    assert lambda_shares(lam) == {"reverse": 1 / 6, "suppress": 2 / 6, "keep": 1 / 6, "extrapolate": 2 / 6}
    with pytest.raises(ValueError, match=r"mask must have lambda's shape \(2, 3\), got \(3,\)"):
        lambda_shares(lam, torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens selected"):
        lambda_shares(lam, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens selected"):
        lambda_shares(torch.zeros(0))


def test_lambda_report_pools_tokens_per_type_and_overall(monkeypatch):
    """Per type and overall shares pool the tokens of all layers (a token-weighted share), they are not
    the mean of the per-module shares."""
    B, S = 1, 4
    recorded = {
        "model.layers.0.self_attn.q_proj": torch.tensor([[-1.0, 0.5, 1.0, 2.0]]),
        "model.layers.1.self_attn.q_proj": torch.tensor([[2.0, 2.0, 2.0, 1.0]]),
        "model.layers.0.mlp.down_proj": torch.tensor([[0.0, 0.0, 0.0, 0.0]]),
        "model.layers.1.mlp.down_proj": None,  # not recorded: left out
    }
    layers = {n: types.SimpleNamespace(scale_last_lambda=v) for n, v in recorded.items()}
    monkeypatch.setattr(gates, "gated_layers", lambda model: layers)
    rep = lambda_report(object())
    assert set(rep["per_module"]) == {n for n, v in recorded.items() if v is not None}
    assert rep["per_module"]["model.layers.1.self_attn.q_proj"] == {"reverse": 0.0, "suppress": 0.0, "keep": 0.25,
                                                                   "extrapolate": 0.75}
    assert rep["per_type"]["q_proj"] == {"reverse": 1 / 8, "suppress": 1 / 8, "keep": 2 / 8, "extrapolate": 4 / 8}
    assert rep["per_type"]["down_proj"] == {"reverse": 0.0, "suppress": 1.0, "keep": 0.0, "extrapolate": 0.0}
    assert rep["overall"] == {"reverse": 1 / 12, "suppress": 5 / 12, "keep": 2 / 12, "extrapolate": 4 / 12}
    # a (batch, seq) mask selects the same tokens in every module
    mask = torch.tensor([[True, False, False, True]])
    assert mask.shape == (B, S)
    rep = lambda_report(object(), mask)
    assert rep["per_type"]["q_proj"] == {"reverse": 1 / 4, "suppress": 0.0, "keep": 1 / 4, "extrapolate": 2 / 4}
    assert rep["overall"] == {"reverse": 1 / 6, "suppress": 2 / 6, "keep": 1 / 6, "extrapolate": 2 / 6}


def test_lambda_report_refusals(monkeypatch):
    monkeypatch.setattr(gates, "gated_layers", lambda model: {})
    with pytest.raises(gates.GateError, match="has no gates"):
        lambda_report(object())
    monkeypatch.setattr(gates, "gated_layers", lambda model: {"a.q_proj": types.SimpleNamespace(scale_last_lambda=None)})
    with pytest.raises(gates.GateError, match="no lambda recorded"):
        lambda_report(object())
