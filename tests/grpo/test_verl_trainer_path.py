"""treadle's verl estimators through verl's own trainer path (``ray_trainer.compute_advantage`` with an
``AlgoConfig``): the numbers of verl's estimators of the same meaning, every option verl passes honoured."""
import numpy as np
import pytest
import torch

from treadle.testing import require_module


def _setup():
    trainer = require_module("verl.trainer.ppo.ray_trainer")
    from verl import DataProto
    from verl.trainer.config import AlgoConfig

    import treadle.grpo.verl_adapter  # noqa: F401 - registers on import

    return trainer, DataProto, AlgoConfig


def _batch(DataProto, seed=0):
    """Ragged response masks, groups of 1..8 rows in shuffled order, non-binary rewards on the last token."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 8, 4]
    index = np.array([f"uid-{i}" for i, s in enumerate(sizes) for _ in range(s)], dtype=object)
    index = index[torch.randperm(len(index), generator=gen).numpy()]
    B, T = len(index), 9
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = (torch.randint(0, 3, (B,), generator=gen).float()
                                             + torch.rand(B, generator=gen))

    def data():
        return DataProto.from_dict(tensors={"token_level_rewards": rewards.clone(), "response_mask": mask.clone(),
                                            "responses": torch.zeros(B, T, dtype=torch.long)},
                                   non_tensors={"uid": index.copy()})
    return data


@pytest.mark.parametrize("norm", [True, False])
def test_treadle_grpo_honours_norm_adv_by_std_in_grpo_from_the_config(norm):
    trainer, DataProto, AlgoConfig = _setup()
    data = _batch(DataProto)
    cfg = AlgoConfig(adv_estimator="treadle_grpo", norm_adv_by_std_in_grpo=norm)
    ours = trainer.compute_advantage(data(), adv_estimator="treadle_grpo", norm_adv_by_std_in_grpo=norm, config=cfg)
    theirs = trainer.compute_advantage(data(), adv_estimator="grpo", norm_adv_by_std_in_grpo=norm,
                                       config=AlgoConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm))
    torch.testing.assert_close(ours.batch["advantages"], theirs.batch["advantages"], atol=2e-6, rtol=1e-5)
    other = trainer.compute_advantage(data(), adv_estimator="grpo", norm_adv_by_std_in_grpo=not norm)
    assert not torch.allclose(ours.batch["advantages"], other.batch["advantages"])  # the switch changes numbers


@pytest.mark.parametrize("ours_name,verl_name", [("treadle_reinforce_baseline", "reinforce_plus_plus_baseline"),
                                                 ("treadle_rloo", "rloo")])
@pytest.mark.parametrize("seed", [0, 1])
def test_estimators_equal_verl_through_compute_advantage(ours_name, verl_name, seed):
    trainer, DataProto, AlgoConfig = _setup()
    data = _batch(DataProto, seed)
    ours = trainer.compute_advantage(data(), adv_estimator=ours_name, config=AlgoConfig(adv_estimator=ours_name))
    theirs = trainer.compute_advantage(data(), adv_estimator=verl_name, config=AlgoConfig(adv_estimator=verl_name))
    torch.testing.assert_close(ours.batch["advantages"], theirs.batch["advantages"], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ours.batch["returns"], theirs.batch["returns"], atol=2e-6, rtol=1e-5)


def test_row_whitened_variant_differs_on_ragged_masks():
    """The op's row-weighted whitening is registered under a name that says so; with ragged masks it is not
    verl's token-weighted one (the test can fail: equal numbers would mean the two names mean one thing)."""
    trainer, DataProto, AlgoConfig = _setup()
    data = _batch(DataProto)
    row = trainer.compute_advantage(data(), adv_estimator="treadle_reinforce_baseline_row_whitened",
                                    config=AlgoConfig())
    tok = trainer.compute_advantage(data(), adv_estimator="reinforce_plus_plus_baseline", config=AlgoConfig())
    assert not torch.allclose(row.batch["advantages"], tok.batch["advantages"], atol=1e-3)


def test_flags_apply_after_token_whitening():
    from treadle.grpo.verl_adapter import RowUid

    trainer, DataProto, AlgoConfig = _setup()
    data = _batch(DataProto)()
    uids = data.non_tensor_batch["uid"]
    flagged = np.arange(len(uids)) % 3 == 0
    data.non_tensor_batch["uid"] = np.array([RowUid(u, bool(f)) for u, f in zip(uids, flagged)], dtype=object)
    plain = trainer.compute_advantage(_batch(DataProto)(), adv_estimator="treadle_reinforce_baseline",
                                      config=AlgoConfig())
    out = trainer.compute_advantage(data, adv_estimator="treadle_reinforce_baseline", config=AlgoConfig())
    f = torch.from_numpy(flagged)
    torch.testing.assert_close(out.batch["advantages"][f], plain.batch["advantages"][f].clamp(max=0))
    torch.testing.assert_close(out.batch["advantages"][~f], plain.batch["advantages"][~f])


def test_contradicting_keyword_and_config_and_unknown_options_raise():
    core = require_module("verl.trainer.ppo.core_algos")
    import treadle.grpo.verl_adapter  # noqa: F401

    fn = core.get_adv_estimator_fn("treadle_grpo")
    r, m, idx = torch.zeros(2, 3), torch.ones(2, 3), np.array(["a", "a"], dtype=object)
    with pytest.raises(ValueError, match="contradicts"):
        fn(r, m, idx, norm_adv_by_std_in_grpo=True, config={"norm_adv_by_std_in_grpo": False})
    with pytest.raises(TypeError, match="unknown keyword"):
        fn(r, m, idx, norm_adv_by_std=False)
    with pytest.raises(ValueError, match="unknown config.treadle"):
        fn(r, m, idx, config={"treadle": {"singletn": "zero"}})
    fn(r, m, idx, reward_baselines=torch.zeros(2))  # ignored, as verl's grpo/rloo ignore it


def test_a_name_clash_raises_and_registers_nothing(monkeypatch):
    core = require_module("verl.trainer.ppo.core_algos")
    from treadle.grpo import verl_adapter

    def foreign(**kw):
        return None

    reg = {"treadle_rloo": foreign}
    monkeypatch.setattr(core, "ADV_ESTIMATOR_REGISTRY", reg)
    with pytest.raises(verl_adapter.EstimatorNameClash, match="treadle_rloo"):
        verl_adapter.register_verl_estimators()
    assert reg == {"treadle_rloo": foreign}
    reg.clear()
    assert verl_adapter.register_verl_estimators() == list(verl_adapter.ESTIMATOR_NAMES)
    assert verl_adapter.register_verl_estimators() == list(verl_adapter.ESTIMATOR_NAMES)  # re-import: fine
