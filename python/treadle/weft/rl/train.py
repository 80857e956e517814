"""``treadle weft train``: GRPO on the tiny tool policy over the shop, atomic-turn vs trajectory groups.

Seed: WEFT 4.1 (component three): atomic-turn GRPO compares G candidates of one turn sampled from the
same history and the same forked state, with the atomic task's binary verdict and deterministic
flags; the ablation baseline groups whole episodes by their outcome (``R = mean_k r_k``).

Per step, with the same rollout budget for both groupings (``turns_per_step * G`` turn segments):

- ``atomic``: ``turns_per_step / 2`` fresh train episodes are played with their gold calls; each of
  their turns is one group of G candidates (:func:`~treadle.weft.rl.sampling.sample_groups`);
  advantages from :func:`~treadle.weft.rl.groups.group_advantages` (flagged rows ``min(A, 0)``,
  environment failures left out).
- ``trajectory``: G whole episodes per drawn episode (turn 2 continues from each candidate's own
  history and state); one group per episode; reward ``R``; every turn's policy tokens get the
  trajectory's advantage (no flags: the baseline as published).
- dynamic sampling (``sampling_rounds``, default 3; DAPO's "dynamic sampling", verl's ``filter_groups``):
  groups whose valid rewards are all equal carry no signal; they are dropped and further rounds of fresh
  episodes are drawn until the batch is full of groups with signal or ``sampling_rounds`` rounds were
  drawn (the same cap for both groupings). Each step logs ``segments_generated`` / ``_kept`` /
  ``_dropped``, ``groups`` (generated), ``groups_kept``, ``all_equal_groups`` (over every generated group).
  Under data parallelism (:mod:`treadle.weft.rl.parallel`) the ranks count their groups with signal after
  each round (one all-reduce) and keep, between them, the groups one process would keep, so they stop
  after the same round. It draws ~2.4x the segments it keeps (~150 per step for 64 kept).

Shared prefixes (same samples, same maths, fewer tokens computed): the sampler prefills each distinct
context once and gathers its K/V to the rows that share it (a group's G candidates:
:meth:`~treadle.weft.rl.sampling.HFSampler._shared_prefill`), and the update runs each distinct prefix's
forward once with the responses after its repeated K/V (:func:`_row_logprobs`): about half the
computation of a step on the tool policy (``bench/bench_weft_rl.py``).

Update: the clipped policy loss (:func:`treadle.grpo.losses.policy_loss`) with ``seq-mean-token-mean``
aggregation (each candidate weighs the same, whatever its length), ``num_iterations`` optimizer steps
per batch, advantages on the current turn's policy tokens only. Not ``token-mean`` (every policy token
weighing the same): a failed candidate carries several malformed steps (about twice the policy tokens of
a passing one), so most of the gradient weight would come from negative advantages and the update would
mostly push tokens down; with ``seq-mean-token-mean`` each candidate weighs the same and a group's
advantages sum to 0 (``neg_share`` in the step log: the negative share of the first iteration's weight).
The step size matters as much: lr 5e-5 x 4 iterations moves the policy by ``approx_kl`` ~0.01-0.05 per
token, where lr 2e-4 x 2 moved it by ~0.05-0.3 and lr 5e-4 collapsed it within 2 steps. Optional:
``kl_coef`` (k3 KL to the frozen start policy; off by default; one process and ``--parallel ddp|fsdp2``
alike, the latter with a whole frozen copy per rank). Measured results: ``bench/results/`` (WEFT RL).
Held-out evaluation (unseen customers, products, amounts): sampled per-turn success from the gold
history (:func:`~treadle.weft.rl.sft.evaluate_policy`) and sampled whole-task success (trajectory
rollouts: every turn must pass), before, every ``eval_every`` steps, and after.
Timing per step: environment (forks, tool calls, verification), model (generation), advantage op,
update.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Literal

import torch
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

__all__ = ["WeftTrainConfig", "GROUPINGS", "train_policy", "task_success"]

GROUPINGS = ("atomic", "trajectory")


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class WeftTrainConfig:
    """GRPO settings (bad values raise ``pydantic.ValidationError``, a ValueError, naming the field).

    Attributes:
        grouping: ``atomic`` (atomic-turn groups) or ``trajectory`` (whole-episode outcome groups).
        seed: seeds episode draws and sampling. steps: GRPO steps.
        turns_per_step: turn groups per step (atomic; even: two turns per episode); G: samples per group
            (8: at ~30% per-turn success a group of 4 is all-fail ~24% of the time and carries no signal;
            of 8, ~6%).
        lr, num_iterations, clip_low, clip_high, loss_agg_mode: optimizer and loss (lr 1e-3 collapsed the
            policy in one update: Adam's first steps move every weight by ~lr; lr 5e-4 x 2 iterations
            lowered held-out success within 2 steps, lr 5e-5 x 4 iterations, the default, raises it).
            ``loss_agg_mode``: one of
            ``seq-mean-token-mean`` (default), ``token-mean``, ``seq-mean-token-sum`` (see the module
            docstring for why not ``token-mean``); the denominators count every row of the batch.
        eval_episodes, eval_samples, eval_every: held-out evaluation (0: before and after only).
        max_new_tokens, max_steps, temperature: sampling (a gold step is at most 33 tokens with EOS: 40
            leaves room and stops a runaway sample, which holds up its whole generation batch, early).
        kl_coef: beta of the KL penalty to the start (SFT) policy, ``beta * KL_k3(pi || pi_ref)`` per policy
            token (GRPO, Shao et al. 2024 eq. 3-4: the unbiased, non-negative k3 estimator
            ``exp(ref - logp) - (ref - logp) - 1``), aggregated like the policy loss over every row with
            policy tokens (zero-advantage rows too); 0 (no reference model kept) turns it off. CLI:
            ``treadle weft train --kl-coef``.
        sampling_rounds: dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2; verl's ``filter_groups``): with
            ``> 1``, groups with no signal (valid rewards all equal, or fewer than two) are dropped and up to
            ``sampling_rounds - 1`` further rounds of ``turns_per_step / 2`` fresh episodes are drawn per step
            until the batch holds ``turns_per_step`` groups with signal (atomic) or ``turns_per_step / 2``
            episode groups with signal (trajectory); both groupings get the same cap on generated segments
            (``sampling_rounds`` x the base budget). The step log reports segments generated, kept and
            dropped, and all-equal groups over every generated group. 1: every group of one round is kept
            (all-equal ones too: they add no gradient but count in the loss denominators). Data-parallel
            runs draw the same rounds and keep the same groups (the ranks agree after each round).
    """

    grouping: Literal["atomic", "trajectory"] = "atomic"
    seed: int = Field(0, ge=0, strict=True)
    steps: int = Field(16, ge=1, strict=True)
    turns_per_step: int = Field(8, ge=2, strict=True, multiple_of=2)
    G: int = Field(8, ge=2, strict=True)
    lr: float = Field(5e-5, gt=0, allow_inf_nan=False)
    num_iterations: int = Field(4, ge=1, strict=True)
    clip_low: float = Field(0.2, ge=0, lt=1)
    clip_high: float = Field(0.28, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "seq-mean-token-mean"
    eval_episodes: int = Field(24, ge=1, strict=True)
    eval_samples: int = Field(6, ge=2, strict=True)
    eval_every: int = Field(0, ge=0, strict=True)
    max_new_tokens: int = Field(40, ge=1, strict=True)
    max_steps: int = Field(4, ge=1, strict=True)
    temperature: float = Field(1.0, gt=0)
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    sampling_rounds: int = Field(3, ge=1, le=16, strict=True)

    @classmethod
    def quick(cls, **overrides) -> "WeftTrainConfig":
        kw = dict(steps=2, turns_per_step=2, G=2, eval_episodes=2, eval_samples=2, eval_every=0, max_new_tokens=24,
                  max_steps=2, sampling_rounds=1)
        kw.update(overrides)
        return cls(**kw)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


class _Timed:
    """A sampler wrapper that adds the seconds spent generating to ``seconds``."""

    def __init__(self, inner):
        self.inner, self.eos_id, self.seconds, self.rows = inner, inner.eos_id, 0.0, 0

    def generate(self, rows, seed):
        t = time.perf_counter()
        try:
            return self.inner.generate(rows, seed)
        finally:
            self.seconds += time.perf_counter() - t
            self.rows += len(rows)


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

    if not golds:  # a data-parallel rank without an episode this step
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


def _traj_reward(traj, n_turns: int) -> tuple[float, bool]:
    """(R = mean_k r_k over the episode's turns, valid = no environment failure)."""
    valid = all(c.env_failure is None or _diverged(traj[:i + 1]) for i, (_, c) in enumerate(traj))
    return sum(c.r for _, c in traj) / n_turns, valid


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


def _rows_batch(rows, pad_id: int):
    """Right-padded ``ids (B, T)``, ``mask (B, T-1)`` over next-token positions (policy tokens), ``adv (B,)``."""
    width = max(len(r[0]) + len(r[1]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width - 1), dtype=torch.float32)
    for i, (p, resp, m, _) in enumerate(rows):
        ids[i, :len(p) + len(resp)] = torch.tensor(list(p) + list(resp))
        mask[i, len(p) - 1:len(p) - 1 + len(resp)] = torch.tensor(m, dtype=torch.float32)
    adv = torch.tensor([r[3] for r in rows], dtype=torch.float32)
    return ids, mask, adv


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _row_logprobs(model, rows, width: int) -> torch.Tensor:
    """:func:`_logprobs` of :func:`_rows_batch`'s ``ids`` on the policy positions, ``(B, width - 1)`` float32
    (0 before a row's response and after its end), computed with every distinct prefix run once.

    The G candidates of an atomic-turn group share their history (a few hundred tokens) and differ only in
    their turn (tens): the prefix's forward runs once and its K/V, with their autograd graph, are repeated
    over the responses that follow it (``Cache.batch_repeat_interleave``), so the backward reaches the
    prefix's weights through every candidate, as in the full forward (same maths; the tokens computed fall
    from ``sum(len(prefix) + len(response))`` to ``sum over prefixes of len(prefix) + sum len(response)``).
    Right padding needs no attention mask: a real token never attends to the padding after it."""
    from treadle.weft.rl.sampling import kv_cache_arg, kv_cache_of

    dev = next(model.parameters()).device
    cache_kw = kv_cache_arg(model)
    by_prefix: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        by_prefix.setdefault(tuple(r[0]), []).append(i)
    out: list = [None] * len(rows)
    for prefix, idx in by_prefix.items():
        resp = [list(rows[i][1]) for i in idx]
        n_p = len(prefix)
        pre = model(input_ids=torch.tensor([prefix], device=dev), use_cache=True)
        first = torch.log_softmax(pre.logits[0, -1].float(), -1)  # predicts each response's first token
        cache = kv_cache_of(pre)
        if len(idx) > 1:
            cache.batch_repeat_interleave(len(idx))
        longest = max(len(x) for x in resp)
        rest = None
        if longest > 1:  # the responses' own next-token predictions, after the shared K/V
            ids = torch.zeros((len(idx), longest), dtype=torch.long, device=dev)
            for j, x in enumerate(resp):
                ids[j, :len(x)] = torch.tensor(x, device=dev)
            logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[:, :-1].float()
            rest = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        for j, (i, x) in enumerate(zip(idx, resp)):
            parts = [first.new_zeros(n_p - 1)]
            if x:
                parts.append(first[x[0]].view(1))
            if len(x) > 1:
                parts.append(rest[j, :len(x) - 1])
            parts.append(first.new_zeros(width - 1 - (n_p - 1) - len(x)))
            out[i] = torch.cat(parts)
    return torch.stack(out)


def signed_weight(rows, mode: str) -> dict:
    """How much of the first-iteration gradient weight comes from positive vs negative advantages: the sum
    of ``|A|`` times each row's weight in the aggregation (its policy-token count under ``token-mean``, 1
    under ``seq-mean-*``), split by sign, and the negative share. Under ``token-mean`` a failed candidate
    (several malformed steps, ~4x the policy tokens of a passing one) outweighs the passing one of its
    group, so the update mostly pushes tokens down (measured: see :class:`WeftTrainConfig`)."""
    pos = neg = 0.0
    for r in rows:
        n = float(sum(r[2]))
        w = n if mode == "token-mean" else float(n > 0)
        pos += w * max(r[3], 0.0)
        neg += w * max(-r[3], 0.0)
    return {"weight_pos": pos, "weight_neg": neg, "neg_share": neg / (pos + neg) if pos + neg else 0.0}


def _update(model, opt, rows, pad_id: int, cfg: WeftTrainConfig, ref_model=None, *, shared_prefix: bool = True) -> dict:
    """Clipped policy loss on the rows with a non-zero advantage; the token-mean denominator counts the
    policy tokens of every row (zero-advantage rows add no gradient but do count). With ``cfg.kl_coef > 0``
    and ``ref_model`` (the frozen start policy), ``kl_coef * k3`` is added on every row's policy tokens
    (aggregated the same way), so zero-advantage rows then enter the batch too."""
    from treadle.grpo.losses import aggregate_loss, kl_k3, policy_loss

    use_kl = cfg.kl_coef > 0 and ref_model is not None
    total_tokens = float(sum(sum(r[2]) for r in rows))
    total_seqs = float(sum(any(r[2]) for r in rows))
    live = [r for r in rows if r[3] != 0.0]
    weight = signed_weight(rows, cfg.loss_agg_mode)
    empty = {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "rows_updated": 0, **weight}
    if not live or total_tokens == 0:
        return empty
    batch = [r for r in rows if any(r[2])] if use_kl else live
    ids, mask, adv = _rows_batch(batch, pad_id)
    with torch.no_grad():
        model.eval()
        def logprobs(m):
            return _row_logprobs(m, batch, ids.shape[1]) if shared_prefix else _logprobs(m, ids)

        old = logprobs(model)
        ref = logprobs(ref_model) if use_kl else None
    model.train()
    stats, loss, kl_val = {}, torch.zeros(()), 0.0
    agg = dict(mode=cfg.loss_agg_mode, global_tokens=total_tokens, global_seqs=total_seqs)
    for _ in range(cfg.num_iterations):
        logp = logprobs(model)
        loss, stats = policy_loss(logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, **agg)
        if use_kl:
            kl = aggregate_loss(kl_k3(logp, ref), mask, **agg)
            kl_val = float(kl.detach())
            loss = loss + cfg.kl_coef * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return {"loss": float(loss.detach()), "clipfrac": float(stats["clipfrac"]), "approx_kl": float(stats["approx_kl"]),
            "kl_ref": kl_val, "rows_updated": len(live), "max_row_len": int(ids.shape[1]), **weight}


async def _evaluate(rt, h, model, tok, held, cfg: WeftTrainConfig) -> dict:
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


def _round_episodes(cfg: WeftTrainConfig, step: int, r: int):
    """Round ``r`` of a step's fresh train episodes (round 0: the draws of the plain loop; further rounds
    from a range no step's round 0 reaches) and its sampling seed."""
    from treadle.weft.rl.worlds import episodes

    n_eps = cfg.turns_per_step // 2
    start = (500_000 + cfg.seed * 10_000 + step * n_eps if r == 0
             else 5_000_000 + cfg.seed * 1_000_000 + step * 16 * n_eps + (r - 1) * n_eps)
    return episodes(n_eps, "train", start=start), cfg.seed * 1_000_003 + step + r * 100_019


def _first_with_signal(signal: list, have: int, cap: int, dp) -> tuple[list, int]:
    """``(this round's groups to keep, groups kept so far over every rank)``: the first ``cap - have`` groups
    with signal of a round in the one-process order (round, then episode; the ranks hold contiguous shards
    in rank order, so the ranks agree on the count and a rank keeps the same groups as one process would)."""
    if dp is None:
        take = signal[:max(cap - have, 0)]
        return take, have + len(take)
    n, total = dp.first_of_round(len(signal), cap - have)
    return signal[:n], min(have + total, cap)


async def _atomic_batch(rt, h, cfg: WeftTrainConfig, step: int, sampler, tok, harness, dp):
    """``(kept groups, every generated group, rounds used)`` of one step (dynamic sampling: see
    :class:`WeftTrainConfig`)."""
    from treadle.weft.rl.gold import play_gold
    from treadle.weft.rl.groups import has_signal
    from treadle.weft.rl.sampling import sample_groups

    kept, generated, have = [], [], 0
    for r in range(cfg.sampling_rounds):
        eps, seed = _round_episodes(cfg, step, r)
        golds = [await play_gold(rt, h, e, harness, verify=False) for e in (eps if dp is None else dp.shard(eps))]
        groups = await sample_groups(rt, h, [s for g in golds for s in g.starts], cfg.G, sampler, tok, harness,
                                     seed=seed, max_steps=cfg.max_steps, replay_check=False)
        generated += groups
        if cfg.sampling_rounds == 1:
            return groups, generated, 1
        take, have = _first_with_signal(
            [g for g in groups if has_signal([c.r for c in g.candidates if c.env_failure is None])], have,
            cfg.turns_per_step, dp)
        kept += take
        if have >= cfg.turns_per_step:
            break
    return kept, generated, r + 1


@dataclasses.dataclass
class _EpisodeGroup:
    key: str
    n_turns: int
    trajs: list
    rewards: list
    valid: list


async def _trajectory_batch(rt, h, cfg: WeftTrainConfig, step: int, sampler, tok, harness, dp):
    """``(kept episode groups, every generated one, rounds used)`` of one step: G whole-episode rollouts per
    episode, reward ``R`` per trajectory (dynamic sampling as :func:`_atomic_batch`, per episode group)."""
    from treadle.weft.rl.gold import play_gold
    from treadle.weft.rl.groups import has_signal

    n_eps = cfg.turns_per_step // 2
    kept, generated, have = [], [], 0
    for r in range(cfg.sampling_rounds):
        eps, seed = _round_episodes(cfg, step, r)
        golds = [await play_gold(rt, h, e, harness, verify=False) for e in (eps if dp is None else dp.shard(eps))]
        groups = []
        for key, n_turns, tr_list in await _trajectories(rt, h, golds, cfg.G, sampler, tok, harness, seed=seed,
                                                         max_steps=cfg.max_steps):
            rv = [_traj_reward(tr, n_turns) for tr in tr_list]
            groups.append(_EpisodeGroup(key, n_turns, tr_list, [x for x, _ in rv], [ok for _, ok in rv]))
        generated += groups
        if cfg.sampling_rounds == 1:
            return groups, generated, 1
        signal = [g for g in groups if has_signal([x for x, ok in zip(g.rewards, g.valid) if ok])]
        take, have = _first_with_signal(signal, have, n_eps, dp)
        kept += take
        if have >= n_eps:
            break
    return kept, generated, r + 1


async def train_policy(model, tok, cfg: WeftTrainConfig, *, log=None, progress: bool = True, dp=None,
                       sampler_factory=None, checkpoint=None, shared_prefix: bool = True) -> dict:
    """Run GRPO on ``model`` in place (see the module docstring); returns the summary dict with
    ``evals`` (step -> held-out success) and ``records`` (one dict per step).

    ``dp``: None (one process), or the data-parallel hooks of one rank
    (:class:`treadle.weft.rl.parallel.WeftDataParallel`; use :func:`treadle.weft.rl.parallel.train_policy_dp`),
    which may resume from a step checkpoint (``dp.resume``) and write one after each step (``dp.step_done``).
    ``checkpoint``: one process (``dp`` None): the same two hooks, e.g. a
    :class:`treadle.distributed.weft_resume.StepCheckpoint` (None: no step checkpoints).
    ``sampler_factory``: ``f(model, tok, cfg) -> Sampler`` for the rollouts (None: :class:`HFSampler`).
    ``shared_prefix``: one process: the update's forward runs once per distinct prefix (:func:`_row_logprobs`;
    the same maths, other float rounding); False runs the whole padded batch in one forward, as the
    data-parallel update always does (its ranks must make the same forward calls: DDP broadcasts buffers
    and FSDP2 all-gathers in each one), e.g. to compare the two bit for bit."""
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal

    from treadle.grpo.grouping import group_ids_from_uids
    from treadle.ops import grpo_advantages
    from treadle.weft.rl.gold import play_gold, shop_server
    from treadle.weft.rl.groups import group_advantages, group_stats
    from treadle.weft.rl.sampling import HFSampler
    from treadle.weft.rl.worlds import episodes
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.runtime import Runtime

    if dp is not None and cfg.kl_coef > 0 and dp.ref_model is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs a reference model in the data-parallel hooks: build "
                         f"WeftDataParallel(..., reference=True) (train_policy_dp does when kl_coef > 0)")
    harness = HermesHarness()
    torch.manual_seed(cfg.seed)
    ref_model = None
    if cfg.kl_coef > 0:  # the frozen start policy (before a step checkpoint is loaded)
        import copy

        ref_model = dp.ref_model if dp is not None else copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    records, evals = [], {}
    hooks = dp if dp is not None else checkpoint
    first = 0 if hooks is None else hooks.resume(model, opt, records, evals)  # a step checkpoint's next step, else 0
    evaluate = _evaluate if dp is None else dp.main_only(_evaluate)
    async with Runtime() as rt:
        h = await shop_server(rt)
        held = [await play_gold(rt, h, e, harness, verify=False)
                for e in episodes(cfg.eval_episodes, "heldout", start=900_000)]
        if 0 not in evals:
            evals[0] = await evaluate(rt, h, model, tok, held, cfg)
        for step in tqdm(range(first, cfg.steps), desc=f"weft grpo ({cfg.grouping})",
                         disable=not progress_enabled(progress)):
            t0 = time.perf_counter()
            sampler = _Timed(HFSampler(model, tok, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)
                             if sampler_factory is None else sampler_factory(model, tok, cfg))
            if cfg.grouping == "atomic":
                groups, gen_groups, n_rounds = await _atomic_batch(rt, h, cfg, step, sampler, tok, harness, dp)
                t_roll = time.perf_counter() - t0
                t1 = time.perf_counter()
                # under dp every rank joins the collective, also one with no group this step (it would hang)
                adv = (dp.group_advantages(groups) if dp is not None else
                       group_advantages(groups) if groups else torch.zeros(0))
                t_adv = time.perf_counter() - t1
                rows, i = [], 0
                for g in groups:
                    for c in g.candidates:
                        rows.append((g.prefix_ids, c.response_ids, c.policy_mask, float(adv[i])))
                        i += 1
                st = group_stats(gen_groups)
                rewards = [c.r for g in gen_groups for c in g.candidates if c.env_failure is None]
                generated = sum(len(g.candidates) for g in gen_groups)
                extra = {"all_equal_groups": st.all_equal_groups, "singleton_groups": st.singleton_groups,
                         "flagged_rows": st.flagged_rows, "flagged_successful_rows": st.flagged_successful_rows,
                         "env_failures": st.env_failures, "groups": st.groups, "groups_kept": len(groups)}
            else:
                kept, gen_eps, n_rounds = await _trajectory_batch(rt, h, cfg, step, sampler, tok, harness, dp)
                t_roll = time.perf_counter() - t0
                keys, rs, valid, segs = [], [], [], []
                for e in kept:
                    keys += [e.key] * len(e.trajs)
                    rs += e.rewards
                    valid += e.valid
                    segs += e.trajs
                t1 = time.perf_counter()
                advantages = grpo_advantages if dp is None else dp.grpo_advantages  # dp: every rank joins
                adv = torch.zeros(0) if dp is None and not rs else advantages(
                    torch.tensor(rs, dtype=torch.float32),
                    group_ids_from_uids(keys) if dp is None else dp.group_ids(keys),
                    valid=torch.tensor(valid, dtype=torch.bool))  # bool also when this rank has no row
                t_adv = time.perf_counter() - t1
                rows = [(grp.prefix_ids, c.response_ids, c.policy_mask, float(a))
                        for tr, a in zip(segs, adv.tolist()) for grp, c in tr]
                rewards = [c.r for e in gen_eps for tr in e.trajs for _, c in tr if c.env_failure is None]
                all_r = [r for e in gen_eps for r in e.rewards]
                generated = sum(len(tr) for e in gen_eps for tr in e.trajs)
                extra = {"all_equal_groups": sum(len(set(e.rewards)) == 1 for e in gen_eps),
                         "groups": len(gen_eps), "groups_kept": len(kept),
                         "trajectory_reward": sum(all_r) / max(len(all_r), 1),
                         "env_failures": sum(not v for e in gen_eps for v in e.valid)}
            extra.update(segments_generated=generated, segments_kept=len(rows),  # (a rank's part under dp: summed)
                         segments_dropped=generated - len(rows), sampling_rounds_used=n_rounds)
            t2 = time.perf_counter()
            if dp is None:
                upd = _update(model, opt, rows, tok.pad_token_id, cfg, ref_model, shared_prefix=shared_prefix)
            else:
                upd = dp.update(model, opt, rows, tok.pad_token_id, cfg, ref_model)
            t_upd = time.perf_counter() - t2
            rec = {"step": step, "grouping": cfg.grouping, "turn_reward": sum(rewards) / max(len(rewards), 1),
                   "segments": len(rows), "t_model_s": sampler.seconds, "t_env_s": t_roll - sampler.seconds,
                   "t_advantage_s": t_adv, "t_update_s": t_upd, "t_step_s": time.perf_counter() - t0, **extra, **upd}
            if dp is not None:  # the whole batch's numbers (weights: rows behind each mean)
                rec = dp.reduce_record(rec, {"turn_reward": len(rewards), "trajectory_reward":
                                               len(all_r) if cfg.grouping == "trajectory" else 0})
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                evals[step + 1] = await evaluate(rt, h, model, tok, held, cfg)
                rec["heldout"] = evals[step + 1]
            records.append(rec)
            if log is not None:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if hooks is not None:
                hooks.step_done(step, model, opt, records, evals)
        evals[cfg.steps] = await evaluate(rt, h, model, tok, held, cfg)
    tot = {k: sum(r[k] for r in records) for k in ("t_model_s", "t_env_s", "t_advantage_s", "t_update_s", "t_step_s")}
    n_seg = sum(r.get("segments_generated", r["segments"]) for r in records)  # throughput: every generated one
    return {"config": cfg.as_dict(), "evals": {str(k): v for k, v in evals.items()}, "records": records,
            "before": evals[0], "after": evals[cfg.steps], "segments": n_seg,
            "segments_per_s": n_seg / max(tot["t_step_s"], 1e-9),
            "time_share": {k: v / max(tot["t_step_s"], 1e-9) for k, v in tot.items() if k != "t_step_s"},
            "time_s": tot}
