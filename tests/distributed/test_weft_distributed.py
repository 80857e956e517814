"""The WEFT GRPO trainer on 2 gloo ranks (DDP) equals one process on the same global batches: step
losses, rewards, group counts and the trained policy, for atomic-turn and trajectory grouping; and the
row-keyed sampler gives a row the same tokens in any batch."""
import anyio
import pytest
import torch

from treadle.weft.rl.parallel import RowKeyedSampler, row_seeds, train_policy_dp
from treadle.weft.rl.train import WeftTrainConfig, train_policy

W = 2
# 3 episodes per step (atomic: 6 turn groups; trajectory: 3 episode groups of G): parts of 2 and 1 episodes
# on the two ranks, with different policy-token counts, so per-rank token means would give another update
CFG = dict(steps=2, turns_per_step=6, G=4, eval_episodes=1, eval_samples=2, max_new_tokens=8, max_steps=2, lr=1e-2)
GROUPINGS = ("atomic", "trajectory")
FEW = {**CFG, "turns_per_step": 2}  # one episode per step: fewer than the ranks
# dynamic sampling: G 2 leaves about half the groups all-equal, so steps draw further rounds and the last
# round is cut inside (a rank keeps part of its groups with signal, or none)
DYN = {**CFG, "G": 2, "sampling_rounds": 4}
# the KL penalty to the start policy (the reference model is a frozen whole copy on every rank); a large
# coefficient so that the KL term moves the update by more than the tolerance
KL = {**CFG, "kl_coef": 0.5}
# the policy is float64 (logits rounded to float32 in the loss): one and two processes differ by rounding
# (~1e-9 here); an update moves weights by ~lr = 1e-2, a wrong denominator changes it by a like amount
TOL = dict(rtol=1e-6, atol=1e-7)


def assert_same_training(got: dict, ref: dict, label, *, loose: dict | None = None) -> None:
    """A run's trained parameters (within TOL), evaluations (equal) and step records (within 1e-6 rel.)
    equal the reference run's (also used by test_weft_resume_distributed.py). ``loose``: record keys with
    their own absolute tolerance (``approx_kl`` is a mean of float32 differences of nearly equal
    log-probabilities: rank-local padding widths move it by ~1e-8 absolute)."""
    for n, p in ref["params"].items():
        torch.testing.assert_close(got["params"][n], p, **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert got["evals"] == ref["evals"]
    loose = loose or {}
    for a, b in zip(got["records"], ref["records"], strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=loose.get(k, 1e-9)), (label, k)


def _policy():
    from treadle.models.builders import build_tiny_model
    from treadle.weft.rl.vocab import build_tool_tokenizer

    tok = build_tool_tokenizer()
    model = build_tiny_model("qwen3", seed=0, vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id).double()
    return model, tok


class _MixedSampler(RowKeyedSampler):
    """Row-keyed: a row whose key is even writes the gold step (the turn passes), an odd one samples the
    untrained policy (noise, fails): groups carry reward signal, and each row's output depends only on
    the row, never on the batch or the rank."""

    def generate(self, rows, seed):
        from treadle.weft.rl.sampling import ReplaySampler
        from treadle.weft.rollouts.harnesses import HermesHarness

        keys = row_seeds(rows, seed)
        gold = ReplaySampler(self.tokenizer, HermesHarness()).generate(rows, seed)
        sampled_at = [i for i, k in enumerate(keys) if k % 2]
        sampled = super().generate([rows[i] for i in sampled_at], seed) if sampled_at else []
        out = list(gold)
        for i, s in zip(sampled_at, sampled):
            out[i] = s
        return out


def _mixed(model, tok, cfg):
    return _MixedSampler(model, tok, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)


def _summary(s, model):
    keep = ("turn_reward", "segments", "groups", "all_equal_groups", "env_failures", "rows_updated", "loss",
            "clipfrac", "approx_kl", "trajectory_reward", "flagged_rows", "groups_kept", "segments_generated",
            "segments_kept", "segments_dropped", "sampling_rounds_used", "kl_ref")
    return {"records": [{k: r[k] for k in keep if k in r} for r in s["records"]], "evals": s["evals"],
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _ranks_worker():
    torch.set_num_threads(1)
    out = {}
    model, tok = _policy()  # 1 episode per step for 2 ranks: rank 1 samples nothing and still trains
    s = anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(**FEW), progress=False,
                                          sampler_factory=_mixed))
    out["few"] = _summary(s, model)
    for g in GROUPINGS:
        for label, cfg in ((g, CFG), (f"{g}-dynamic", DYN)):
            model, tok = _policy()
            s = anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(grouping=g, **cfg),
                                                  progress=False, sampler_factory=_mixed))
            out[label] = _summary(s, model)
    model, tok = _policy()
    s = anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(**KL), progress=False,
                                          sampler_factory=_mixed))
    out["kl"] = _summary(s, model)
    return out


@pytest.fixture(scope="module")
def single():
    torch.set_num_threads(1)
    out = {}
    for g in GROUPINGS:
        for label, cfg in ((g, CFG), (f"{g}-dynamic", DYN)):
            model, tok = _policy()
            s = anyio.run(lambda: train_policy(model, tok, WeftTrainConfig.quick(grouping=g, **cfg), progress=False,
                                               sampler_factory=_mixed, shared_prefix=False))
            out[label] = _summary(s, model)
    model, tok = _policy()
    s = anyio.run(lambda: train_policy(model, tok, WeftTrainConfig.quick(**FEW), progress=False,
                                       sampler_factory=_mixed, shared_prefix=False))
    out["few"] = _summary(s, model)
    for label, cfg in (("kl", KL), ("kl-off", CFG)):
        model, tok = _policy()
        s = anyio.run(lambda: train_policy(model, tok, WeftTrainConfig.quick(**cfg), progress=False,
                                           sampler_factory=_mixed, shared_prefix=False))
        out[label] = _summary(s, model)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from treadle.testing_ranks import spawn_gloo

    return spawn_gloo(_ranks_worker, W, tmp_path_factory.mktemp("weft_ranks"))


def test_the_tolerance_can_fail(single):
    start, _ = _policy()
    for g in GROUPINGS:
        moved = max(float((single[g]["params"][n] - p.detach()).abs().max()) for n, p in start.named_parameters())
        assert moved > 1e-3, g  # the runs really update the policy (rows with non-zero advantage)
        assert all(r["rows_updated"] > 0 for r in single[g]["records"]), g
        assert all(0 < r["turn_reward"] < 1 for r in single[g]["records"]), g  # mixed groups: signal


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_two_ranks_match_one_process(grouping, single, ranks):
    one = single[grouping]
    for r in ranks:  # every rank ends with the one process's policy and reports the whole batch's numbers
        for n, p in one["params"].items():
            torch.testing.assert_close(r[grouping]["params"][n], p, **TOL, msg=lambda m, n=n: f"{n}: {m}")
        assert r[grouping]["evals"] == one["evals"]
        for a, b in zip(r[grouping]["records"], one["records"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (grouping, k)
    assert one["records"][0]["segments"] == (6 * 4 if grouping == "atomic" else 3 * 4 * 2)


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_dynamic_sampling_on_two_ranks_matches_one_process(grouping, single, ranks):
    """Dynamic sampling (``sampling_rounds`` > 1) under data parallelism: the ranks agree on every extra
    round and keep, between them, exactly the groups one process keeps (the first groups with signal in
    round-then-episode order), so the trained policy and the step records are the one process's."""
    one = single[f"{grouping}-dynamic"]
    assert any(r["sampling_rounds_used"] > 1 for r in one["records"]), "no step drew a second round"
    assert any(r["segments_dropped"] > 0 for r in one["records"])
    assert all(r["groups_kept"] == DYN["turns_per_step"] // (1 if grouping == "atomic" else 2)
               or r["sampling_rounds_used"] == DYN["sampling_rounds"] for r in one["records"])
    for r in ranks:
        assert_same_training(r[f"{grouping}-dynamic"], one, f"{grouping}-dynamic")


def test_row_keyed_sampler_does_not_depend_on_the_batch():
    model, tok = _policy()
    s = RowKeyedSampler(model, tok, temperature=1.0, max_new_tokens=12)
    a, b, c = tok("<tool_call>", add_special_tokens=False)["input_ids"], [5, 6, 7, 8, 9], [11, 12]
    rows = [(None, 0, a), (None, 0, b), (None, 0, b), (None, 0, c)]
    full = s.generate(rows, 3)
    assert s.generate(rows[1:3], 3) == full[1:3]  # same rows, smaller batch, other padding
    assert s.generate(rows[3:], 3) == full[3:]
    assert full[1] != full[2]  # equal contexts are distinct candidates (occurrence in the key)
    assert s.generate(rows, 4) != full  # the call seed matters


def test_bad_settings_raise_before_any_rollout():
    from treadle.distributed.process_group import NotDistributedError

    model, tok = _policy()
    with pytest.raises(NotDistributedError):
        anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(turns_per_step=4), progress=False))
    with pytest.raises(ValueError, match="parallel"):
        anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(), parallel="zero3", progress=False))


def test_fewer_episodes_than_ranks_trains_like_one_process(single, ranks):
    """1 episode per step on 2 ranks (rank 1 has none: no rollout, no group, a zero-weight update row): the
    one-process run, so a config (e.g. --quick's) need not depend on the world size."""
    assert any(r["rows_updated"] > 0 for r in single["few"]["records"])
    for r in ranks:
        assert_same_training(r["few"], single["few"], "few")


def test_kl_penalty_on_two_ranks_matches_one_process(single, ranks):
    """``kl_coef > 0`` under DDP: each rank keeps a frozen whole copy of the start policy, every row with
    policy tokens (zero-advantage rows too) enters the update with the global denominators, and the trained
    policy, records (``kl_ref`` included) and evaluations are the one process's."""
    one, off = single["kl"], single["kl-off"]
    assert any(r["kl_ref"] > 0 for r in one["records"]) and all(r["kl_ref"] == 0 for r in off["records"])
    moved = max(float((one["params"][n] - p).abs().max()) for n, p in off["params"].items())
    assert moved > 1e-4  # the penalty changes the trained policy by far more than TOL
    for r in ranks:
        assert_same_training(r["kl"], one, "kl", loose={"approx_kl": 1e-7})


def _fsdp2_worker():
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    out = {}
    for g in GROUPINGS:
        model, tok = _policy()
        s = anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(grouping=g, **CFG), parallel="fsdp2",
                                              progress=False, sampler_factory=_mixed))
        params = dict(model.named_parameters())
        out[g] = _summary(s, model)
        out[g]["sharded"] = all(isinstance(p, DTensor) for p in params.values())
        out[g]["params"] = {n: p.full_tensor().detach().clone() for n, p in params.items()}
        out[g]["local_rows"] = {n: p.to_local().shape[0] for n, p in params.items() if p.dim() == 2}
    model, tok = _policy()
    s = anyio.run(lambda: train_policy_dp(model, tok, WeftTrainConfig.quick(**KL), parallel="fsdp2",
                                          progress=False, sampler_factory=_mixed))
    out["kl"] = _summary(s, model)
    out["kl"]["params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory):
    from treadle.testing_ranks import spawn_gloo

    return spawn_gloo(_fsdp2_worker, W, tmp_path_factory.mktemp("weft_fsdp2"))


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_fsdp2_two_ranks_match_one_process(grouping, single, fsdp2_ranks):
    """FSDP2: the policy stays sharded (DTensors, about half the rows of each matrix per rank) between steps,
    each rank generates its own rollouts with the gathered weights (different forward counts per rank), and
    the trained policy, records and evaluations equal one process's."""
    one = single[grouping]
    for r in fsdp2_ranks:
        got = r[grouping]
        assert got["sharded"]
        full = {n: p.shape[0] for n, p in one["params"].items() if p.dim() == 2}
        assert all(got["local_rows"][n] <= (rows + 1) // 2 for n, rows in full.items())
        assert_same_training(got, one, grouping)


def test_fsdp2_kl_penalty_matches_one_process(single, fsdp2_ranks):
    """FSDP2 with ``kl_coef > 0``: the reference is copied before sharding (a whole frozen replica per rank,
    no collective in its forwards); the result is the one process's."""
    for r in fsdp2_ranks:
        assert_same_training(r["kl"], single["kl"], "kl", loose={"approx_kl": 1e-7})
