"""The rollout driver on Ray actors: same trajectories as one process; a killed actor loses nothing written."""
import json
import sys
import threading
import time

import anyio
import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from treadle.weft.rollouts.batch import Component, SampleConfig, read_trajectories, sample  # noqa: E402
from treadle.weft.rollouts.policies import ReplayPolicy  # noqa: E402
from treadle.weft.rollouts.tasks import from_shop, replicate  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the test module
RATES = {"wrong_argument": 0.2, "skipped_call": 0.1, "malformed_call": 0.1}
CFG = SampleConfig(policy=Component(name="replay", args={"rates": RATES, "seed": 0}),
                   methods=("prefix", "end_to_end"), ks=(1, 3), concurrency=4)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process run (no Ray) of the shop tasks: trajectory by key."""
    trs = sample(tmp_path_factory.mktemp("single"), replicate(from_shop(), 2), CFG)
    return {t.key: t.model_dump() for t in trs}


@pytest.mark.slow  # Ray actors are Python processes importing the runtime: seconds each on 2 busy cores
def test_cli_ray_equals_single_process(local_ray, single, tmp_path):
    # one actor (a start costs ~5 s here): the CLI path; rollouts over 2 actors are the killed-actor test's
    from treadle.weft.rollouts.cli import app

    args = ["sample", "--out", str(tmp_path / "run"), "--replicas", "2", "--k", "1", "--k", "3", "--seed", "0",
            "--concurrency", "4", "--ray", "auto", "--ray-workers", "1", "--no-sft"]
    for r in RATES.items():
        args += ["--rate", "=".join(map(str, r))]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    got = {t.key: t.model_dump() for t in read_trajectories(tmp_path / "run" / "trajectories.jsonl")}
    assert got == single
    assert any(not t["accepted"] for t in got.values()) and any(t["accepted"] for t in got.values())
    assert all(t["failure"] is None for t in got.values())


class StallOnce(ReplayPolicy):
    """The replay policy (same name, args, outputs), except that its first act in a Ray actor on one task
    records the actor's name and stalls, so that the test can kill that actor mid-rollout."""

    def __init__(self, marker, task, **kw):
        super().__init__(**kw)
        self.marker, self.task = str(marker), task

    async def act(self, messages, tools, harness, ctx):
        if ctx.task.name == self.task and ctx.step == 0 and ctx.attempt == 0:
            import os

            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, ray.get_runtime_context().get_actor_name().encode())
                os.close(fd)
                await anyio.sleep(60)
        return await super().act(messages, tools, harness, ctx)


@pytest.mark.slow  # Ray actors are Python processes importing the runtime: seconds each on 2 busy cores
def test_a_killed_actor_loses_no_written_rollout(local_ray, single, tmp_path, monkeypatch):
    from treadle.weft.rollouts import batch

    tasks = replicate(from_shop(), 2)
    victim = tasks[-1].name
    marker = tmp_path / "stalled"
    real = batch.build_setup

    def build(cfg, *, client=None):  # the same setup, with the stalling replay policy
        s = real(cfg, client=client)
        p = s.policy
        return type(s)(view=s.view, harness=s.harness, max_steps=s.max_steps, seed=s.seed,
                       policy=StallOnce(marker, victim, rates=p.rates, seed=p.seed))
    monkeypatch.setattr(batch, "build_setup", build)
    killed = []

    def killer():
        t0 = time.monotonic()
        while not marker.exists() or not marker.read_text():
            if time.monotonic() - t0 > 120:
                return
            time.sleep(0.05)
        ray.kill(ray.get_actor(marker.read_text()), no_restart=True)
        killed.append(marker.read_text())

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    t0 = time.monotonic()
    trs = sample(tmp_path / "run", tasks, CFG, ray_address="auto", ray_workers=2)
    th.join(5)
    assert killed, "the stalled actor was never killed"
    assert time.monotonic() - t0 < 60  # the stalled rollout was rerun elsewhere, not waited for
    assert {t.key: t.model_dump() for t in trs} == single  # nothing lost, nothing different
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == len(single)  # every rollout written once: nothing written was redone
    assert all(json.loads(line)["failure"] is None for line in lines)


def test_bad_ray_flags_are_one_line_exit_2(tmp_path):
    from treadle.weft.rollouts.cli import app

    for args, flag in ((["--ray", "nohost"], "--ray"), (["--ray-workers", "2"], "--ray-workers"),
                       (["--ray", "auto", "--ray-workers", "0"], "--ray-workers")):
        res = CliRunner().invoke(app, ["sample", "--out", str(tmp_path / "run"), *args])
        assert res.exit_code == 2 and res.output.count("\n") == 1 and flag in res.output, res.output
    assert not (tmp_path / "run").exists()


def test_llm_components_on_ray_need_a_config(tmp_path):
    with pytest.raises(ValueError, match="llm_config"):
        sample(tmp_path / "run", from_shop(), SampleConfig(policy=Component(name="llm")), client=object(),
               ray_address="auto")
    assert not (tmp_path / "run").exists()


class Broken(ReplayPolicy):
    """A replay policy whose endpoint breaks on the second task: the rollout raises (an infrastructure failure)."""

    async def act(self, messages, tools, harness, ctx):
        if ctx.task.name == from_shop()[1].name:
            raise RuntimeError("endpoint broke")
        return await super().act(messages, tools, harness, ctx)


def test_a_raising_rollout_is_the_same_failed_record_on_ray(local_ray, tmp_path, monkeypatch):
    from treadle.weft.rollouts import batch

    real = batch.build_setup

    def build(cfg, *, client=None):
        s = real(cfg, client=client)
        return type(s)(view=s.view, harness=s.harness, max_steps=s.max_steps, seed=s.seed,
                       policy=Broken(rates=s.policy.rates, seed=s.policy.seed))
    monkeypatch.setattr(batch, "build_setup", build)
    cfg = SampleConfig(policy=CFG.policy, ks=(1,), concurrency=2)
    here = {t.key: t.model_dump() for t in sample(tmp_path / "one", from_shop(), cfg)}
    there = {t.key: t.model_dump() for t in sample(tmp_path / "ray", from_shop(), cfg, ray_address="auto",
                                                    ray_workers=1)}
    assert there == here
    assert sorted(t["failure"] or "" for t in here.values()) == ["", "RuntimeError: endpoint broke"]
