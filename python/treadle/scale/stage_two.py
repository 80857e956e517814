"""The SCALE Stage-II run (SCALE sec. 4.3) shared by one process (:func:`treadle.scale.training.train`)
and torch.distributed (:func:`treadle.distributed.scale.train_scale`): checks, data, gates, run folder,
checkpoints and resume (:mod:`treadle.scale.checkpoint`), the step loop, evaluation records and the
summary. What differs between the two is a :class:`Replicas` object: who samples, how one global batch's
loss is computed, the objective over the training responses, the held-out evaluation, collectives.

The global batches are the same everywhere: the ``seed + 1`` generator draws one permutation of the
training responses per epoch and the batches are its consecutive ``batch_size`` chunks; a run resumed at
step ``s`` replays the permutations of the epochs before ``s``'s and skips the chunks already trained.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

__all__ = ["Replicas", "run", "global_batches", "gate_parameters"]


def gate_parameters(peft_model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every gate, in module order (weight, bias): the optimizer's order, the
    same in one process and on any number of ranks (so that its state loads anywhere)."""
    from treadle.scale.gates import gated_layers

    return [(f"{name}.{p}", getattr(m, p)) for name, m in gated_layers(peft_model).items()
            for p in ("scale_gate_weight", "scale_gate_bias")]


def global_batches(pairs: list, batch_size: int, generator: torch.Generator | None, *, epochs: int = 1,
                   start: int = 0):
    """Yield ``(step, epoch, chunk)``: the global batches (lists of pairs) of ``epochs`` passes, from step
    ``start`` on (the permutations of earlier epochs are drawn and dropped, so the order is the same as an
    uninterrupted run's). ``generator`` None: one pass in order, no shuffle."""
    per_epoch = math.ceil(len(pairs) / batch_size)
    step = 0
    for epoch in range(epochs):
        order = (torch.randperm(len(pairs), generator=generator).tolist() if generator is not None
                 else list(range(len(pairs))))
        if step + per_epoch <= start:
            step += per_epoch
            continue
        for i in range(0, len(order), batch_size):
            if step >= start:
                yield step, epoch, [pairs[j] for j in order[i:i + batch_size]]
            step += 1


class Replicas:
    """One process (the base for the data-parallel :class:`treadle.distributed.scale.DataParallel`).

    Attributes: ``main`` (this process writes files and prints), ``world`` (processes), ``parallel``
    (None here; ``"ddp"`` / ``"fsdp2"``), ``model`` (the PEFT model being trained; set by :meth:`wrap`).
    """

    main, world, parallel = True, 1, None

    def check(self, config) -> None:
        """Refuse settings this kind of run cannot take (before any change)."""

    def sample(self, make):
        """Sampled training responses: ``make()`` here; rank 0's, broadcast, on ranks."""
        return make()

    def broadcast(self, obj):
        return obj

    def all_sum(self, values: list[float]) -> list[float]:
        return list(values)

    def barrier(self) -> None:
        pass

    def before(self, measure):
        """The evaluation before training, ``measure()`` on the whole unwrapped model (on ranks: rank 0's,
        broadcast)."""
        return measure()

    def wrap(self, peft_model: nn.Module, k: int, objective: str) -> None:
        """Get ready to train (data parallelism wraps the model here)."""
        self.model, self.k, self.objective = peft_model, k, objective

    def batch_loss(self, chunk: list, pad_id: int, device) -> tuple[torch.Tensor, float]:
        """``(loss to backward, this process's share of the batch's loss)``: the objective of one global
        batch (:func:`treadle.scale.training.gate_objective`)."""
        from treadle.scale.batches import collate
        from treadle.scale.training import gate_objective

        loss = gate_objective(self.model, collate(chunk, pad_id).to(device), k=self.k, objective=self.objective)
        return loss, loss.item()

    def objective_over(self, pairs: list, pad_id: int, batch_size: int) -> float:
        """The objective over ``pairs`` (response-position weighted mean), gates as they are."""
        from treadle.scale.training import _objective_over

        return _objective_over(self.model, pairs, pad_id, k=self.k, objective=self.objective, batch_size=batch_size)

    def evaluate(self, tokenizer, heldout: dict, *, max_new_tokens: int, keep_lambdas: bool) -> dict:
        """The held-out evaluation (:func:`treadle.scale.training.evaluate`) of the trained model."""
        from treadle.scale.training import evaluate

        return evaluate(self.model, tokenizer, heldout, k=self.k, max_new_tokens=max_new_tokens,
                        keep_lambdas=keep_lambdas)


def _prepared_pairs(peft_model, tokenizer, config, replicas: Replicas) -> list:
    from treadle.data.arithmetic import ProblemGenerator
    from treadle.scale.batches import collate, problem_pairs, sampled_pairs

    torch.manual_seed(config.seed)
    problems = ProblemGenerator(config.seed).mixture(config.train_size, {lv: 1.0 for lv in config.levels},
                                                     split="train")
    if config.responses == "sampled":  # from the Stage-I model (no gates yet: exactly lambda = 1)
        pairs = replicas.sample(lambda: sampled_pairs(peft_model, tokenizer, problems,
                                                      max_new_tokens=config.max_new_tokens,
                                                      temperature=config.temperature, seed=config.seed))
    else:
        pairs = problem_pairs(tokenizer, problems)
    collate(pairs, tokenizer.pad_token_id)  # every example has a response position (ValueError otherwise)
    return pairs


def run(peft_model: nn.Module, tokenizer, config, out_dir, replicas: Replicas, *, console=None,
        progress: bool = False, evaluate_model: bool = True, evaluate_before: bool = True, report_to=None,
        resume: bool = True, save_every: int | None = 10) -> dict:
    """Stage II with ``replicas`` (arguments, files and summary: :func:`treadle.scale.training.train`)."""
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal

    from treadle.distributed.parallel import full_optimizer_state, full_tensor, load_optimizer_state
    from treadle.reporting import Reporter, resolve_report_to
    from treadle.run_dirs import check_out_dir, make_out_dir
    from treadle.scale.batches import _check_tokenizer
    from treadle.scale.checkpoint import (CHECKPOINT, checkpoint_config, read_checkpoint, truncate_log,
                                          write_checkpoint)
    from treadle.scale.gates import _active_adapter, _lora_layers, attach_gates, gated_layers, load_gates, save_gates
    from treadle.scale.training import (ScaleTrainConfig, _base_name, _heldout, _objective_over, _vocab,
                                        clamp_lambda, evaluate, lambda_histogram)

    config = config or ScaleTrainConfig()
    if not isinstance(config, ScaleTrainConfig):
        raise TypeError(f"config must be a ScaleTrainConfig, got {type(config).__name__}")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise ValueError(f"save_every must be an int >= 1 (steps between checkpoints) or None, got {save_every!r}")
    resolve_report_to(report_to)
    replicas.check(config)
    _check_tokenizer(tokenizer)
    # everything attach_gates would refuse, checked before the (possibly slow) data preparation
    _lora_layers(peft_model, _active_adapter(peft_model), disable_dropout=True, expect_gated=False)
    if out_dir is not None:
        check_out_dir(out_dir)
    vocab = _vocab(peft_model)
    if vocab < 2:
        raise ValueError(f"the model's vocabulary has {vocab} entries; the top-k entropy needs >= 2")
    k = min(config.k, vocab)
    main, W = replicas.main, replicas.world
    say = console.print if (console is not None and main) else (lambda *a, **kw: None)
    if k != config.k:
        say(f"[yellow]k = {config.k} exceeds the vocabulary ({vocab}); using k = {k} (normaliser log {k})[/yellow]")
    ckpt_cfg = checkpoint_config(config, k, _base_name(peft_model))
    state = read_checkpoint(out_dir, ckpt_cfg) if (resume and out_dir is not None) else None

    pairs = _prepared_pairs(peft_model, tokenizer, config, replicas)
    per_epoch = math.ceil(len(pairs) / config.batch_size)
    steps = config.epochs * per_epoch
    start = int(state["step"]) if state is not None else 0
    if start > steps:
        raise ValueError(f"{out_dir} holds a Stage-II checkpoint at step {start}, past this run's {steps} steps "
                         f"({config.epochs} epochs of {per_epoch}); give at least "
                         f"{math.ceil(start / per_epoch)} epochs to resume it, or another out_dir")
    out = None
    if out_dir is not None:
        out = make_out_dir(out_dir) if main else Path(out_dir)  # before the model gets gates

    attach_gates(peft_model, config.L, config.U, config.tau, disable_dropout=True)
    lo, hi = config.lambda_bounds
    if lo is not None or hi is not None:
        clamp_lambda(peft_model, lo, hi)
    if state is not None:  # before any sharding: every process reads the full file
        load_gates(peft_model, Path(out_dir) / CHECKPOINT / "gates.safetensors")
    peft_model.eval()  # no dropout anywhere: Stage II changes only the gates
    n_gate = sum(p.numel() for _, p in gate_parameters(peft_model))
    pad = tokenizer.pad_token_id
    dist_keys = {"parallel": replicas.parallel, "world_size": W} if replicas.parallel is not None else {}

    log = None
    if out is not None and main:
        cfg_json = {**dataclasses.asdict(config), "k_used": k, "lambda_bounds": list(config.lambda_bounds),
                    **dist_keys}
        (out / "config.json").write_text(json.dumps(cfg_json, indent=1))
        if state is not None:
            truncate_log(out / "log.jsonl", start)
        log = open(out / "log.jsonl", "a" if state is not None else "w")

    def write(rec):
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    heldout = _heldout(config) if evaluate_model else None
    reporter = Reporter(report_to, out, config=dataclasses.asdict(config), name="scale-stage2")
    try:
        if state is None:
            write({"type": "config", **dataclasses.asdict(config), "k_used": k, "gate_params": n_gate, **dist_keys})
            obj_before, before = replicas.before(lambda: (  # the Stage-I model (zero gates), whole, unwrapped
                _objective_over(peft_model, pairs, pad, k=k, objective=config.objective,
                                batch_size=max(config.batch_size, 64)),
                evaluate(peft_model, tokenizer, heldout, k=k, max_new_tokens=config.max_new_tokens)
                if evaluate_model and evaluate_before else None))
            write({"type": "eval", "when": "before", "objective": obj_before, **(before or {})})
            losses = []
        else:
            obj_before, before, losses = state["objective_before"], state["before"], list(state["losses"][:start])
            write({"type": "resume", "at_step": start, "of_steps": steps, "world_size": W})
            say(f"resuming Stage II at step {start} of {steps} from {Path(out_dir) / CHECKPOINT}")
        replicas.wrap(peft_model, k, config.objective)
        named = gate_parameters(peft_model)  # after wrap: FSDP2's sharded parameters
        opt = torch.optim.Adam([p for _, p in named], lr=config.lr)
        if state is not None:
            if state["param_names"] != [n for n, _ in named]:
                raise ValueError(f"the checkpoint's gates ({len(state['param_names'])} parameters) are not this "
                                 f"model's ({len(named)}): another adapter layout")
            load_optimizer_state(opt, state["optim"])
        shuffle = torch.Generator().manual_seed(config.seed + 1)
        device = next(peft_model.parameters()).device
        bar = tqdm(total=steps, initial=start, disable=not (progress_enabled(progress) and main),
                   desc="scale stage II" + (f" ({replicas.parallel})" if replicas.parallel else ""))
        t0 = time.perf_counter()
        step = start
        for step, epoch, chunk in global_batches(pairs, config.batch_size, shuffle, epochs=config.epochs,
                                                 start=start):
            loss, mine = replicas.batch_loss(chunk, pad, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            (total,) = replicas.all_sum([mine])
            losses.append(total)
            write({"type": "step", "step": step, "epoch": epoch, "loss": total})
            reporter.log({"train/loss": total, "train/epoch": epoch}, step)
            bar.update(1)
            done = step + 1
            if out is not None and save_every is not None and (done % save_every == 0 or done == steps):
                full = {name: {n: full_tensor(p) for n, p in m._parameters.items() if n.startswith("scale_gate")}
                        for name, m in gated_layers(peft_model).items()}  # collectives: every process
                osd = full_optimizer_state(opt)
                if main:
                    write_checkpoint(out, peft_model, full, {
                        "step": done, "optim": osd, "param_names": [n for n, _ in named], "losses": losses,
                        "objective_before": obj_before, "before": before, "config": ckpt_cfg, "world_size": W})
                replicas.barrier()
            step = done
        bar.close()
        seconds = time.perf_counter() - t0
        obj_after = replicas.objective_over(pairs, pad, max(config.batch_size, 64))
        after = (replicas.evaluate(tokenizer, heldout, max_new_tokens=config.max_new_tokens, keep_lambdas=True)
                 if evaluate_model else None)
        lambdas = after.pop("lambdas") if after else None
        write({"type": "eval", "when": "after", "objective": obj_after, **(after or {})})
        reporter.log({"eval/objective": obj_after, **{f"eval/{k_}": v for k_, v in (after or {}).items()}}, step)
        full = {name: {n: full_tensor(p) for n, p in m._parameters.items() if n.startswith("scale_gate")}
                for name, m in gated_layers(peft_model).items()}  # collectives: every process
    finally:
        reporter.close()
        if log is not None:
            log.close()
    summary = {"config": dataclasses.asdict(config), "k": k, "gate_params": n_gate, "objective": config.objective,
               "objective_before": obj_before, "objective_after": obj_after, "before": before, "after": after,
               "losses": losses, "steps": len(losses), "seconds": seconds, "gates": None, "histogram": None,
               "base_model": _base_name(peft_model), "adapter": getattr(peft_model, "scale_adapter_path", None),
               "start_step": start, **dist_keys}
    if out is not None and main:
        import contextlib

        from treadle.distributed.parallel import full_parameters

        with contextlib.ExitStack() as stack:
            for name, m in gated_layers(peft_model).items():
                stack.enter_context(full_parameters(m, full[name]))
            summary["gates"] = str(save_gates(peft_model, out / "gates.safetensors"))
        if lambdas is not None and lambdas.numel():
            summary["histogram"] = str(lambda_histogram(
                lambdas, out / "lambda_hist.png", L=config.L, U=config.U,
                title=f"lambda on generated held-out tokens (L={config.L:g}, U={config.U:g}"
                      + "".join(f", {a}" for a, on in (("no reverse", config.no_reverse),
                                                       ("no extrapolate", config.no_extrapolate)) if on) + ")"))
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if out is not None:
        replicas.barrier()
    return summary
