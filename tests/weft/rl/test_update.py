"""The GRPO update of `treadle weft train`: advantage-to-token mapping, loss sign, aggregation weights, resume."""
import copy
import json

import pytest
import torch

from treadle.weft.rl.train import WeftTrainConfig, _logprobs, _rows_batch, _update, signed_weight


def test_rows_batch_puts_the_advantage_on_this_turns_policy_tokens_only():
    # prefix [5, 6, 7]; response [8, 9, 10, 11] where 10 is a tool-output token (mask 0)
    ids, mask, adv = _rows_batch([((5, 6, 7), (8, 9, 10, 11), (1, 1, 0, 1), 0.5),
                                  ((5, 6), (8,), (1,), -1.0)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10, 11], [5, 6, 8, 0, 0, 0, 0]]
    # logprob position j scores token j + 1: tokens 8, 9, 11 of row 0 sit at positions 3, 4, 6
    assert mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert adv.tolist() == [0.5, -1.0]


def _policy_logprob(model, row):
    ids, mask, _ = _rows_batch([row], pad_id=0)
    with torch.no_grad():
        return float((_logprobs(model, ids) * mask).sum())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_raises_the_likelihood_of_positive_rows_and_lowers_negative_ones(tiny_policy, mode):
    """One update: the row with A > 0 becomes more likely, the row with A < 0 less likely (the loss sign),
    and a zero-advantage row's tokens are not a target (its likelihood moves only through shared weights)."""
    model = copy.deepcopy(tiny_policy)
    good = ((5, 6, 7), (8, 9, 3), (1, 1, 1), 1.0)
    bad = ((5, 6, 7), (20, 21, 3), (1, 1, 1), -1.0)
    before = [_policy_logprob(model, r) for r in (good, bad)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = WeftTrainConfig(num_iterations=1, loss_agg_mode=mode)
    stats = _update(model, opt, [good, bad, ((5, 6, 7), (30, 3), (1, 1), 0.0)], 0, cfg)
    after = [_policy_logprob(model, r) for r in (good, bad)]
    assert after[0] > before[0] and after[1] < before[1]
    assert stats["rows_updated"] == 2


def test_signed_weight_counts_tokens_under_token_mean_and_rows_under_seq_mean():
    rows = [((1,), (2, 3, 4, 5), (1, 1, 1, 1), -0.5),  # a long failed candidate: 4 policy tokens
            ((1,), (2, 3), (1, 0), 1.5),               # a short passing one: 1 policy token
            ((1,), (2,), (1,), 0.0)]
    tm = signed_weight(rows, "token-mean")
    assert tm["weight_neg"] == pytest.approx(2.0) and tm["weight_pos"] == pytest.approx(1.5)
    assert tm["neg_share"] == pytest.approx(2.0 / 3.5)
    sm = signed_weight(rows, "seq-mean-token-mean")
    assert sm["weight_neg"] == pytest.approx(0.5) and sm["weight_pos"] == pytest.approx(1.5)
    assert sm["neg_share"] == pytest.approx(0.25)


def test_unknown_loss_aggregation_is_refused():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        WeftTrainConfig(loss_agg_mode="token-sum")


def test_comparison_reuses_finished_runs_of_the_same_config_and_start(tmp_path, tiny_policy, tok):
    """A re-run into the same folder keeps finished (grouping, seed) runs with the same config and start
    policy (no new samples), and re-runs them when the start policy differs."""
    from rich.console import Console

    from treadle.weft.rl.report import run_comparison

    quiet = Console(file=open(tmp_path / "log.txt", "w"))
    kw = dict(steps=1, quick=True, console=quiet, overrides={"eval_episodes": 1}, jobs=1)
    first = run_comparison(tmp_path / "r", (tiny_policy, tok), ("atomic",), [0], **kw)
    log = tmp_path / "r" / "atomic-seed0" / "steps.jsonl"
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    g = first["groupings"]["atomic"]  # no-signal groups are counted in the summary
    assert g["groups"] == sum(r["groups"] for r in recs) > 0
    assert g["all_equal_groups"] == sum(r["all_equal_groups"] for r in recs)
    log.write_text("marker\n")  # a re-run would rewrite it
    again = run_comparison(tmp_path / "r", (tiny_policy, tok), ("atomic",), [0], **kw)
    assert again["reused_runs"] == ["atomic-seed0"] and log.read_text() == "marker\n"
    assert again["groupings"]["atomic"]["per_seed"] == first["groupings"]["atomic"]["per_seed"]
    other = copy.deepcopy(tiny_policy)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    third = run_comparison(tmp_path / "r", (other, tok), ("atomic",), [0], **kw)
    assert third["reused_runs"] == [] and log.read_text() != "marker\n"
    assert json.loads((tmp_path / "r" / "atomic-seed0" / "summary.json").read_text())["policy_sha256"]


def test_kl_k3_is_zero_at_the_reference_and_positive_elsewhere():
    from treadle.grpo.losses import kl_k3

    ref = torch.log(torch.tensor([[0.5, 0.25, 0.125]], dtype=torch.float64))
    assert kl_k3(ref, ref).abs().max().item() == 0.0
    logp = ref + torch.tensor([[0.3, -0.2, 0.0]], dtype=torch.float64)
    k = kl_k3(logp, ref)
    d = -torch.tensor([0.3, -0.2, 0.0], dtype=torch.float64)
    assert torch.allclose(k[0], torch.exp(d) - d - 1)
    assert k[0, 0] > 0 and k[0, 1] > 0 and k[0, 2] == 0


def test_kl_penalty_pulls_zero_advantage_rows_back_to_the_reference(tiny_policy):
    """With only zero-advantage rows the policy gradient is 0: no update without KL; with kl_coef > 0 and a
    policy that has drifted from the reference, the update moves the row's likelihood back towards it."""
    ref = copy.deepcopy(tiny_policy)
    drifted = copy.deepcopy(tiny_policy)
    row = ((5, 6, 7), (8, 9, 3), (1, 1, 1), 0.0)
    live = ((5, 6, 7), (20, 3), (1, 1), 1e-12)  # a live row so that the update runs; negligible advantage
    with torch.no_grad():
        for p in drifted.parameters():
            p.add_(0.05 * torch.randn_like(p))
    from treadle.grpo.losses import kl_k3

    ids, mask, _ = _rows_batch([row], pad_id=0)

    def gap(m):  # the k3 KL to the reference on the row's policy tokens
        with torch.no_grad():
            return float((kl_k3(_logprobs(m, ids), _logprobs(ref, ids)) * mask).sum())

    before = gap(drifted)
    stats = _update(drifted, torch.optim.SGD(drifted.parameters(), lr=0.01), [row, live], 0,
                    WeftTrainConfig(num_iterations=3, kl_coef=1.0), ref)
    assert stats["kl_ref"] > 0
    assert before > 0 and gap(drifted) < 0.9 * before
    same = copy.deepcopy(tiny_policy)
    _update(same, torch.optim.SGD(same.parameters(), lr=0.05), [row, live], 0,
            WeftTrainConfig(num_iterations=3, kl_coef=0.0), ref)
    assert _policy_logprob(same, row) == pytest.approx(_policy_logprob(tiny_policy, row), abs=1e-6)


@pytest.mark.parametrize("kw", [{"kl_coef": -0.1}, {"kl_coef": float("nan")}])
def test_bad_kl_coef_is_refused(kw):
    with pytest.raises(ValueError, match="kl_coef"):
        WeftTrainConfig(**kw)


def test_kl_penalty_needs_the_data_parallel_reference_before_any_work(tiny_policy, tok):
    """Data-parallel hooks built without a reference model (``WeftDataParallel(reference=False)``; the
    trainer ``train_policy_dp`` builds it with one when ``kl_coef > 0``) are refused before any work."""
    import types

    import anyio

    from treadle.weft.rl.train import train_policy

    model = copy.deepcopy(tiny_policy)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="kl_coef.*reference"):
        anyio.run(lambda: train_policy(model, tok, WeftTrainConfig.quick(kl_coef=0.1),
                                       dp=types.SimpleNamespace(ref_model=None), progress=False))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
