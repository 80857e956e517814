"""SCALE Stage II on torch.distributed (DDP or FSDP2; issue 18): :func:`train_scale`, reached through
``treadle.scale.training.train(..., parallel="ddp" | "fsdp2")``.

The run itself (data, run folder, checkpoints and resume, step loop, summary) is the single-process one,
:func:`treadle.scale.stage_two.run`; this module gives it :class:`DataParallel`, which says what each
rank does:

* Training: the global batches are the single-process trainer's (same seeded shuffle, same
  ``batch_size``); rank r trains on its contiguous part of each. Its loss is ``objective(its rows) *
  (its response positions) / (response positions of the global batch, all-reduced) * world``, so after
  DDP/FSDP average the gradients the gates get the whole batch's gradient (SCALE sec. 4.3: a mean over
  response positions), and the logged loss (summed over ranks) is the whole batch's. Only the gates
  train; under FSDP2 the frozen base weights, the LoRA A/B and the gates are sharded (``fully_shard``
  per decoder layer plus the root) and all-gathered block by block inside the forward, where treadle's
  fused gated-LoRA op gets plain tensors.
* Before training (the gates are zero: lambda = 1, the Stage-I model) the objective and the held-out
  evaluation run on rank 0 before any sharding; sampled responses are drawn once by rank 0; both are
  broadcast.
* After training the objective and the held-out evaluation are computed by all ranks together, each on
  its part of every batch (:func:`evaluate_sharded`); the sums are all-reduced and the lambdas gathered,
  so the numbers are one process's (up to float summation order). Under FSDP2 the root's own
  parameters (embeddings, final norm, head) are all-gathered for the evaluation and the decoder layers'
  block by block in every forward; generation runs with transformers' ``synced_gpus`` (a rank whose
  sequences ended keeps taking part in the forwards until every rank's have), so the ranks' all-gathers
  line up.
* Checkpoints (``checkpoint/``) and the final ``gates.safetensors`` are written once, by rank 0, with
  full tensors in the single-process format: a run resumes on any number of ranks, or in one process.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from treadle.distributed.parallel import (all_reduce_sum, broadcast_object, check_data_parallel, check_parallel,
                                          decoder_layers, share, wrap)
from treadle.distributed.process_group import is_main, world_size
from treadle.scale.stage_two import Replicas

__all__ = ["train_scale", "DataParallel", "evaluate_sharded"]


class _ScaleStep(nn.Module):
    """The module DDP / FSDP2 wrap: the PEFT model as a submodule; forward = the Stage-II objective of a
    batch (:func:`treadle.scale.training.gate_objective`)."""

    def __init__(self, peft_model, k: int, objective: str):
        super().__init__()
        self.model = peft_model
        self.k, self.objective = k, objective

    def forward(self, input_ids, attention_mask, labels, response_mask):
        from treadle.scale.batches import ResponseBatch
        from treadle.scale.training import gate_objective

        return gate_objective(self.model, ResponseBatch(input_ids, attention_mask, labels, response_mask), k=self.k,
                              objective=self.objective)


def _rank_loss(wrapped, chunk, pad_id, device, *, grad: bool, group):
    """This rank's share of the global batch ``chunk``: ``(loss to backward, its share of the global mean)``."""
    from treadle.scale.batches import collate

    rows, real = share(len(chunk), group=group)
    batch = collate(chunk[rows], pad_id).to(device)
    mine = int(batch.response_mask.sum()) if real else 0
    (total,) = all_reduce_sum([mine], group=group)
    with torch.set_grad_enabled(grad):
        obj = wrapped(batch.input_ids, batch.attention_mask, batch.labels, batch.response_mask)
    part = obj * (mine / total)  # weight 0 for a rank that ran row 0 only to keep the collectives in step
    return part * world_size(group), float(part.detach())


def evaluate_sharded(model: nn.Module, tokenizer, problems_by_level: dict, *, k: int, max_new_tokens: int,
                     batch_size: int = 64, keep_lambdas: bool = False, group=None) -> dict:
    """:func:`treadle.scale.training.evaluate` with every rank on its contiguous part of each batch of
    ``batch_size`` problems (a rank without rows runs row 0 with weight 0, so every rank makes the same
    forwards). A collective: every rank calls it with the same arguments and gets the same result, the
    single-process one up to float summation order (the lambdas in the single-process order).

    The model must be usable by each rank on its own rows: replicated (DDP, or before sharding), or FSDP2
    with its root unsharded and generation synchronised (:meth:`DataParallel.evaluate` does both).

    Raises:
        ValueError: no problems, or a level with none (on every rank, before any collective).
    """
    from treadle.scale.gates import gated_layers
    from treadle.scale.training import evaluate_chunk, evaluation_report

    if not problems_by_level or any(len(v) == 0 for v in problems_by_level.values()):
        raise ValueError("problems_by_level must map each level to a non-empty list of problems")
    gated = bool(gated_layers(model))
    sums, chunks = [], []  # per level: [correct], then [entropy sum, positions]; per batch: lambdas
    ent_sum, ent_n = 0.0, 0
    for problems in problems_by_level.values():
        right = 0
        for i in range(0, len(problems), batch_size):
            chunk = problems[i:i + batch_size]
            rows, real = share(len(chunk), group=group)
            c, e, n, lams = evaluate_chunk(model, tokenizer, chunk[rows], k=k, max_new_tokens=max_new_tokens,
                                           gated=gated)
            if real:
                right, ent_sum, ent_n = right + c, ent_sum + e, ent_n + n
            chunks.append(lams if real else {})
        sums.append(right)
    *rights, ent_sum, ent_n = all_reduce_sum([*sums, ent_sum, ent_n], group=group)
    per_module = None
    if gated:
        ranks = [None] * world_size(group)
        dist.all_gather_object(ranks, chunks, group=group)
        per_module = {}
        for i in range(len(chunks)):  # batch by batch, rank by rank: the single-process order
            for r in ranks:
                for name, lam in r[i].items():
                    per_module.setdefault(name, []).append(lam)
    acc = {lv: rights[j] / len(p) for j, (lv, p) in enumerate(problems_by_level.items())}
    total = sum(len(p) for p in problems_by_level.values())
    return evaluation_report(acc, int(round(sum(rights))), total, ent_sum, int(round(ent_n)), per_module,
                             keep_lambdas=keep_lambdas)


class DataParallel(Replicas):
    """What each rank does in a data-parallel Stage-II run (see the module doc)."""

    def __init__(self, parallel: str, group=None, report_to=None):
        check_parallel(parallel, "SCALE Stage II")
        self.parallel, self.group, self.report_to = parallel, group, report_to
        self.world, self.main = world_size(group), is_main(group)

    def check(self, config) -> None:
        check_data_parallel(self.parallel, "SCALE Stage II", batch_size=config.batch_size, report_to=self.report_to,
                            group=self.group)

    def sample(self, make):  # once, by rank 0, before sharding
        return broadcast_object(make() if self.main else None, group=self.group)

    def broadcast(self, obj):
        return broadcast_object(obj, group=self.group)

    def all_sum(self, values):
        return all_reduce_sum(values, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def before(self, measure):  # the Stage-I model, whole on every rank until wrap(): rank 0 alone
        return broadcast_object(measure() if self.main else None, group=self.group)

    def wrap(self, peft_model, k, objective) -> None:
        super().wrap(peft_model, k, objective)
        blocks = decoder_layers(peft_model) if self.parallel == "fsdp2" else []
        self.wrapped = wrap(_ScaleStep(peft_model, k, objective), self.parallel, blocks=blocks, group=self.group)

    def batch_loss(self, chunk, pad_id, device):
        return _rank_loss(self.wrapped, chunk, pad_id, device, grad=True, group=self.group)

    def objective_over(self, pairs, pad_id, batch_size) -> float:
        from treadle.scale.stage_two import global_batches

        device = next(self.model.parameters()).device
        acc = 0.0
        with torch.no_grad():
            for _, _, chunk in global_batches(pairs, batch_size, None):
                acc += _rank_loss(self.wrapped, chunk, pad_id, device, grad=False, group=self.group)[1] * \
                    sum(len(r) for _, r in chunk)  # position-weighted like _objective_over
        (tot,) = all_reduce_sum([acc], group=self.group)
        return tot / max(sum(len(r) for _, r in pairs), 1)

    def evaluate(self, tokenizer, heldout, *, max_new_tokens, keep_lambdas):
        with self._evaluable():
            return evaluate_sharded(self.model, tokenizer, heldout, k=self.k, max_new_tokens=max_new_tokens,
                                    keep_lambdas=keep_lambdas, group=self.group)

    @contextlib.contextmanager
    def _evaluable(self):
        """FSDP2: all-gather the root's own parameters (embeddings, final norm, head: used outside the
        wrapped step module's forward) until the end, and mark the Hugging Face model as FSDP-managed the
        way transformers' own FSDP2 set-up does, so that ``generate`` runs with ``synced_gpus``. DDP: no
        change (every rank holds the whole model)."""
        if self.parallel != "fsdp2":
            yield
            return
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        had = base.__dict__.get("_is_fsdp_managed_module", None)
        self.wrapped.unshard()
        base._is_fsdp_managed_module = True
        try:
            yield
        finally:
            if had is None:
                base.__dict__.pop("_is_fsdp_managed_module", None)
            else:
                base._is_fsdp_managed_module = had
            self.wrapped.reshard()


def train_scale(peft_model: nn.Module, tokenizer, config=None, out_dir=None, *, parallel: str, group=None,
                console=None, progress: bool = False, evaluate_model: bool = True, evaluate_before: bool = True,
                report_to=None, resume: bool = True, save_every: int | None = 10) -> dict:
    """Data-parallel :func:`treadle.scale.training.train` (same arguments, files and summary keys, plus
    ``parallel`` and ``world_size``).

    Raises:
        NotDistributedError: torch.distributed is not initialised (run under torchrun).
        ValueError / GateError / TypeError: as the single-process trainer, before any change; also
            ``batch_size`` smaller than the world size, or a ``report_to`` sink (single-process only).
    """
    from treadle.scale.stage_two import run

    return run(peft_model, tokenizer, config, out_dir, DataParallel(parallel, group, report_to), console=console,
               progress=progress, evaluate_model=evaluate_model, evaluate_before=evaluate_before, report_to=None,
               resume=resume, save_every=save_every)
