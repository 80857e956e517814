"""Step checkpoints of the data-parallel WEFT GRPO trainer: a run stopped after k steps and resumed, on another
world size and data-parallel mode (2 FSDP2 ranks -> 1 DDP rank, 1 DDP rank -> 2 FSDP2 ranks), ends with the
uninterrupted run's policy, records and evaluations; the checkpoint is written once (rank 0) and one of
another config is not used."""
import importlib.util
from pathlib import Path

import anyio
import pytest
import torch

from treadle.weft.rl.parallel import train_policy_dp
from treadle.distributed.weft_resume import StepCheckpoint
from treadle.weft.rl.train import WeftTrainConfig

# 2 episodes per step (one per rank at 2 ranks), 2 steps; stopped after step 1 of 2
CFG = dict(steps=2, turns_per_step=4, G=4, eval_episodes=1, eval_samples=2, max_new_tokens=8, max_steps=2, lr=1e-2)
STOP = 1


def _helpers():
    """The float64 tiny policy and the mixed gold/sampled row-keyed sampler of test_weft_distributed.py."""
    path = Path(__file__).with_name("test_weft_distributed.py")
    spec = importlib.util.spec_from_file_location("_weft_dp_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Stopped(Exception):
    pass


class _StopAfter(StepCheckpoint):
    """Writes its checkpoints, then stops the run (an exception on every rank) once step ``stop`` is saved:
    an interrupted run."""

    def __init__(self, *args, stop: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop = stop

    def step_done(self, step, model, opt, records, evals):
        super().step_done(step, model, opt, records, evals)
        if step + 1 == self.stop:
            raise _Stopped


def _worker(folder: str, stop, parallel: str = "ddp"):
    torch.set_num_threads(1)
    h = _helpers()
    cfg = WeftTrainConfig.quick(**CFG)
    out = {}
    if stop is None:  # the resuming run first offers the checkpoint to a run of another config: not used
        model, tok = h._policy()
        other = StepCheckpoint(folder, 1, config={**cfg.as_dict(), "lr": 0.5}, steps=cfg.steps, policy_sha256="p0")
        out["other"] = (other.resume(model, torch.optim.AdamW(model.parameters()), [], {}), other.skipped)
    model, tok = h._policy()
    kw = dict(config=cfg.as_dict(), steps=cfg.steps, policy_sha256="p0")
    ckpt = _StopAfter(folder, 1, stop=stop, **kw) if stop else StepCheckpoint(folder, 1, **kw)
    stopped = False
    try:
        s = anyio.run(lambda: train_policy_dp(model, tok, cfg, parallel=parallel, progress=False,
                                              sampler_factory=h._mixed, checkpoint=ckpt))
    except* _Stopped:  # raised inside the runtime's task group
        stopped = True
    if stopped:
        return {"stopped": True}
    out.update(h._summary(s, model))
    out["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in model.named_parameters()}  # FSDP2: DTensor shards
    out["resumed_from"] = ckpt.resumed_from
    return out


def _run(run_ranks_dir: Path, name: str, world: int, folder: Path, stop, parallel: str = "ddp"):
    from treadle.testing_ranks import spawn_gloo

    d = run_ranks_dir / name
    d.mkdir()
    return spawn_gloo(_worker, world, d, str(folder), stop, parallel)


# (world, mode) stopped -> (world, mode) resumed
CHANGES = {"2to1": ((2, "fsdp2"), (1, "ddp")), "1to2": ((1, "ddp"), (2, "fsdp2"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("weft_resume")
    out = {"ref": _run(base, "ref", 1, base / "ck_ref", None)}  # uninterrupted (fresh folder: no checkpoint)
    for change, ((wa, pa), (wb, pb)) in CHANGES.items():
        folder = base / f"ck_{change}"
        stopped = _run(base, f"stop_{change}", wa, folder, STOP, pa)
        assert all(r == {"stopped": True} for r in stopped)
        out[f"saved_{change}"] = torch.load(folder / StepCheckpoint.FILE, weights_only=False)
        out[change] = _run(base, f"resume_{change}", wb, folder, None, pb)
        out[f"files_{change}"] = sorted(p.name for p in folder.iterdir())
    return out


@pytest.mark.slow  # 5 gloo jobs of 1-2 ranks: ~100-150 s on 2 busy cores
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_resumed_run_equals_uninterrupted_run(runs, change):
    (ref,) = runs["ref"]
    assert ref["resumed_from"] is None
    saved = runs[f"saved_{change}"]
    assert saved["next_step"] == STOP and len(saved["records"]) == STOP
    assert {n: tuple(t.shape) for n, t in saved["model"].items() if n in ref["params"]} == {
        n: tuple(p.shape) for n, p in ref["params"].items()}  # full tensors, also from FSDP2 shards
    # the resumed step really trains: the checkpoint's policy is not yet the final one
    moved = max(float((saved["model"][n] - p).abs().max()) for n, p in ref["params"].items())
    assert moved > 1e-3
    assert all(r["rows_updated"] > 0 for r in ref["records"])
    for r in runs[change]:  # every rank of the resumed run
        assert r["resumed_from"] == STOP
        _helpers().assert_same_training(r, ref, change)
    assert runs[f"files_{change}"] == [StepCheckpoint.FILE]  # written once, renamed into place (no .tmp left)


@pytest.mark.slow
def test_checkpoint_of_another_config_is_not_used(runs):
    for r in runs["2to1"] + runs["1to2"]:
        first, why = r["other"]
        assert first == 0 and "another config" in why and "lr" in why


def test_checkpoint_every_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="every"):
        StepCheckpoint(tmp_path, 0, config={}, steps=2)


def _one_process(folder: Path, stop, log=None, sampler: str = "mixed"):
    """One process: train_policy with the one-process step checkpoints; ``sampler`` "mixed" (gold / sampled
    rows: groups with reward signal, so every step trains) or "hf" (the CLI's default HFSampler)."""
    from treadle.distributed.weft_resume import one_process_checkpoint
    from treadle.weft.rl.train import train_policy

    h = _helpers()
    cfg = WeftTrainConfig.quick(**CFG)
    model, tok = h._policy()
    ckpt = one_process_checkpoint(folder, 1, cfg, "p0", log)
    if stop:
        ckpt = _StopAfter(ckpt.folder, 1, stop=stop, config=ckpt.config, steps=cfg.steps, policy_sha256="p0", log=log)
    stopped = False
    try:
        s = anyio.run(lambda: train_policy(model, tok, cfg, progress=False, log=log, checkpoint=ckpt,
                                           sampler_factory=h._mixed if sampler == "mixed" else None,
                                           shared_prefix=False))  # the ranks' update: bit for bit
    except* _Stopped:  # raised inside the runtime's task group
        stopped = True
    if stopped:
        return None
    return {**h._summary(s, model), "resumed_from": ckpt.resumed_from}


@pytest.mark.parametrize("sampler", ["mixed", "hf"])
def test_one_process_stopped_and_resumed_equals_uninterrupted(tmp_path, sampler):
    """``treadle weft train`` in one process: a run stopped after step 1 of 2 continues from its checkpoint with
    the uninterrupted run's policy, records, evaluations and step log; the checkpoint records the sampler, so
    a data-parallel (row-keyed) run does not continue it."""
    import io
    import json

    torch.set_num_threads(1)
    h = _helpers()
    ref = _one_process(tmp_path / "ref", None, sampler=sampler)
    assert ref["resumed_from"] is None
    assert _one_process(tmp_path / "cut", STOP, sampler=sampler) is None
    saved = torch.load(tmp_path / "cut" / "checkpoint" / StepCheckpoint.FILE, weights_only=False)
    assert saved["next_step"] == STOP and saved["config"]["sampler"] == "hf"
    moved = max(float((saved["model"][n] - p).abs().max()) for n, p in ref["params"].items())
    if sampler == "mixed":  # the resumed step really trains (the untrained policy's own samples all fail)
        assert moved > 1e-3 and all(r["rows_updated"] > 0 for r in ref["records"])
    log = io.StringIO()
    got = _one_process(tmp_path / "cut", None, log, sampler=sampler)
    assert got["resumed_from"] == STOP
    h.assert_same_training(got, ref, "one process")
    assert [json.loads(x)["step"] for x in log.getvalue().splitlines()] == [0, 1]  # the earlier record first
    dp = StepCheckpoint(tmp_path / "cut" / "checkpoint", 1, config={**WeftTrainConfig.quick(**CFG).as_dict(),
                                                                    "sampler": "row-keyed"}, steps=2,
                        policy_sha256="p0")
    model, _ = h._policy()
    assert dp.resume(model, torch.optim.AdamW(model.parameters()), [], {}) == 0 and "sampler" in dp.skipped
