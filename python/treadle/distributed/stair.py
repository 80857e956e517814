"""STAIR training on torch.distributed (DDP or FSDP2; issue 18): :func:`train_stair`, reached through
``treadle.stair.training.train(..., parallel="ddp" | "fsdp2")`` or ``torchrun -m treadle stair train
--parallel ...``.

Every step draws the same global batch of sessions as the single-process trainer (same seeded
permutation); rank r trains on its contiguous part (:func:`treadle.distributed.parallel.share`). Each
turn's loss is ``(sum of CE + lambda_kl * KL over this rank's labelled tokens) / (labelled tokens of
the whole global batch, all-reduced) * world``; DDP/FSDP average the gradients over ranks, so the
normals' gradient, and the logged loss (summed over ranks), are those of one process holding the whole
batch (STAIR sec. 4.4 loss, token mean per turn, mean over turns 2..n).

Only the controller's normals train. Under DDP every rank holds the frozen backbone; under FSDP2 the
backbone's weights (and the normals) are sharded with ``fully_shard`` per decoder layer plus the root,
and stay sharded after the run (the model is not restored to plain tensors: end the process, or reload
the model). Self-generated responses are produced once, by rank 0 before any sharding, and broadcast.
Checkpoints are the single-process files (``normals.safetensors``, ``optim.pt``), written once by rank 0
with full tensors, and resume on any world size (or in one process).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from treadle.distributed.parallel import (all_reduce_sum, broadcast_object, check_data_parallel, decoder_layers,
                                          full_optimizer_state, full_parameters, full_tensor, load_optimizer_state,
                                          no_sync, share, wrap)
from treadle.distributed.process_group import is_main, world_size

__all__ = ["train_stair"]


class _StairStep(nn.Module):
    """The module DDP / FSDP2 wrap: the controller (trainable) and the backbone (frozen) as submodules;
    its forward runs one teacher-forced turn of a session (:meth:`StairSession.forward`)."""

    def __init__(self, ctrl, model):
        super().__init__()
        self.ctrl = ctrl
        self.model = model

    def forward(self, sess, prompts, answers, grad: bool):
        return sess.forward(prompts, answers, grad=grad, native_too=True)


def _turns(wrapped, ctrl, model, tokenizer, sessions, responses, *, real: bool, lambda_kl: float, amp: bool,
           scale: float, backward: bool, sync: bool, group) -> list[float]:
    """One micro-batch (this rank's sessions) of turns 2..n with global per-turn token denominators.
    Returns this rank's ``[loss, ce, kl, tokens]`` shares (summed over ranks: the global values)."""
    from treadle.stair.session import StairSession
    from treadle.stair.training import stair_loss

    W = world_size(group)
    B, n = len(sessions), len(sessions[0].problems)
    sess = StairSession(model, tokenizer, ctrl, batch_size=B)
    with torch.no_grad():
        wrapped(sess, [s.problems[0].prompt for s in sessions], [r[0] for r in responses], False)  # bank
    device = next(model.parameters()).device
    use_amp = amp and device.type == "cuda"
    tot = [0.0, 0.0, 0.0, 0.0]
    for t in range(1, n):
        last = t == n - 1
        with no_sync(wrapped, backward and not (sync and last)), torch.set_grad_enabled(backward):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                out = wrapped(sess, [s.problems[t].prompt for s in sessions], [r[t] for r in responses], backward)
            mine = int((out["labels"] != -100).sum()) if real else 0
            (tokens,) = all_reduce_sum([mine], group=group)
            loss, parts = stair_loss(out["logits"], out["native_logits"], out["labels"], lambda_kl,
                                     tokens=max(tokens, 1.0))
            if not real:  # a rank with no session of this batch ran session 0 with weight 0
                loss, parts = loss * 0.0, {"ce": 0.0, "kl": 0.0, "tokens": 0}
            if backward:
                (loss * (W * scale / (n - 1))).backward()
        tot[0] += float(loss.detach()) / (n - 1)
        tot[1] += parts["ce"] / (n - 1)
        tot[2] += parts["kl"] / (n - 1)
        tot[3] += parts["tokens"]
    return tot


def train_stair(model, tokenizer, config, run_dir, *, parallel: str, group=None, resume: bool = True,
                progress: bool = True, console=None, backend: str | None = None, report_to=None) -> dict:
    """Data-parallel :func:`treadle.stair.training.train` (same arguments, files and result keys).

    Args:
        parallel: ``"ddp"`` or ``"fsdp2"``; group: process group (None: default).
        report_to: must be None / ``"none"`` here (metric sinks are a single-process feature for now).

    Raises:
        NotDistributedError: torch.distributed is not initialised (run under torchrun).
        ValueError: unknown ``parallel``; ``batch_size`` smaller than the world size; FSDP2 on a model
            with recurrent (linear-attention) layers, whose STAIR session runs a data-dependent number
            of forwards per turn (the ranks' FSDP all-gathers would not line up: use DDP); a checkpoint
            of another config; a ``report_to`` sink. All before any change to ``run_dir``.
    """
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal

    from treadle.stair.session import has_recurrent_layers
    from treadle.stair.training import _truncate_log, freeze_and_attach, make_training_sessions, self_responses

    W = check_data_parallel(parallel, "STAIR training", batch_size=config.batch_size, report_to=report_to,
                            group=group)
    main = is_main(group)
    if parallel == "fsdp2" and has_recurrent_layers(model):
        raise ValueError("parallel='fsdp2' needs a model with softmax attention only: STAIR sessions on recurrent "
                         "(linear-attention) layers run one forward per distinct segment length, which differs "
                         "between ranks; use parallel='ddp'")
    run_dir = Path(run_dir)
    ctrl, flags, cfg_json = freeze_and_attach(model, config, backend)
    keys = ("layers", "kind", "eps", "seed", "turns")
    try:
        ckpt, optf = run_dir / "normals.safetensors", run_dir / "optim.pt"
        start, state = 0, None
        if resume and ckpt.exists() and optf.exists():
            old = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
            if {k: old.get(k) for k in keys} != {k: cfg_json[k] for k in keys}:
                raise ValueError(f"{run_dir} holds a run with another config ({old}); use another run_dir or "
                                 f"resume=False")
            ctrl.load(ckpt)  # before sharding: every rank reads the full file
            state = torch.load(optf, weights_only=True)
            start = int(state["step"])
        dist.barrier(group=group)  # every rank has read the checkpoint before rank 0 touches the folder
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            _truncate_log(run_dir / "log.jsonl", start)
            (run_dir / "config.json").write_text(json.dumps({**cfg_json, "parallel": parallel, "world_size": W},
                                                            indent=1))
            if console is not None:
                console.print(f"STAIR {config.kind} ({parallel}, {W} ranks): trainable parameters = "
                              f"{ctrl.num_trainable}" + (f" (resuming at step {start})" if start else ""))
        pool = make_training_sessions(config.sessions, config.turns, config.levels, seed=config.seed)
        if config.responses == "self":  # once, before sharding, then the same on every rank
            responses = None
            if main:
                ctrl.enabled = False
                responses = self_responses(model, tokenizer, pool, max_new_tokens=config.max_new_tokens)
                ctrl.enabled = True
            responses = broadcast_object(responses, group=group)
        else:
            responses = [[p.answer for p in s.problems] for s in pool]
        step_module = _StairStep(ctrl, model)
        blocks = decoder_layers(model) if parallel == "fsdp2" else []
        wrapped = wrap(step_module, parallel, blocks=blocks, group=group)
        opt = torch.optim.AdamW(ctrl.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.99))
        if state is not None:
            load_optimizer_state(opt, state["optim"])

        def micro(idx, *, scale=1.0, backward=True, sync=True):
            rows, real = share(len(idx), group=group)
            mine = idx[rows]
            return _turns(wrapped, ctrl, model, tokenizer, [pool[i] for i in mine], [responses[i] for i in mine],
                          real=real, lambda_kl=config.lambda_kl, amp=config.amp, scale=scale, backward=backward,
                          sync=sync, group=group)

        def probe_loss() -> float:
            return all_reduce_sum(micro(list(range(min(config.batch_size, len(pool)))), backward=False),
                                  group=group)[0]

        probe_start = probe_loss()
        first = last = None
        t0 = time.perf_counter()
        bar = tqdm(range(start, config.steps), desc=f"stair-train[{config.kind}, {parallel}]",
                   disable=not (progress_enabled(progress) and main), dynamic_ncols=True, initial=start,
                   total=config.steps)
        log = open(run_dir / "log.jsonl", "a") if main else None
        try:
            for step in bar:
                g = torch.Generator().manual_seed(config.seed * 100_003 + step)
                opt.zero_grad(set_to_none=True)
                shares = [0.0, 0.0, 0.0, 0.0]
                for a in range(config.grad_accum):
                    idx = torch.randperm(len(pool), generator=g)[:config.batch_size].tolist()
                    part = micro(idx, scale=1.0 / config.grad_accum, sync=a == config.grad_accum - 1)
                    shares = [s + v / (config.grad_accum if j < 3 else 1) for j, (s, v) in enumerate(zip(shares, part))]
                loss, ce, kl, tokens = all_reduce_sum(shares, group=group)
                gnorm = float(full_tensor(torch.nn.utils.clip_grad_norm_(ctrl.parameters(), 1e9)))
                opt.step()
                first = loss if first is None else first
                last = loss
                if main:
                    rec = {"step": step + 1, "loss": round(loss, 6), "ce": round(ce, 6), "kl": round(kl, 6),
                           "tokens": int(tokens), "grad_norm": round(gnorm, 6),
                           "seconds": round(time.perf_counter() - t0, 3)}
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{loss:.4f}", ce=f"{ce:.4f}", kl=f"{kl:.5f}")
                if (step + 1) % config.save_every == 0 or step + 1 == config.steps:
                    full = {n: full_tensor(p) for n, p in ctrl.named_parameters()}  # collectives: every rank
                    osd = full_optimizer_state(opt)
                    if main:
                        with full_parameters(ctrl, full):
                            ctrl.save(ckpt, extra={"step": step + 1})
                        torch.save({"optim": osd, "step": step + 1}, optf)
                    dist.barrier(group=group)
        finally:
            bar.close()
            if log is not None:
                log.close()
        probe_end = probe_loss()
        if main:
            with open(run_dir / "log.jsonl", "a") as f:
                f.write(json.dumps({"probe": True, "sessions": min(config.batch_size, len(pool)),
                                    "loss_before_run": probe_start, "loss_after_run": probe_end}) + "\n")
        return {"path": ckpt, "trainable": ctrl.num_trainable, "first_loss": first, "last_loss": last,
                "probe_loss_before": probe_start, "probe_loss_after": probe_end, "layers": ctrl.layers,
                "steps": config.steps, "start_step": start, "seconds": time.perf_counter() - t0,
                "parallel": parallel, "world_size": W,
                "normals": {n: full_tensor(p) for n, p in ctrl.named_parameters()}}
    finally:
        ctrl.detach()
        for p, f in flags:
            p.requires_grad_(f)
