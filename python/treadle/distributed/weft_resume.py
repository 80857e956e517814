"""Step checkpoints of a WEFT GRPO run (one process or data-parallel), and resuming from them on any world
size.

:class:`StepCheckpoint` is the pair of hooks (``resume`` before the first step, ``step_done`` after each) that
:func:`treadle.weft.rl.train.train_policy` calls: through :class:`treadle.weft.rl.parallel.WeftDataParallel`
(``dp=``) in a data-parallel run, directly (``checkpoint=``) in one process:

* **Written once.** Every ``every`` steps (and after the last) rank 0 writes ``<folder>/state.pt``:
  the next step, the policy's full ``state_dict`` and the AdamW state (DDP keeps both whole on every
  rank; under FSDP2 every rank first gathers the shards into full tensors), in the one-process format,
  the step records and held-out evaluations so far, the config and the start policy's fingerprint. The
  file is written beside and renamed into place (a run killed while writing keeps the previous
  checkpoint); the ranks then meet at a barrier.
* **Resumed on any world size.** Rank 0 reads the file and broadcasts it (the other ranks need no
  shared file system); every rank loads the same weights and optimizer state and continues at the
  recorded step (FSDP2 shards them again on load). Nothing in it depends on the world size: the step's
  episodes, the row-keyed samples and the group statistics are the same on 1 or N ranks
  (:mod:`treadle.weft.rl.parallel`), so a run stopped after k steps and resumed, on 2, 1 or N ranks,
  ends with the uninterrupted run's policy (up to float summation order).
* A checkpoint of another config or another start policy is not used (the run starts over and
  replaces it at its first save), like a finished run of another config
  (:func:`treadle.weft.rl.report.run_comparison`'s reuse).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from treadle.distributed.parallel import broadcast_object, full_optimizer_state, full_tensor, load_optimizer_state
from treadle.distributed.process_group import is_main

__all__ = ["StepCheckpoint", "one_process_checkpoint", "SAMPLER_KEY"]

FORMAT = 1


def _load_weights(model, full: dict) -> None:
    """Load full tensors into ``model``: plain parameters copied, FSDP2 DTensor ones sharded like them first
    (``set_model_state_dict`` with ``full_state_dict``)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    else:
        dev = next(model.parameters()).device
        model.load_state_dict({k: v.to(dev) for k, v in full.items()})


class StepCheckpoint:
    """Step checkpoints of one run in ``folder`` (``state.pt``).

    Args:
        folder: where ``state.pt`` lives (created by rank 0 at the first save).
        every: write after every ``every``-th step (and after the last step); >= 1.
        config: the run's config as a plain dict (``WeftTrainConfig.as_dict()``): a checkpoint resumes only
            the same config.
        steps: the run's number of steps (the last one is always checkpointed).
        policy_sha256: fingerprint of the start policy (:func:`treadle.weft.rl.report.policy_fingerprint`);
            a checkpoint resumes only the same start.
        group: process group (None: default); torch.distributed may also be uninitialised (one process:
            :func:`treadle.weft.rl.train.train_policy`'s ``checkpoint=``).
        log: rank 0's open step log: a resumed run's earlier records are written to it first (None: not
            written here).

    Raises:
        ValueError: ``every`` < 1.
    """

    FILE = "state.pt"

    def __init__(self, folder: str | Path, every: int, *, config: dict, steps: int, policy_sha256: str = "",
                 group=None, log=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint every must be an int >= 1 (steps between checkpoints), got {every!r}")
        self.folder, self.every, self.config, self.steps = Path(folder), every, dict(config), steps
        self.policy_sha256, self.group, self.log = policy_sha256, group, log
        self.resumed_from: int | None = None  # the step a resume started at (None: a fresh run)
        self.skipped: str | None = None  # why a checkpoint found in folder was not used

    @property
    def path(self) -> Path:
        return self.folder / self.FILE

    # reading ----------------------------------------------------------------------------------------------
    def _read(self):
        """Rank 0: the usable checkpoint, or ``(None, why not)``."""
        if not self.path.exists():
            return None, None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as err:  # a truncated / foreign file: start over, say why
            return None, f"unreadable ({type(err).__name__}: {err})"
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            return None, "not a treadle WEFT step checkpoint"
        if state["config"] != self.config:
            diff = sorted(k for k in set(state["config"]) | set(self.config)
                          if state["config"].get(k) != self.config.get(k))
            return None, f"another config (differs in {', '.join(diff)})"
        if state["policy_sha256"] != self.policy_sha256:
            return None, "another start policy"
        return state, None

    def resume(self, model, opt, records: list, evals: dict) -> int:
        """Load the checkpoint, if any usable, into ``model`` (the unwrapped policy), ``opt``, ``records``
        and ``evals`` (in place) on every rank. A collective. Returns the step to run next (0: none)."""
        state, why = self._read() if is_main(self.group) else (None, None)
        if dist.is_initialized():
            state, why = broadcast_object((state, why), group=self.group)
        self.skipped = why
        if state is None:
            return 0
        _load_weights(model, state["model"])
        load_optimizer_state(opt, state["optimizer"])
        records[:] = state["records"]
        evals.clear()
        evals.update({int(k): v for k, v in state["evals"].items()})
        torch.set_rng_state(state["rng"])
        self.resumed_from = int(state["next_step"])
        if self.log is not None and is_main(self.group):
            for rec in records:
                self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
        return self.resumed_from

    # writing ----------------------------------------------------------------------------------------------
    def step_done(self, step: int, model, opt, records: list, evals: dict) -> None:
        """After step ``step`` (0-based): rank 0 writes the checkpoint when it is due; every rank then waits
        at a barrier (so a checkpoint of step k exists before any rank starts step k + 1). A collective."""
        if (step + 1) % self.every and step + 1 != self.steps:
            return
        # full tensors on every rank (a collective under FSDP2, where both are DTensor shards)
        weights = {k: full_tensor(v).clone() for k, v in model.state_dict().items()}
        optimizer = full_optimizer_state(opt)
        if is_main(self.group):
            self.folder.mkdir(parents=True, exist_ok=True)
            state = {"format": FORMAT, "next_step": step + 1, "config": self.config,
                     "policy_sha256": self.policy_sha256, "model": weights,
                     "optimizer": optimizer, "records": list(records),
                     "evals": {str(k): v for k, v in evals.items()}, "rng": torch.get_rng_state()}
            tmp = self.path.with_name(self.FILE + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, self.path)
        if dist.is_initialized():
            dist.barrier(group=self.group)


SAMPLER_KEY = "sampler"  # in a checkpoint's config: which sampler drew the rollouts


def one_process_checkpoint(run_folder: str | Path, every: int, cfg, policy_sha256: str, log=None) -> StepCheckpoint:
    """The step checkpoints of a one-process ``treadle weft train`` run (``run_folder/checkpoint/state.pt``),
    for :func:`treadle.weft.rl.train.train_policy`'s ``checkpoint=``: ``log`` (the open ``steps.jsonl``)
    gets a resumed run's earlier records first.

    The one-process trainer samples with :class:`~treadle.weft.rl.sampling.HFSampler` (one random stream per
    batch), the data-parallel one with the row-keyed sampler: their rollouts differ, so the checkpoint's
    config records the sampler (``"sampler": "hf"``) and a ``--parallel`` run does not continue it (nor a
    one-process run a ``--parallel`` checkpoint): each would mix two different runs."""
    return StepCheckpoint(Path(run_folder) / "checkpoint", every, config={**cfg.as_dict(), SAMPLER_KEY: "hf"},
                          steps=cfg.steps, policy_sha256=policy_sha256, log=log)
