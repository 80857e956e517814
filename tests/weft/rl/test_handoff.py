"""Hand-off of atomic-turn rows to verl (registered estimator) and TRL (adapter), and resumable group folders."""
import anyio
import pytest
import torch

from treadle.testing import require_module
from treadle.weft.rl.gold import REPLY
from treadle.weft.rl.groups import rows_of, to_trl, to_verl
from treadle.weft.rl.run import ConfigMismatchError, check_folder, folder_config, groups_to_folder, read_groups
from treadle.weft.rl.sampling import HFSampler, ReplaySampler, sample_groups


class _Mixed(ReplaySampler):
    """Per group: the first candidate replies at once (fails), the second repeats its first call
    (flagged), the rest replay the gold."""

    def __init__(self, tok, harness):
        super().__init__(tok, harness)
        self.kind = {}

    def generate(self, rows, seed):
        out = []
        for ts, step, ctx in rows:
            k = self.kind.setdefault(id(ctx), len(self.kind) % 4)
            gold = ts.atomic.checkpoint.gold_calls
            plan = [] if k == 0 else ([gold[0], *gold] if k == 1 else list(gold))
            text = self.harness.render([plan[step]]).text if step < len(plan) else REPLY
            out.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id])
        return out


@pytest.fixture
def mixed_groups(in_shop, tok, harness):
    async def fn(rt, h, golds):
        starts = [s for g in golds for s in g.starts]
        return await sample_groups(rt, h, starts, 4, _Mixed(tok, harness), tok, harness, seed=0, max_steps=5)
    return in_shop(fn, n=3)


def test_verl_registered_estimator_gives_the_rows_advantages(mixed_groups, tok):
    core = require_module("verl.trainer.ppo.core_algos")
    import treadle.grpo.verl_adapter  # noqa: F401  (registers treadle_grpo)

    rows = rows_of(mixed_groups, estimator="grpo")
    assert any(r.advantage > 0 for r in rows) and any(r.advantage < 0 for r in rows)
    batch = to_verl(rows, tok.pad_token_id)
    fn = core.get_adv_estimator_fn("treadle_grpo")
    adv, _ = fn(token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
                index=batch["index"], flags=batch["flags"], valid=batch["valid"])
    want = torch.tensor([r.advantage for r in rows]).unsqueeze(1) * batch["response_mask"]
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)
    # flagged rows never positive; tool-output tokens (mask 0) get 0
    flagged = batch["flags"]
    assert flagged.any() and (adv[flagged] <= 0).all()
    assert (adv[batch["response_mask"] == 0] == 0).all()
    assert batch["prompts"].shape[0] == len(rows) and batch["responses"].shape == batch["response_mask"].shape


def _verl_trainer_kwargs(batch):
    """Exactly what verl's trainer (ray_trainer.compute_advantage) passes a registered estimator: no flags,
    no valid (those travel in the uids)."""
    return {"token_level_rewards": batch["token_level_rewards"], "response_mask": batch["response_mask"],
            "config": None, "index": batch["index"]}


def test_verl_estimator_reads_flags_and_valid_from_the_uids(mixed_groups, tok):
    core = require_module("verl.trainer.ppo.core_algos")
    import treadle.grpo.verl_adapter  # noqa: F401

    groups = list(mixed_groups)
    # one crashed candidate (an environment failure) in the first group
    c0 = groups[0].candidates[2].model_copy(update={"env_failure": "shop: crash: boom", "r": 0})
    groups[0] = groups[0].model_copy(update={"candidates": (*groups[0].candidates[:2], c0,
                                                            *groups[0].candidates[3:])})
    rows = rows_of(groups)
    assert not rows[2].valid and rows[2].advantage == 0.0
    batch = to_verl(rows, tok.pad_token_id)
    adv, _ = core.get_adv_estimator_fn("treadle_grpo")(**_verl_trainer_kwargs(batch))
    want = torch.tensor([r.advantage for r in rows]).unsqueeze(1) * batch["response_mask"]
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)
    flagged = batch["flags"]
    assert flagged.any() and (adv[flagged] <= 0).all() and (adv[~batch["valid"]] == 0).all()
    # without the carried masks the numbers differ (the flags and the crash would count): the test can fail
    plain = dict(_verl_trainer_kwargs(batch), index=[str(u) for u in batch["index"]])
    bare, _ = core.get_adv_estimator_fn("treadle_grpo")(**plain)
    assert not torch.allclose(bare, want)
    with pytest.raises(ValueError, match="flags disagrees"):
        core.get_adv_estimator_fn("treadle_grpo")(**_verl_trainer_kwargs(batch), flags=~flagged)


def test_verl_trainer_compute_advantage_honours_flags_and_valid(mixed_groups, tok):
    """The real verl trainer path: a DataProto through ray_trainer.compute_advantage, after verl's own
    reorder, chunk and concat (what balancing and dispatch do to a batch)."""
    trainer = require_module("verl.trainer.ppo.ray_trainer")
    from verl import DataProto

    import treadle.grpo.verl_adapter  # noqa: F401

    groups = list(mixed_groups)
    c0 = groups[1].candidates[0].model_copy(update={"env_failure": "shop: timeout: slow", "r": 0})
    groups[1] = groups[1].model_copy(update={"candidates": (c0, *groups[1].candidates[1:])})
    rows = rows_of(groups)
    batch = to_verl(rows, tok.pad_token_id)
    data = DataProto.from_dict(tensors={"token_level_rewards": batch["token_level_rewards"],
                                        "response_mask": batch["response_mask"],
                                        "responses": batch["responses"]},
                               non_tensors={"uid": batch["index"]})
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    data.reorder(perm)
    data = DataProto.concat(data.chunk(2))
    out = trainer.compute_advantage(data, adv_estimator="treadle_grpo", config=None)
    want = (torch.tensor([r.advantage for r in rows]).unsqueeze(1) * batch["response_mask"])[perm]
    torch.testing.assert_close(out.batch["advantages"], want, rtol=1e-6, atol=1e-6)
    assert (out.batch["advantages"][batch["flags"][perm]] <= 0).all()
    assert (out.batch["advantages"][~batch["valid"][perm]] == 0).all() and (~batch["valid"]).sum() == 1


def test_trl_adapter_gives_the_rows_advantages(mixed_groups, tok):
    from treadle.grpo.trl_adapter import trl_advantages, trl_options

    opts = trl_options("group")
    rows = rows_of(mixed_groups, **opts)
    batch = to_trl(rows, tok.pad_token_id)
    assert batch["num_generations"] == 4
    adv = trl_advantages(batch["rewards"], batch["num_generations"], "group", flags=batch["flags"],
                         valid=batch["valid"])
    by_key = {(r.group_key, r.candidate): r.advantage for r in rows}
    order = {}
    want = []
    for k in batch["group_keys"]:
        order[k] = order.get(k, -1) + 1
        want.append(by_key[(k, order[k])])
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert (adv[batch["flags"]] <= 0).all()


def test_trl_layout_needs_one_group_size(mixed_groups, tok):
    rows = rows_of(mixed_groups)
    with pytest.raises(ValueError, match="one group size"):
        to_trl(rows[:-1], tok.pad_token_id)


def _run_folder(tmp, tok, harness, tiny_policy, *, stop_after=None, config=None):
    from treadle.weft.rl.gold import play_gold, shop_server
    from treadle.weft.rl.worlds import episodes
    from treadle.weft.runtime import Runtime

    class Stop(Exception):
        pass

    def on_chunk(i, part):
        if stop_after is not None and i >= stop_after:
            raise Stop

    async def main():
        async with Runtime() as rt:
            h = await shop_server(rt)
            golds = [await play_gold(rt, h, e, harness, verify=False) for e in episodes(3, "heldout")]
            starts = [s for g in golds for s in g.starts]
            sampler = HFSampler(tiny_policy, tok, max_new_tokens=10)
            return await groups_to_folder(rt, h, starts, 3, sampler, tok, harness, tmp, config=config or {"x": 1},
                                          seed=5, chunk=2, max_steps=2, on_chunk=on_chunk)
    stopped = []
    try:
        result = anyio.run(main)
    except* Stop:
        stopped.append(True)
    return None if stopped else result


def test_resume_after_interruption_gives_the_same_groups(tmp_path, tok, harness, tiny_policy):
    full = _run_folder(tmp_path / "a", tok, harness, tiny_policy)
    assert _run_folder(tmp_path / "b", tok, harness, tiny_policy, stop_after=0) is None
    partial = read_groups(tmp_path / "b" / "groups.jsonl")
    assert len(partial) == 2  # one chunk written before the interruption
    with open(tmp_path / "b" / "groups.jsonl", "a") as f:
        f.write('{"torn": ')  # a torn line from the kill
    resumed = _run_folder(tmp_path / "b", tok, harness, tiny_policy)
    assert [g.model_dump() for g in resumed] == [g.model_dump() for g in full]
    assert (tmp_path / "a" / "rows.jsonl").read_text() == (tmp_path / "b" / "rows.jsonl").read_text()


def test_resume_refuses_another_config(tmp_path, tok, harness, tiny_policy):
    _run_folder(tmp_path / "a", tok, harness, tiny_policy, stop_after=0)
    before = (tmp_path / "a" / "groups.jsonl").read_text()
    with pytest.raises(ConfigMismatchError, match="differs in"):
        check_folder(tmp_path / "a", folder_config({"x": 2}, G=3, seed=5, chunk=2, max_steps=2))
    check_folder(tmp_path / "a", folder_config({"x": 1}, G=3, seed=5, chunk=2, max_steps=2))  # same: fine
    assert (tmp_path / "a" / "groups.jsonl").read_text() == before
