"""Held-out evaluation of a WEFT tool policy: sampled per-turn and whole-task success (WEFT 4.1).

Per-turn success samples ``cfg.eval_samples`` candidates of every held-out turn from its gold history and
state; whole-task success samples trajectories (turn 2 continues from the policy's own turn 1, its messages
and state) and counts those whose every turn passes. Both use treadle's sampler and the runtime directly:
evaluation is no training loop. ``bench/weft_rl_heldout.py`` runs it on a finished ``treadle weft train``.
"""
from __future__ import annotations

__all__ = ["evaluate_heldout", "task_success"]


def _next_start(ts, end, episode_turns):
    """The turn start that continues a candidate's own history and state (trajectory rollouts)."""
    from treadle.weft.rl.gold import TurnStart

    msgs, snap = end
    nxt = episode_turns[ts.turn + 1]
    return TurnStart(ts.episode, ts.turn + 1, nxt, tuple(msgs) + ({"role": "user", "content": nxt.request},), snap)


async def _trajectories(rt, h, golds, G, sampler, tok, harness, *, seed, max_steps):
    """G whole-episode rollouts per gold episode (from its first turn's start). Returns
    ``[(episode key, [[segment Candidate + TurnGroup] per turn] per trajectory)]``."""
    from treadle.weft.rl.sampling import sample_segments

    if not golds:
        return []
    firsts = [g.starts[0] for g in golds]
    groups, ends = await sample_segments(rt, h, firsts, G, sampler, tok, harness, seed=seed, max_steps=max_steps,
                                         replay_check=False, keep_ends=True)
    trajs = [[[(grp, c)] for c in grp.candidates] for grp in groups]
    for turn in range(1, max(len(g.starts) for g in golds)):
        conts, where = [], []
        for e, g in enumerate(golds):
            if turn >= len(g.starts):
                continue
            order = g.episode.task.ordered()
            for k in range(G):
                last_grp, last_c = trajs[e][k][-1]
                end = ends[e][k] if turn == 1 else ends_next.get((e, k))
                if end is None or (last_c.env_failure is not None and not _diverged(trajs[e][k])):
                    continue
                ts_prev = firsts[e] if turn == 1 else prev_start[(e, k)]
                conts.append(_next_start(ts_prev, end, order))
                where.append((e, k))
        if not conts:
            break
        grps, nends = await sample_segments(rt, h, conts, 1, sampler, tok, harness, seed=seed + 7 * turn,
                                            max_steps=max_steps, replay_check=False, keep_ends=True)
        ends_next, prev_start = {}, {}
        for (e, k), grp, en, ts in zip(where, grps, nends, conts):
            trajs[e][k].append((grp, grp.candidates[0]))
            ends_next[(e, k)] = en[0]
            prev_start[(e, k)] = ts
    return [(g.episode.key, len(g.starts), trajs[e]) for e, g in enumerate(golds)]


def _diverged(traj) -> bool:
    """True when the last segment's checkpoint could not be judged only because an earlier turn of the
    trajectory failed: its gold calls assume the earlier turn's gold state (e.g. ship an order the policy
    never placed), so the gold replay fails on the policy's state. That is the policy's failure (r = 0),
    not the environment's."""
    *before, (_, last) = traj
    return (last.env_failure is not None and last.env_failure.startswith("checkpoint:")
            and any(c.r == 0 for _, c in before))


async def task_success(rt, h, golds, model, tok, *, samples: int, seed: int, max_new_tokens: int,
                       max_steps: int) -> float:
    """Sampled (T = 1) whole-task success: the fraction of ``samples`` trajectories per episode whose
    every turn passes (turn 2 continues from the policy's own turn 1)."""
    from treadle.weft.rl.sampling import HFSampler
    from treadle.weft.rollouts.harnesses import HermesHarness

    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=max_new_tokens)
    ok = n = 0
    for i in range(0, len(golds), 8):
        for _, n_turns, trajs in await _trajectories(rt, h, golds[i:i + 8], samples, sampler, tok, HermesHarness(),
                                                     seed=seed + i, max_steps=max_steps):
            for tr in trajs:
                n += 1
                ok += len(tr) == n_turns and all(c.r == 1 for _, c in tr)
    return ok / max(n, 1)


async def evaluate_heldout(rt, h, model, tok, held, cfg) -> dict:
    """Held-out success of ``model`` on the gold episodes ``held`` under ``cfg``'s sampling settings
    (:class:`~treadle.weft.rl.config.WeftTrainConfig`; seeds from ``cfg.seed``): ``turn_success`` (sampled
    per-turn success from the gold history and state, environment failures left out) and ``task_success``
    (:func:`task_success`)."""
    from treadle.weft.rl.sampling import HFSampler, sample_groups
    from treadle.weft.rollouts.harnesses import HermesHarness

    starts = [s for g in held for s in g.starts]
    sampler = HFSampler(model, tok, temperature=1.0, max_new_tokens=cfg.max_new_tokens)
    rs = []
    for i in range(0, len(starts), 16):
        for grp in await sample_groups(rt, h, starts[i:i + 16], cfg.eval_samples, sampler, tok, HermesHarness(),
                                       seed=cfg.seed * 31 + 100_000 + i, max_steps=cfg.max_steps, replay_check=False):
            rs += [c.r for c in grp.candidates if c.env_failure is None]
    task = await task_success(rt, h, held, model, tok, samples=cfg.eval_samples, seed=cfg.seed * 31 + 200_000,
                              max_new_tokens=cfg.max_new_tokens, max_steps=cfg.max_steps)
    return {"turn_success": sum(rs) / max(len(rs), 1), "task_success": task}
