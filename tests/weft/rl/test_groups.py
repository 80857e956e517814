"""Atomic-turn groups: shared history and state, verdicts, flags, advantages, env failures, bad input."""
import json

import pytest
import torch

from treadle.weft.rl.gold import REPLY
from treadle.weft.rl.groups import group_advantages, group_stats, rows_of, token_advantages
from treadle.weft.rl.sampling import (GroupSizeError, HFSampler, NoAtomicTurnsError, ReplaySampler, prefix_ids,
                                      sample_groups)
from treadle.weft.rollouts.tokens import tokenize_conversation


def _starts(golds):
    return [s for g in golds for s in g.starts]


def test_replay_policy_gives_all_ones_groups_with_zero_advantage(in_shop, tok, harness):
    async def fn(rt, h, golds):
        return await sample_groups(rt, h, _starts(golds), 3, ReplaySampler(tok, harness), tok, harness, seed=0)

    groups = in_shop(fn)
    assert len(groups) == 6 and {g.template for g in groups} == {"order-ship", "lookup-cancel", "ticket"}
    assert all(c.r == 1 and not c.flags and c.env_failure is None for g in groups for c in g.candidates)
    adv = group_advantages(groups)
    assert torch.equal(adv, torch.zeros(18))
    st = group_stats(groups)
    assert (st.all_equal_groups, st.all_pass_groups, st.singleton_groups, st.mean_reward) == (6, 6, 0, 1.0)


def test_group_rows_share_prefix_ids_and_state(in_shop, tok, harness, tiny_policy):
    sampler = HFSampler(tiny_policy, tok, temperature=1.0, max_new_tokens=12)

    async def fn(rt, h, golds):
        groups = await sample_groups(rt, h, _starts(golds), 4, sampler, tok, harness, seed=1, max_steps=2)
        return golds, groups

    golds, groups = in_shop(fn, n=2)
    starts = _starts(golds)
    for g, ts in zip(groups, starts):
        assert {c.state_hash for c in g.candidates} == {ts.snapshot.digest} == {g.state_hash}
        assert list(g.prefix_ids) == prefix_ids(tok, ts.messages)
        # the prefix is exactly the SFT tokenisation of the gold conversation up to this turn
        sft = tokenize_conversation(golds[starts.index(ts) // 2].messages, None, tok)[0]
        assert list(sft.input_ids[:len(g.prefix_ids)]) == list(g.prefix_ids)
        for c in g.candidates:
            assert len(c.response_ids) == len(c.policy_mask) and sum(c.policy_mask) > 0
    keys = [g.key for g in groups]
    assert len(set(keys)) == len(keys)


def test_advantages_are_zero_on_prefix_and_tool_tokens(in_shop, tok, harness):
    plans = {}

    class Mixed(ReplaySampler):
        """Row 0 of each group replies at once (fails), the others replay the gold."""
        def generate(self, rows, seed):
            out = super().generate(rows, seed)
            for i, (ts, step, ctx) in enumerate(rows):
                plans.setdefault(id(ctx), len(plans))
                if plans[id(ctx)] % 3 == 0:
                    out[i] = tok(REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return out

    async def fn(rt, h, golds):
        return await sample_groups(rt, h, _starts(golds)[:2], 3, Mixed(tok, harness), tok, harness, seed=0)

    groups = in_shop(fn, n=1)
    assert [g.rewards for g in groups] == [[0, 1, 1], [0, 1, 1]]
    rows = rows_of(groups)
    assert [r.advantage > 0 for r in rows] == [False, True, True] * 2
    for r in rows:
        ta = token_advantages(r)
        n_p = len(r.prompt_ids)
        assert torch.equal(ta[:n_p], torch.zeros(n_p))
        mask = torch.tensor(r.response_mask, dtype=torch.bool)
        assert torch.equal(ta[n_p:][~mask], torch.zeros(int((~mask).sum())))
        assert torch.allclose(ta[n_p:][mask], torch.full((int(mask.sum()),), r.advantage))
        if r.reward == 1:  # tool outputs exist in successful segments: they are masked
            assert (~mask).sum() > 0


def test_flagged_rows_never_get_positive_advantage(in_shop, tok, harness):
    seen = {}

    class Repeating(ReplaySampler):
        """lookup turns: candidate 1 repeats its first call (still passes), candidate 2 replies at once."""
        def generate(self, rows, seed):
            out = []
            for ts, step, ctx in rows:
                k = seen.setdefault(id(ctx), len(seen) % 3)
                gold = ts.atomic.checkpoint.gold_calls
                if k == 1:
                    plan = [gold[0], gold[0], *gold[1:]]
                    text = harness.render([plan[step]]).text if step < len(plan) else REPLY
                elif k == 2:
                    text = REPLY
                else:
                    text = harness.render([gold[step]]).text if step < len(gold) else REPLY
                out.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            return out

    async def fn(rt, h, golds):
        lookups = [s for s in _starts(golds) if s.atomic.name == "lookup"]
        return await sample_groups(rt, h, lookups, 3, Repeating(tok, harness), tok, harness, seed=0, max_steps=5)

    groups = in_shop(fn, n=2)  # episode 1 is lookup-cancel
    assert len(groups) == 1
    g = groups[0]
    assert g.rewards == [1, 1, 0]
    assert [c.flags for c in g.candidates] == [(), ("repetition",), ()]
    adv = group_advantages(groups)
    assert adv[0] > 0 and adv[1] == 0.0 and adv[2] < 0  # the flagged success is clamped to min(A, 0) = 0
    assert group_stats(groups).flagged_successful_rows == 1


def test_malformed_and_interface_violations_are_flagged(in_shop, tok, harness):
    class Bad(ReplaySampler):
        def generate(self, rows, seed):
            out = []
            for i, (ts, step, ctx) in enumerate(rows):
                if step == 0:
                    text = ('<tool_call>\n{"name": "find_customer", "arguments": {' if i % 2 == 0 else
                            '<tool_call>\n{"name": "find_customer", "arguments": {"mail": "x"}}\n</tool_call>')
                else:
                    text = REPLY
                out.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            return out

    async def fn(rt, h, golds):
        return await sample_groups(rt, h, _starts(golds)[:1], 2, Bad(tok, harness), tok, harness, seed=0)

    (g,) = in_shop(fn, n=1)
    assert [c.flags for c in g.candidates] == [("malformed_call",), ("interface_violation",)]
    assert g.rewards == [0, 0]


def test_crashing_environment_is_an_env_failure_not_a_policy_zero(in_shop, tok, harness):
    async def fn(rt, h, golds):
        real = rt.call_tool
        calls = {"n": 0}

        async def flaky(sid, name, arguments=None):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ConnectionError("server died")
            return await real(sid, name, arguments)

        rt.call_tool = flaky
        return await sample_groups(rt, h, _starts(golds)[:1], 3, ReplaySampler(tok, harness), tok, harness, seed=0)

    (g,) = in_shop(fn, n=1)
    failed = [c for c in g.candidates if c.env_failure]
    assert len(failed) == 1 and "server died" in failed[0].env_failure and failed[0].r == 0
    st = group_stats([g])
    assert (st.env_failures, st.valid_rows, st.mean_reward) == (1, 2, 1.0)
    rows = rows_of([g])
    assert [r.valid for r in rows].count(False) == 1
    assert all(r.advantage == 0.0 for r in rows)  # the two valid rows pass: all-equal, the crash is left out


def test_bad_group_size_and_task_without_turns(in_shop, tok, harness):
    async def fn(rt, h, golds):
        for G in (1, 0, 2.5, True):
            with pytest.raises(GroupSizeError, match="G"):
                await sample_groups(rt, h, _starts(golds), G, ReplaySampler(tok, harness), tok, harness, seed=0)
        assert rt.sessions() == []  # nothing created
        return True

    assert in_shop(fn, n=1)
    from treadle.weft.rl.gold import play_gold
    from treadle.weft.rl.worlds import draw_episode

    ep = draw_episode(0, "train")
    empty = type(ep)(task=ep.task.model_copy(update={"atomic": ()}), seed_sql=ep.seed_sql, split="train",
                     template=ep.template, seed=0)

    async def fn2(rt, h, golds):
        with pytest.raises(NoAtomicTurnsError, match="no atomic turns"):
            await play_gold(rt, h, empty, harness)
        return rt.sessions()

    assert in_shop(fn2, n=0) == []


def test_rows_are_json_round_trippable(in_shop, tok, harness):
    async def fn(rt, h, golds):
        return await sample_groups(rt, h, _starts(golds)[:2], 2, ReplaySampler(tok, harness), tok, harness, seed=0)

    rows = rows_of(in_shop(fn, n=1))
    for r in rows:
        assert type(r).model_validate_json(r.model_dump_json()) == r
        assert json.loads(r.model_dump_json())["schema_version"] == 1
