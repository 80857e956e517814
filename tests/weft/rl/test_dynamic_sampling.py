"""Dynamic sampling (``WeftTrainConfig.sampling_rounds``): only groups with signal are kept, further rounds
are drawn while the batch is short, the budget is accounted, and a seed gives the same groups again."""
import anyio
import pytest
import torch

from treadle.weft.rl.gold import REPLY, shop_server
from treadle.weft.rl.groups import has_signal
from treadle.weft.rl.train import WeftTrainConfig, _atomic_batch, _trajectory_batch, train_policy
from treadle.weft.rollouts.harnesses import HermesHarness
from treadle.weft.runtime import Runtime


class CoinSampler:
    """Per row, a seeded coin: the gold step (the turn passes when every step is gold) or the closing reply
    at once (no call: the turn fails). Groups then mix passes and fails, and some are all-equal."""

    def __init__(self, tok, harness, p_fail=0.5):
        self.tok, self.harness, self.p_fail, self.eos_id = tok, harness, p_fail, tok.eos_token_id

    def generate(self, rows, seed):
        coins = torch.rand(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        out = []
        for (ts, step, _), u in zip(rows, coins):
            gold = ts.atomic.checkpoint.gold_calls or []
            fail = step == 0 and u < self.p_fail
            text = REPLY if fail or step >= len(gold) else self.harness.render([gold[step]]).text
            out.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos_id])
        return out


def _batch(fn, cfg, step, tok, p_fail=0.5):
    async def main():
        async with Runtime() as rt:
            h = await shop_server(rt)
            harness = HermesHarness()
            return await fn(rt, h, cfg, step, CoinSampler(tok, harness, p_fail), tok, harness, None)
    return anyio.run(main)


def _valid_rs(g):
    return [c.r for c in g.candidates if c.env_failure is None]


def test_rounds_play_gold_turns_that_pass(tok):
    """The coin sampler's gold branch passes and its reply branch fails (else the tests below prove nothing)."""
    cfg = WeftTrainConfig.quick(G=2, turns_per_step=2, sampling_rounds=1)
    ones, _, _ = _batch(_atomic_batch, cfg, 0, tok, p_fail=0.0)
    zeros, _, _ = _batch(_atomic_batch, cfg, 0, tok, p_fail=1.0)
    assert [_valid_rs(g) for g in ones] == [[1, 1], [1, 1]]
    assert [_valid_rs(g) for g in zeros] == [[0, 0], [0, 0]]


def test_dynamic_sampling_keeps_only_groups_with_signal_and_draws_more_rounds(tok):
    cfg = WeftTrainConfig.quick(G=2, turns_per_step=4, sampling_rounds=4)
    kept, generated, rounds = _batch(_atomic_batch, cfg, 0, tok)
    assert all(has_signal(_valid_rs(g)) for g in kept)
    equal = [g for g in generated if not has_signal(_valid_rs(g))]
    assert equal, "this seed must draw some all-equal groups (else nothing is filtered)"
    assert rounds > 1 and len(generated) == rounds * cfg.turns_per_step  # more rounds were drawn
    assert len(kept) == cfg.turns_per_step or rounds == cfg.sampling_rounds
    assert {g.key for g in kept} <= {g.key for g in generated}
    assert len({g.key for g in generated}) == len(generated)  # each round draws fresh episodes
    # without dynamic sampling: one round, every group kept, all-equal ones too
    plain, plain_gen, one = _batch(_atomic_batch, cfg.__class__(**(cfg.as_dict() | {"sampling_rounds": 1})), 0, tok)
    assert one == 1 and [g.key for g in plain] == [g.key for g in plain_gen] == [g.key for g in generated[:4]]
    assert any(not has_signal(_valid_rs(g)) for g in plain)


def test_dynamic_sampling_stops_at_the_cap_when_no_group_has_signal(tok):
    cfg = WeftTrainConfig.quick(G=2, turns_per_step=2, sampling_rounds=3)
    kept, generated, rounds = _batch(_atomic_batch, cfg, 0, tok, p_fail=1.0)
    assert kept == [] and rounds == 3 and len(generated) == 3 * cfg.turns_per_step


def test_same_seed_and_step_give_the_same_groups(tok):
    """A resumed step (same config, same step) draws the same episodes and samples: the same groups."""
    cfg = WeftTrainConfig.quick(G=2, turns_per_step=4, sampling_rounds=3)
    a, ga, ra = _batch(_atomic_batch, cfg, 1, tok)
    b, gb, rb = _batch(_atomic_batch, cfg, 1, tok)
    assert ra == rb and [g.key for g in ga] == [g.key for g in gb]
    assert [[c.response_ids for c in g.candidates] for g in a] == [[c.response_ids for c in g.candidates] for g in b]
    _, other, _ = _batch(_atomic_batch, cfg, 2, tok)
    assert not {g.key for g in other} & {g.key for g in ga}  # another step: other episodes


def test_trajectory_grouping_filters_episode_groups_under_the_same_cap(tok):
    cfg = WeftTrainConfig.quick(grouping="trajectory", G=2, turns_per_step=4, sampling_rounds=4)
    kept, generated, rounds = _batch(_trajectory_batch, cfg, 0, tok)
    n_eps = cfg.turns_per_step // 2
    assert len(generated) == rounds * n_eps and len(kept) <= n_eps
    assert all(has_signal([x for x, ok in zip(e.rewards, e.valid) if ok]) for e in kept)
    assert any(len(set(e.rewards)) == 1 for e in generated)
    assert len(kept) == n_eps or rounds == cfg.sampling_rounds


def test_step_record_accounts_for_every_generated_segment(tok, tiny_policy, monkeypatch):
    import copy

    import treadle.weft.rl.train as train

    cfg = WeftTrainConfig.quick(G=2, turns_per_step=4, sampling_rounds=4, steps=1, eval_episodes=1)
    s = anyio.run(lambda: train_policy(copy.deepcopy(tiny_policy), tok, cfg, progress=False,
                                       sampler_factory=lambda m, t, c: CoinSampler(t, HermesHarness())))
    (rec,) = s["records"]
    kept, generated, rounds = _batch(train._atomic_batch, cfg, 0, tok)
    assert rec["sampling_rounds_used"] == rounds and rec["groups"] == len(generated)
    assert rec["groups_kept"] == len(kept) and rec["segments"] == rec["segments_kept"] == cfg.G * len(kept)
    assert rec["segments_generated"] == cfg.G * len(generated)
    assert rec["segments_dropped"] == rec["segments_generated"] - rec["segments_kept"] > 0
    assert rec["all_equal_groups"] == sum(not has_signal(_valid_rs(g)) for g in generated)
    # every failed row of a kept group has a negative advantage (passing rows may be flagged: min(A, 0) = 0)
    assert rec["segments_kept"] >= rec["rows_updated"] >= sum(c.r == 0 for g in kept for c in g.candidates) > 0


@pytest.mark.parametrize("bad", [0, 17, 2.0])
def test_bad_sampling_rounds_is_refused(bad):
    with pytest.raises(ValueError, match="sampling_rounds"):
        WeftTrainConfig(sampling_rounds=bad)


def test_comparison_summary_reports_the_sampling_budget(tmp_path, tiny_policy, tok):
    """summary.json per grouping: segments generated = kept + dropped, summed from the step logs."""
    import json

    from rich.console import Console

    from treadle.weft.rl.report import run_comparison

    quiet = Console(file=open(tmp_path / "log.txt", "w"))
    s = run_comparison(tmp_path / "c", (tiny_policy, tok), ("atomic", "trajectory"), [0], steps=1, quick=True,
                       console=quiet, overrides={"eval_episodes": 1, "sampling_rounds": 2})
    for g in ("atomic", "trajectory"):
        recs = [json.loads(x) for x in (tmp_path / "c" / f"{g}-seed0" / "steps.jsonl").read_text().splitlines()]
        got = s["groupings"][g]
        assert got["segments_generated"] == sum(r["segments_generated"] for r in recs) > 0
        assert got["segments_kept"] == sum(r["segments"] for r in recs)
        assert got["segments_generated"] == got["segments_kept"] + got["segments_dropped"]
        assert got["all_equal_groups"] == sum(r["all_equal_groups"] for r in recs)
