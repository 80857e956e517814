"""Guards that a small realistic change would silently break: where the verl hand-off puts a trajectory's
reward, the Critic margin production runs with, and run folders of a run that is still ``running``."""
import inspect
import json

import pytest
import torch

from treadle.run_dirs import RunDirError, open_run_dir, read_run_record


# ---------------------------------------------------------------- verl hand-off: reward on the LAST policy token
def _row(mask, reward, key="g0", cand=0):
    from treadle.weft.rl.groups import GroupRow

    return GroupRow(group_key=key, task_id="t", turn=0, candidate=cand, prompt_ids=(1, 2, 3),
                    response_ids=tuple(range(10, 10 + len(mask))), response_mask=tuple(mask), reward=reward,
                    advantage=0.0)


def test_token_level_rewards_sit_on_the_last_policy_token_only():
    from treadle.weft.rl.groups import to_verl

    rows = [_row([1, 1, 0, 0, 1, 1, 0, 0], 1.0),          # tool tokens between, trailing non-policy tokens
            _row([0, 1, 1, 1], 0.5, cand=1),               # first token is not the policy's
            _row([1], -2.0, cand=2),
            _row([1, 0, 1, 0, 0, 0], 0.25, key="g1")]
    batch = to_verl(rows, pad_id=0)
    tlr = batch["token_level_rewards"]
    assert tlr.shape == batch["response_mask"].shape and tlr.dtype == torch.float32
    for i, r in enumerate(rows):
        nz = torch.nonzero(tlr[i]).flatten().tolist()
        last = max(j for j, m in enumerate(r.response_mask) if m)
        assert nz == [last], (i, nz, last)
        assert tlr[i, last].item() == r.reward and tlr[i].sum().item() == r.reward
        assert batch["response_mask"][i, last] == 1


def test_verl_estimator_sees_the_sum_of_the_row_reward():
    from treadle.grpo.verl_adapter import make_estimator
    from treadle.weft.rl.groups import to_verl

    rows = [_row([1, 1, 0, 1], 1.0), _row([1, 0, 0, 0], 0.0, cand=1)]
    batch = to_verl(rows, pad_id=0)
    adv, _ = make_estimator("grpo")(token_level_rewards=batch["token_level_rewards"],
                                    response_mask=batch["response_mask"], index=batch["index"])
    assert adv[0][batch["response_mask"][0] == 1].gt(0).all() and adv[1][0] < 0
    assert (adv[batch["response_mask"] == 0] == 0).all()


# ---------------------------------------------------------------- the Critic margin production relies on
def test_critic_defaults_are_the_documented_margin_everywhere():
    from treadle.rsi import cli as rsi_cli
    from treadle.rsi.critic import Critic, Evaluation, PostBatchGate
    from treadle.rsi.harness import Harness
    from treadle.rsi.llm_post_batch import llm_post_batch
    from treadle.rsi.loop import LoopConfig

    assert Critic().margin == 0.02
    assert LoopConfig().margin == Critic().margin
    assert inspect.signature(llm_post_batch).parameters["margin"].default == Critic().margin
    for cmd in (rsi_cli.run_cmd, rsi_cli.llm_cmd):
        assert inspect.signature(cmd).parameters["margin"].default.default == Critic().margin, cmd.__name__
    base = Evaluation(validity=1.0, accuracy=0.6, cost=100.0)
    # with the default margin: a gain of 0.015 is noise, 0.03 is progress
    assert not Critic().judge(Evaluation(validity=1.0, accuracy=0.585, cost=100.0), base).accepted
    assert Critic().judge(Evaluation(validity=1.0, accuracy=0.57, cost=100.0), base).accepted
    # the gate production builds without a critic uses the same default
    gate = PostBatchGate(Harness(), base)
    assert gate.critic.margin == Critic().margin


# ---------------------------------------------------------------- run folders of a run still `running`
def _running(path, config, extra_file=False):
    """A run left ``running``: started (the live case) or killed before it could record its end."""
    run = open_run_dir(path, command="x", config=config).start()
    if extra_file:
        (path / "partial.bin").write_text("half")
    return run


@pytest.mark.parametrize("extra_file", [False, True])
def test_a_running_runs_folder_is_not_taken_over_by_another_config(tmp_path, extra_file):
    p = tmp_path / "r"
    _running(p, {"a": 1}, extra_file)
    with pytest.raises(RunDirError, match="another config"):
        open_run_dir(p, command="x", config={"a": 2})
    assert read_run_record(p)["config"] == {"a": 1} and read_run_record(p)["status"] == "running"
    if extra_file:
        assert (p / "partial.bin").exists()


def test_a_killed_runs_folder_is_not_taken_over_either(tmp_path):
    # a SIGKILL leaves status `running` and no end time: nothing tells it apart from a live run, so the same rule
    p = tmp_path / "r"
    _running(p, {"a": 1})
    rec = json.loads((p / "run.json").read_text())
    assert rec["status"] == "running" and rec["ended"] is None
    with pytest.raises(RunDirError, match="another config"):
        open_run_dir(p, command="x", config={"a": 2})
    same = open_run_dir(p, command="x", config={"a": 1})  # the same config resumes it
    assert same.resumed and not same.finished


def test_a_failed_run_with_nothing_saved_may_be_taken_over(tmp_path):
    p = tmp_path / "r"
    _running(p, {"a": 1}).end("failed")
    run = open_run_dir(p, command="x", config={"a": 2})
    run.start()
    assert read_run_record(p)["config"] == {"a": 2}


@pytest.mark.parametrize("record", ["[]", "3", '"x"', '{"command": 5}', '{"command": "x", "config": [1]}',
                                    '{"command": "x", "config": {}, "history": {"a": 1}}',
                                    '{"command": "x", "config": {}, "history": [1, 2]}', '{"config": {}}'])
def test_a_hand_edited_run_json_of_the_wrong_shape_is_one_line(tmp_path, record):
    p = tmp_path / "r"
    p.mkdir()
    (p / "run.json").write_text(record)
    with pytest.raises(RunDirError, match="not a treadle run record") as ei:
        open_run_dir(p, command="x", config={"a": 1})
    assert "\n" not in str(ei.value)
    assert (p / "run.json").read_text() == record  # nothing the user had is touched
