"""A composed task runs through the rollouts layer unchanged: every view and harness, replay policy."""
import anyio
import pytest

from treadle.weft.evolve.compose import certify_composed, compose, propose_groups
from treadle.weft.evolve.composed_env import as_rollout_task, combined_source, merge_snapshots, register_rollout_env
from treadle.weft.rollouts.batch import Component, SampleConfig, sample
from treadle.weft.runtime import Runtime


@pytest.fixture(scope="module")
def composed(bundles):
    from treadle.weft.envs import crm, shop

    async def main():
        async with Runtime() as rt:
            hashes = {"shop": rt.register(shop), "crm": rt.register(crm)}
            ct = compose(bundles, propose_groups(bundles)["ada@example.com"], name="ada-x",
                         persona=("Mary Jackson", "mary@example.com"), lookalike=("Mary Jackman", "mj@example.com"))
            return await certify_composed(rt, ct, hashes)
    return anyio.run(main)


@pytest.mark.parametrize("view, harness", [("agentic", "hermes"), ("agentic", "react"), ("agentic", "native"),
                                           ("simuser", "hermes")])
def test_every_view_and_harness_runs_the_composed_task(composed, tmp_path, view, harness):
    register_rollout_env(composed)
    task = as_rollout_task(composed)
    cfg = SampleConfig(view=Component(name=view), harness=Component(name=harness),
                       policy=Component(name="replay", args={"rates": {}}), methods=("prefix",), ks=(1,))
    [tr] = sample(tmp_path / "run", [task], cfg)
    assert tr.failure is None and tr.accepted and tr.rewards == (1,) * len(composed.nodes)
    called = {c.name for a in tr.attempts for s in a.steps for c in s.calls}
    assert {"open_ticket", "escalate_case", "issue_credit"} <= called  # tools of both servers, one session


def test_a_perturbed_policy_fails_a_node_of_the_composed_task(composed, tmp_path):
    register_rollout_env(composed)
    cfg = SampleConfig(policy=Component(name="replay", args={"rates": {"skipped_call": 1.0}}), methods=("prefix",),
                       ks=(1,))
    [tr] = sample(tmp_path / "run", [as_rollout_task(composed)], cfg)
    assert not tr.accepted and tr.rewards[0] == 0


def test_merge_refuses_a_table_on_two_servers(composed):
    snap = composed.snapshots["shop"]
    with pytest.raises(ValueError, match="exists on both"):
        merge_snapshots({"a": snap, "b": snap})
    with pytest.raises(ValueError, match="no native environment"):
        combined_source(["shop", "mail"])
