"""SCALE Stage II on torch.distributed (DDP or FSDP2; issue 18): :func:`train_scale`, reached through
``treadle.scale.training.train(..., parallel="ddp" | "fsdp2")``.

The global batches are the single-process trainer's (same seeded shuffle, same ``batch_size``); rank r
trains on its contiguous part of each. Its loss is ``objective(its rows) * (its response positions) /
(response positions of the global batch, all-reduced) * world``, so after DDP/FSDP average the
gradients the gates get the whole batch's gradient (SCALE sec. 4.3: a mean over response positions),
and the logged loss (summed over ranks) is the whole batch's. Only the gates train; under FSDP2 the
frozen base weights, the LoRA A/B and the gates are sharded (``fully_shard`` per decoder layer plus
the root) and all-gathered block by block inside the forward, where treadle's fused gated-LoRA op gets
plain tensors.

What runs where: the Stage-I evaluation and the objective before training run on rank 0 before any
sharding (the gates are zero: lambda = 1, the Stage-I model); sampled responses are drawn once by rank
0 and broadcast. After training the objective is computed by all ranks together; the held-out
evaluation (greedy generation) runs on rank 0 under DDP, and is NOT run under FSDP2 (generation stops
at a data-dependent step, so the ranks' all-gathers would not line up): ``after`` is None there;
evaluate the saved ``gates.safetensors`` in one process (:func:`treadle.scale.load_gates`). Gates are
written once, by rank 0, with full tensors. There is no mid-run checkpoint (as in one process).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from treadle.distributed.parallel import (all_reduce_sum, broadcast_object, check_parallel, full_parameters,
                                          full_tensor, share, wrap)
from treadle.distributed.process_group import is_main, world_size

__all__ = ["train_scale"]


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


def _global_batches(pairs, batch_size: int, generator: torch.Generator | None):
    order = torch.randperm(len(pairs), generator=generator).tolist() if generator is not None else \
        list(range(len(pairs)))
    for i in range(0, len(order), batch_size):
        yield [pairs[j] for j in order[i:i + batch_size]]


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


def train_scale(peft_model: nn.Module, tokenizer, config=None, out_dir=None, *, parallel: str, group=None,
                console=None, progress: bool = False, evaluate_model: bool = True, evaluate_before: bool = True,
                report_to=None) -> dict:
    """Data-parallel :func:`treadle.scale.training.train` (same arguments, files and summary keys).

    Raises:
        NotDistributedError: torch.distributed is not initialised (run under torchrun).
        ValueError / GateError / TypeError: as the single-process trainer, before any change; also
            ``batch_size`` smaller than the world size, or a ``report_to`` sink (single-process only).
    """
    from tqdm.auto import tqdm

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.run_dirs import check_out_dir, make_out_dir
    from treadle.scale.batches import _check_tokenizer, collate, problem_pairs, sampled_pairs
    from treadle.scale.gates import _active_adapter, _lora_layers, attach_gates, gated_layers, save_gates
    from treadle.scale.training import (ScaleTrainConfig, _base_name, _heldout, _objective_over, _vocab, clamp_lambda,
                                        evaluate, lambda_histogram)

    check_parallel(parallel, "SCALE Stage II")
    config = config or ScaleTrainConfig()
    if not isinstance(config, ScaleTrainConfig):
        raise TypeError(f"config must be a ScaleTrainConfig, got {type(config).__name__}")
    if report_to not in (None, "none"):
        raise ValueError(f"report_to={report_to!r} is not supported with parallel={parallel!r} (use None); "
                         f"log.jsonl in the run folder holds every step")
    W, main = world_size(group), is_main(group)
    if config.batch_size < W:
        raise ValueError(f"batch_size ({config.batch_size}) must be >= the world size ({W}): every rank trains on "
                         f"a part of each global batch")
    _check_tokenizer(tokenizer)
    _lora_layers(peft_model, _active_adapter(peft_model), disable_dropout=True, expect_gated=False)
    if out_dir is not None:
        check_out_dir(out_dir)
    vocab = _vocab(peft_model)
    if vocab < 2:
        raise ValueError(f"the model's vocabulary has {vocab} entries; the top-k entropy needs >= 2")
    k = min(config.k, vocab)
    say = console.print if (console is not None and main) else (lambda *a, **kw: None)
    if k != config.k:
        say(f"[yellow]k = {config.k} exceeds the vocabulary ({vocab}); using k = {k} (normaliser log {k})[/yellow]")

    torch.manual_seed(config.seed)
    problems = ProblemGenerator(config.seed).mixture(config.train_size, {lv: 1.0 for lv in config.levels},
                                                     split="train")
    if config.responses == "sampled":  # once, by rank 0, before sharding
        pairs = sampled_pairs(peft_model, tokenizer, problems, max_new_tokens=config.max_new_tokens,
                              temperature=config.temperature, seed=config.seed) if main else None
        pairs = broadcast_object(pairs, group=group)
    else:
        pairs = problem_pairs(tokenizer, problems)
    collate(pairs, tokenizer.pad_token_id)
    out = make_out_dir(out_dir) if (out_dir is not None and main) else (Path(out_dir) if out_dir is not None else None)

    params = attach_gates(peft_model, config.L, config.U, config.tau, disable_dropout=True)
    lo, hi = config.lambda_bounds
    if lo is not None or hi is not None:
        clamp_lambda(peft_model, lo, hi)
    peft_model.eval()
    n_gate = sum(p.numel() for p in params)
    pad = tokenizer.pad_token_id
    log = None
    if out is not None and main:
        (out / "config.json").write_text(json.dumps({**dataclasses.asdict(config), "k_used": k,
                                                     "lambda_bounds": list(config.lambda_bounds),
                                                     "parallel": parallel, "world_size": W}, indent=1))
        log = open(out / "log.jsonl", "w")

    def write(rec):
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    heldout = _heldout(config) if evaluate_model else None
    try:
        write({"type": "config", **dataclasses.asdict(config), "k_used": k, "gate_params": n_gate,
               "parallel": parallel, "world_size": W})
        before = obj_before = None
        if main:  # the Stage-I model, whole on every rank until wrap(): rank 0 alone
            obj_before = _objective_over(peft_model, pairs, pad, k=k, objective=config.objective,
                                         batch_size=max(config.batch_size, 64))
            before = (evaluate(peft_model, tokenizer, heldout, k=k, max_new_tokens=config.max_new_tokens)
                      if evaluate_model and evaluate_before else None)
        obj_before, before = broadcast_object((obj_before, before), group=group)
        write({"type": "eval", "when": "before", "objective": obj_before, **(before or {})})
        step_module = _ScaleStep(peft_model, k, config.objective)
        blocks = []
        if parallel == "fsdp2":
            base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
            blocks = list(getattr(base.get_decoder(), "layers", []))
        wrapped = wrap(step_module, parallel, blocks=blocks, group=group)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]  # the gates (DTensors under FSDP2)
        opt = torch.optim.Adam(trainable, lr=config.lr)
        shuffle = torch.Generator().manual_seed(config.seed + 1)
        device = next(peft_model.parameters()).device
        losses = []
        steps = config.epochs * math.ceil(len(pairs) / config.batch_size)
        bar = tqdm(total=steps, disable=not (progress and main), desc=f"scale stage II ({parallel})")
        t0 = time.perf_counter()
        step = 0
        for epoch in range(config.epochs):
            for chunk in _global_batches(pairs, config.batch_size, shuffle):
                loss, mine = _rank_loss(wrapped, chunk, pad, device, grad=True, group=group)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                (total,) = all_reduce_sum([mine], group=group)
                losses.append(total)
                write({"type": "step", "step": step, "epoch": epoch, "loss": total})
                step += 1
                bar.update(1)
        bar.close()
        seconds = time.perf_counter() - t0
        acc = 0.0
        with torch.no_grad():
            for chunk in _global_batches(pairs, max(config.batch_size, 64), None):
                acc += _rank_loss(wrapped, chunk, pad, device, grad=False, group=group)[1] * \
                    sum(len(r) for _, r in chunk)  # position-weighted like _objective_over
        obj_after = _weighted_objective(acc, pairs, group)
        full = {name: {n: full_tensor(p) for n, p in m._parameters.items() if n.startswith("scale_gate")}
                for name, m in gated_layers(peft_model).items()}  # collectives: every rank
        after, lambdas = None, None
        if evaluate_model and parallel == "ddp" and main:  # replicated model: rank 0 alone, no collective
            after = evaluate(peft_model, tokenizer, heldout, k=k, max_new_tokens=config.max_new_tokens,
                             keep_lambdas=True)
            lambdas = after.pop("lambdas")
        elif evaluate_model and parallel == "fsdp2":
            say("held-out evaluation after training is skipped under FSDP2 (generation would desynchronise the "
                "ranks); evaluate gates.safetensors in one process")
        write({"type": "eval", "when": "after", "objective": obj_after, **(after or {})})
    finally:
        if log is not None:
            log.close()
    summary = {"config": dataclasses.asdict(config), "k": k, "gate_params": n_gate, "objective": config.objective,
               "objective_before": obj_before, "objective_after": obj_after, "before": before, "after": after,
               "losses": losses, "steps": len(losses), "seconds": seconds, "gates": None, "histogram": None,
               "base_model": _base_name(peft_model), "adapter": getattr(peft_model, "scale_adapter_path", None),
               "parallel": parallel, "world_size": W}
    if out is not None and main:
        layers = gated_layers(peft_model)
        import contextlib

        with contextlib.ExitStack() as stack:
            for name, m in layers.items():
                stack.enter_context(full_parameters(m, full[name]))
            summary["gates"] = str(save_gates(peft_model, out / "gates.safetensors"))
        if lambdas is not None and lambdas.numel():
            summary["histogram"] = str(lambda_histogram(lambdas, out / "lambda_hist.png", L=config.L, U=config.U))
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if out is not None:
        dist.barrier(group=group)
    return summary


def _weighted_objective(acc: float, pairs, group) -> float:
    """Sum over ranks of the position-weighted objective shares, divided by all response positions."""
    (tot,) = all_reduce_sum([acc], group=group)
    return tot / max(sum(len(r) for _, r in pairs), 1)
