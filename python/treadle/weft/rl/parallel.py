"""The WEFT GRPO trainer (``treadle weft train``) on torch.distributed with DDP.

One GRPO step of :func:`treadle.weft.rl.train.train_policy` over ``W`` ranks:

* **Rollouts sharded per rank.** The step's episodes (the same draw as one process) are split into
  contiguous parts (:func:`treadle.distributed.parallel.share`); each rank plays and samples only its
  episodes, in its own :class:`~treadle.weft.runtime.Runtime`. A group (atomic: one turn start's G
  candidates; trajectory: one episode's G rollouts) stays on one rank.
* **Sampling that does not depend on the batch.** ``model.generate`` with one seed per call draws a
  row's tokens from a random stream shared by the whole batch, so a rank holding half the rows would
  sample other tokens than one process. :class:`RowKeyedSampler` gives every row its own generator,
  seeded from (call seed, the row's context ids, its occurrence among identical contexts of the call),
  and samples by Gumbel-max (``argmax(logits / T + Gumbel noise)`` is an exact sample of
  ``softmax(logits / T)``): a row gets the same tokens in any batch, on any rank.
* **Group statistics** through :func:`treadle.distributed.grpo.grpo_advantages_dp` (rewards, valid and
  flag bits of every rank gathered; the whole batch's advantages computed once) with group ids
  numbered over ranks (:func:`~treadle.distributed.grpo.global_group_ids`): equal to one process's.
* **Dynamic sampling** (``sampling_rounds`` > 1): after each round the ranks all-reduce their counts of
  groups with signal (:meth:`WeftDataParallel.first_of_round`); counted in rank order, which is the
  episodes' order, each rank keeps its part of the first groups one process would keep, and every rank
  stops after the same round.
* **Loss**: the clipped policy loss with the global denominators (policy tokens of every row of every
  rank for ``token-mean``; live non-empty rows for the ``seq-mean-*`` modes), all-reduced, and
  ``dp_size = W``; gradients averaged by ``DistributedDataParallel``. A rank with no row to update runs
  a zero-weight row, so every rank makes the same collective calls.
* **Step checkpoints** (``checkpoint=``, :class:`treadle.distributed.weft_resume.StepCheckpoint`): written
  once by rank 0 every N steps; a run resumes from one on any world size with the uninterrupted run's
  result (nothing above depends on the world size; a step may have fewer episodes than ranks, the last
  ranks then sample nothing and run a zero-weight update row, so no config has to follow the world size).
* **Evaluation, log and summary once**: held-out evaluation runs on rank 0 (the DDP replicas hold equal
  weights) and its result is broadcast; step records are combined over ranks (counts summed, means
  weighted, wall times the slowest rank's) and written by rank 0 only.

**FSDP2** (``parallel="fsdp2"``): the policy is sharded with ``fully_shard`` per decoder layer and at the
root (parameters, gradients and AdamW state 1/world per rank). Generation cannot run inside the sharded
forward: each rank samples its own episodes, so the ranks make different numbers of forwards with
different lengths, and FSDP2 all-gathers in every forward. So before the step's rollouts (and before
rank 0's evaluation) every rank all-gathers the whole policy once (:meth:`WeftDataParallel.gather_weights`:
``unshard()`` with no reshard after forward) and generates with it on its own, without collectives; the
update reshards (:meth:`WeftDataParallel.shard_weights`) and runs the same forwards / backwards on every
rank (a zero-weight row where a rank has none), gradients reduce-scattered. The memory saving is
therefore for the update only: generation holds the whole policy on each rank, as DDP does.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import json
import time
from pathlib import Path

import torch

from treadle.distributed.grpo import global_group_ids, grpo_advantages_dp
from treadle.distributed.process_group import rank as dist_rank
from treadle.distributed.parallel import all_reduce_sum, broadcast_object, check_parallel, decoder_layers, share, wrap
from treadle.distributed.process_group import is_main, world_size
from treadle.weft.rl.sampling import HFSampler

__all__ = ["WEFT_PARALLEL", "RowKeyedSampler", "row_seeds", "WeftDataParallel", "train_policy_dp", "one_run_dp"]

WEFT_PARALLEL = ("ddp", "fsdp2")

# record keys summed over ranks, and wall times (the slowest rank's)
_SUMS = ("segments", "all_equal_groups", "singleton_groups", "flagged_rows", "flagged_successful_rows",
         "env_failures", "groups", "groups_kept", "segments_generated", "segments_kept", "segments_dropped")
_TIMES = ("t_model_s", "t_env_s", "t_advantage_s", "t_update_s", "t_step_s")


def row_seeds(rows, seed: int) -> list[int]:
    """One 63-bit seed per sampler row ``(turn start, step, context ids)``: a hash of ``seed``, the
    context ids and the row's occurrence among the rows of this call with identical context ids (the
    G candidates of a turn start share their first context). Rows of one group are kept together and
    in order on one rank, so a row gets the same seed in any batch and on any rank."""
    seen: dict[bytes, int] = {}
    out = []
    for _, _, ctx in rows:
        digest = hashlib.sha256(json.dumps([int(t) for t in ctx]).encode()).digest()
        k = seen.get(digest, 0)
        seen[digest] = k + 1
        h = hashlib.sha256(digest + f"|{int(seed)}|{k}".encode()).digest()
        out.append(int.from_bytes(h[:8], "little") >> 1)
    return out


class _GumbelMax:
    """A logits processor: ``scores / T + Gumbel noise`` from one generator per row, so that greedy
    decoding (argmax) draws each row's token from ``softmax(scores / T)`` with the row's own stream."""

    def __init__(self, seeds: list[int], temperature: float):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature

    def __call__(self, input_ids, scores):
        V = scores.shape[-1]
        u = torch.stack([torch.rand(V, generator=g, dtype=torch.float64) for g in self.gens])
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        return (scores.double() / self.temperature + gumbel.to(scores.device)).to(scores.dtype)


class RowKeyedSampler(HFSampler):
    """:class:`~treadle.weft.rl.sampling.HFSampler` whose rows do not share a random stream: row ``i``
    is sampled with its own generator seeded by :func:`row_seeds` (Gumbel-max; greedy when
    ``temperature == 0``), so the tokens of a row do not depend on the other rows of the batch
    (up to the float rounding of batched logits). Same arguments as HFSampler."""

    @torch.no_grad()
    def generate(self, rows, seed):
        if self.temperature == 0 or not rows:
            return super().generate(rows, seed)
        from transformers import LogitsProcessorList

        return self._decode(rows, do_sample=False,
                            logits_processor=LogitsProcessorList([_GumbelMax(row_seeds(rows, seed), self.temperature)]))


def keyed_sampler(model, tok, cfg) -> RowKeyedSampler:
    """The default sampler factory of the data-parallel trainer (``cfg``'s temperature and budget)."""
    return RowKeyedSampler(model, tok, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens)


class WeftDataParallel:
    """The hooks :func:`treadle.weft.rl.train.train_policy` calls (``dp=``) to run one rank of a DDP job
    (see the module docstring). Build it after ``torch.distributed`` is initialised, once per run.

    ``checkpoint``: a :class:`treadle.distributed.weft_resume.StepCheckpoint` (None: no step checkpoints);
    ``log``: rank 0's open step log, to which a resumed run's earlier records are written first.

    Raises:
        NotDistributedError: torch.distributed is not initialised. ValueError: ``parallel`` not ``"ddp"`` or
        ``"fsdp2"``.
    """

    def __init__(self, model, parallel: str = "ddp", *, group=None, checkpoint=None, log=None,
                 reference: bool = False):
        if parallel not in WEFT_PARALLEL:
            raise ValueError(f"parallel must be one of {WEFT_PARALLEL}, got {parallel!r}")
        check_parallel(parallel, "WEFT GRPO training")
        self.group, self.world, self.is_main = group, world_size(group), is_main(group)
        self.model, self.parallel = model, parallel
        # the frozen start policy of the KL penalty (kl_coef > 0), copied before wrapping: a whole replica
        # on every rank (also under FSDP2: it runs no_grad forwards only, with no collective)
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if reference else None
        blocks = decoder_layers(model) if parallel == "fsdp2" else ()
        self.wrapped = wrap(model, parallel, blocks=blocks, group=group)
        self._unsharded = False
        self.checkpoint, self.log = checkpoint, log

    # step checkpoints ------------------------------------------------------------------------------------
    def resume(self, model, opt, records: list, evals: dict) -> int:
        """Before the first step: load the run's step checkpoint, if any (:class:`StepCheckpoint`), and
        write the records it holds to the log first. Returns the step to run next (0 without one)."""
        if self.checkpoint is None:
            return 0
        first = self.checkpoint.resume(model, opt, records, evals)
        if self.log is not None and self.is_main:
            for rec in records:
                self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
        return first

    def step_done(self, step: int, model, opt, records: list, evals: dict) -> None:
        """After each step: the step checkpoint when due (written once, by rank 0)."""
        if self.checkpoint is not None:
            self.checkpoint.step_done(step, model, opt, records, evals)

    # FSDP2: whole weights for generation ------------------------------------------------------------------
    def _fsdp_units(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.model.modules() if isinstance(m, FSDPModule)]

    def gather_weights(self) -> None:
        """FSDP2: all-gather every unit's parameters once (a collective) and keep them whole (no reshard
        after forward), so that this rank's rollouts and evaluation run any number of forwards, with any
        lengths, without collectives; every rank calls it at the same point. A no-op for DDP or when
        already gathered."""
        if self.parallel != "fsdp2" or self._unsharded:
            return
        units = self._fsdp_units()
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
        for m in units:
            m.unshard()
        # transformers turns synced_gpus on for an FSDP module (every rank steps until all finish: an
        # all-reduce per token); here each rank generates alone, so this model's generate runs without it
        self.model.generate = functools.partial(type(self.model).generate, self.model, synced_gpus=False)
        self._unsharded = True

    def shard_weights(self) -> None:
        """FSDP2: back to sharded parameters (1/world per rank, all-gathered block by block inside each
        forward) before the update. No collective; a no-op for DDP or when not gathered."""
        if not self._unsharded:
            return
        for m in self._fsdp_units():
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
        del self.model.generate  # back to the class's (synced_gpus for an FSDP module)
        self._unsharded = False

    # rollouts ------------------------------------------------------------------------------------------
    def shard(self, items: list) -> list:
        """This rank's contiguous part of the step's episodes; empty on the last ranks when there are fewer
        episodes than ranks (such a rank samples nothing, adds no row to the group statistics and runs a
        zero-weight row in the update, so the numbers do not depend on the world size). Under FSDP2 the
        weights are gathered first (:meth:`gather_weights`): the rollouts that follow are this rank's own."""
        self.gather_weights()
        if not items:
            return []
        rows, real = share(len(items), group=self.group)
        return list(items)[rows] if real else []

    def main_only(self, fn):
        """``await fn(...)`` on rank 0 (evaluation: the replicas hold equal weights); every rank gets its
        result (broadcast)."""
        async def run(*args, **kwargs):
            self.gather_weights()  # FSDP2: rank 0 runs forwards alone
            res = await fn(*args, **kwargs) if self.is_main else None
            return broadcast_object(res, group=self.group)
        return run

    def first_of_round(self, n: int, room: int) -> tuple[int, int]:
        """Dynamic sampling over ranks (``WeftTrainConfig.sampling_rounds``): of this rank's ``n`` groups with
        signal in a round, how many fall among the round's first ``room`` over every rank (counted in rank
        order: the episodes are contiguous shards), and the round's total over ranks. A collective."""
        me = dist_rank(self.group)
        counts = all_reduce_sum([n if i == me else 0 for i in range(self.world)], group=self.group)
        before = int(sum(counts[:me]))
        return max(0, min(n, room - before)), int(sum(counts))

    # advantages ----------------------------------------------------------------------------------------
    def group_ids(self, uids) -> torch.Tensor:
        return global_group_ids(list(uids), group=self.group)

    def grpo_advantages(self, rewards, group_ids, **kwargs) -> torch.Tensor:
        return grpo_advantages_dp(rewards, group_ids, group=self.group, **kwargs)

    def group_advantages(self, groups, *, estimator: str = "grpo", **options) -> torch.Tensor:
        """:func:`treadle.weft.rl.groups.group_advantages` with the statistics of every rank's groups."""
        from treadle.weft.rl.groups import _tensors

        keys, _, rewards, valid, flags = _tensors(groups)
        return grpo_advantages_dp(rewards, self.group_ids(keys), valid=valid, flags=flags, estimator=estimator,
                                  group=self.group, **options)

    # update --------------------------------------------------------------------------------------------
    def update(self, model, opt, rows, pad_id: int, cfg, ref_model=None) -> dict:
        """:func:`treadle.weft.rl.train._update` over the rows of every rank: global denominators
        (all-reduced), DDP-averaged gradients; returns the whole batch's loss and statistics. With
        ``cfg.kl_coef > 0`` and ``ref_model`` (:attr:`ref_model`), ``kl_coef * k3`` to the start policy is
        added on every row's policy tokens, as in one process (zero-advantage rows enter the batch)."""
        from treadle.grpo.losses import aggregate_loss, kl_k3, policy_loss
        from treadle.weft.rl.train import _logprobs, _rows_batch

        self.shard_weights()  # FSDP2: every rank runs the same forwards / backwards from here
        use_kl = cfg.kl_coef > 0 and ref_model is not None
        live = [r for r in rows if r[3] != 0.0]
        tokens, seqs, n_live = all_reduce_sum([sum(sum(r[2]) for r in rows), sum(any(r[2]) for r in rows),
                                               len(live)], group=self.group)
        if n_live == 0 or tokens == 0:
            return {"loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "rows_updated": 0}
        batch = [r for r in rows if any(r[2])] if use_kl else live
        real = bool(batch)
        if real:
            ids, mask, adv = _rows_batch(batch, pad_id)
        else:  # a zero-weight row: this rank still joins DDP's gradient all-reduce
            ids = torch.full((1, 2), pad_id, dtype=torch.long)
            mask, adv = torch.zeros((1, 1)), torch.zeros(1)
        dev = next(model.parameters()).device
        ids, mask, adv = ids.to(dev), mask.to(dev), adv.to(dev)
        with torch.no_grad():
            model.eval()
            old = _logprobs(model, ids)
            ref = _logprobs(ref_model, ids) if use_kl else None
        model.train()
        loss, stats, kl_val = torch.zeros(()), {}, 0.0
        agg = dict(mode=cfg.loss_agg_mode, global_tokens=tokens, global_seqs=max(seqs, 1.0), dp_size=self.world)
        for _ in range(cfg.num_iterations):
            logp = _logprobs(self.wrapped, ids)
            loss, stats = policy_loss(logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, **agg)
            if use_kl:
                kl = aggregate_loss(kl_k3(logp, ref), mask, **agg)
                kl_val = float(kl.detach()) / self.world if real else 0.0  # this rank's share of the batch's KL
                loss = loss + cfg.kl_coef * kl
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
        n_tok = float(mask.sum()) if real else 0.0
        tot_loss, clip_tok, kl_tok, live_tok, kl_ref = all_reduce_sum(
            [float(loss.detach()) / self.world if real else 0.0, float(stats["clipfrac"]) * n_tok,
             float(stats["approx_kl"]) * n_tok, n_tok, kl_val], group=self.group)
        return {"loss": tot_loss, "clipfrac": clip_tok / max(live_tok, 1.0), "approx_kl": kl_tok / max(live_tok, 1.0),
                "kl_ref": kl_ref, "rows_updated": int(n_live)}

    # records -------------------------------------------------------------------------------------------
    def reduce_record(self, rec: dict, weights: dict[str, float]) -> dict:
        """A step record of the whole batch: counts summed, the means named in ``weights`` weighted by
        their row counts, wall times the slowest rank's; the rest (loss, config) taken as is."""
        import torch.distributed as dist

        every: list = [None] * self.world
        dist.all_gather_object(every, (rec, weights), group=self.group)
        out = dict(rec)
        for k in _SUMS:
            if k in rec:
                out[k] = sum(r[k] for r, _ in every)
        for k in _TIMES:
            if k in rec:
                out[k] = max(r[k] for r, _ in every)
        for k in weights:
            if k in rec:
                n = sum(w[k] for _, w in every)
                out[k] = sum(r[k] * w[k] for r, w in every) / max(n, 1)
        return out


async def train_policy_dp(model, tok, cfg, *, parallel: str = "ddp", group=None, log=None, progress: bool = True,
                          sampler_factory=None, checkpoint=None) -> dict:
    """:func:`treadle.weft.rl.train.train_policy` as one rank of a data-parallel job (see the module
    docstring); every rank calls it with the same model weights and ``cfg``.

    Args:
        model, tok, cfg: as train_policy (``cfg`` a :class:`~treadle.weft.rl.train.WeftTrainConfig`).
        parallel: ``"ddp"`` or ``"fsdp2"`` (module docstring). group: process group (None: default).
        log: an open text file for the step records, used on rank 0 only.
        sampler_factory: ``f(model, tok, cfg) -> Sampler``; default :class:`RowKeyedSampler` (pass the
            same factory to a one-process train_policy to get the same rollouts).
        checkpoint: a :class:`~treadle.distributed.weft_resume.StepCheckpoint`: resume from it when it holds
            a usable checkpoint (any world size), write one every ``checkpoint.every`` steps (rank 0).

    Returns:
        The summary dict of train_policy (the whole batch's numbers) on every rank.

    Raises:
        NotDistributedError: torch.distributed not initialised. ValueError: ``parallel`` not ``"ddp"`` / ``"fsdp2"``
        (before any rollout). Fewer episodes per step (``turns_per_step / 2``) than ranks is allowed: the
        last ranks have none (:meth:`WeftDataParallel.shard`), so ``cfg`` need not depend on the world size.
    """
    from treadle.weft.rl.train import train_policy

    if parallel not in WEFT_PARALLEL:
        raise ValueError(f"parallel must be one of {WEFT_PARALLEL}, got {parallel!r}")
    dp = WeftDataParallel(model, parallel, group=group, checkpoint=checkpoint, log=log if is_main(group) else None,
                          reference=cfg.kl_coef > 0)
    try:
        return await train_policy(model, tok, cfg, log=log if dp.is_main else None, progress=progress and dp.is_main,
                                  dp=dp, sampler_factory=sampler_factory or keyed_sampler)
    finally:
        dp.shard_weights()  # FSDP2: the policy is left sharded (DTensors), as after fully_shard


def one_run_dp(policy, cfg, sub: Path, *, parallel: str = "ddp", checkpoint_every: int | None = None,
               resume: bool = True, console=None):
    """One (grouping, seed) run of ``treadle weft train --parallel ddp|fsdp2``
    (:func:`treadle.weft.rl.report.run_comparison`'s ``runner``, with the keywords bound): every rank
    trains a copy of ``policy = (model, tokenizer)``; rank 0 writes ``sub/steps.jsonl`` and
    ``sub/summary.json`` (with the start policy's ``policy_sha256``, so that a finished run is reused like
    a one-process one) and returns the summary, the other ranks return None.

    ``checkpoint_every``: write a step checkpoint (``sub/checkpoint/state.pt``) every that many steps (None:
    none). ``resume``: continue from a usable checkpoint found there (same config and start policy, any
    world size; :mod:`treadle.distributed.weft_resume`); False starts over (and replaces it).
    ``console``: where rank 0 says that it resumed, or why a checkpoint found was not used."""
    import anyio

    from treadle.distributed.weft_resume import SAMPLER_KEY, StepCheckpoint
    from treadle.weft.rl.report import policy_fingerprint

    model, tok = copy.deepcopy(policy[0]), policy[1]
    main = is_main()
    fp = policy_fingerprint(policy[0])
    c0 = time.process_time()
    if main:
        sub.mkdir(parents=True, exist_ok=True)
    ckpt = None
    if checkpoint_every is not None:
        ckpt = StepCheckpoint(sub / "checkpoint", checkpoint_every,
                              config={**cfg.as_dict(), SAMPLER_KEY: "row-keyed"}, steps=cfg.steps, policy_sha256=fp)
        if not resume and main and ckpt.path.exists():
            ckpt.path.unlink()
    log = open(sub / "steps.jsonl", "w") if main else None  # noqa: SIM115
    try:
        s = anyio.run(lambda: train_policy_dp(model, tok, cfg, parallel=parallel, log=log, progress=False,
                                                     checkpoint=ckpt))
    finally:
        if log is not None:
            log.close()
    if not main:
        return None
    if console is not None and ckpt is not None and (ckpt.resumed_from is not None or ckpt.skipped):
        console.print(f"{sub.name}: " + (f"resumed at step {ckpt.resumed_from} of {cfg.steps} from {ckpt.path}"
                                         if ckpt.resumed_from is not None else
                                         f"checkpoint {ckpt.path} not used: {ckpt.skipped}; trained from step 0"),
                      markup=False)
    s["cpu_s"] = time.process_time() - c0
    s["world_size"] = world_size()
    s["parallel"] = parallel
    s["policy_sha256"] = fp
    s["resumed_from_step"] = ckpt.resumed_from if ckpt is not None else None
    (sub / "summary.json").write_text(json.dumps(s, indent=1))
    return s
