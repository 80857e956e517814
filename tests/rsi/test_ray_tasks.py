"""RSI seed chains and candidate evaluations as Ray tasks equal the single-process loop."""
import json
import os
import sys

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from treadle.ray_cluster import check_address  # noqa: E402
from treadle.rsi.loop import LoopConfig, RSILoop  # noqa: E402
from treadle.rsi.math_tasks import make_seeds  # noqa: E402
from treadle.rsi.ray_tasks import RayChains  # noqa: E402
from treadle.rsi.solvers import CapacitySolver  # noqa: E402


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the test module


def _run(distributed=None, seed=1, n=6, rounds=2, solver=None, **kw):
    L = RSILoop(make_seeds(n, 0), solver or CapacitySolver(), LoopConfig(seed=seed, rounds=rounds, **kw))
    L.distributed = distributed
    recs = [L.step_round() for _ in range(rounds)]
    return L, recs


def _same(a, b):
    (La, ra), (Lb, rb) = a, b
    assert La.curve == Lb.curve and La.curve_ci == Lb.curve_ci
    assert La.log == Lb.log
    assert La.harness == Lb.harness
    assert [e.model_dump() for e in La.ledger.entries] == [e.model_dump() for e in Lb.ledger.entries]
    for x, y in zip(ra, rb):
        assert x["exports"] == y["exports"] and x["repairs"] == y["repairs"]
        assert x["harness_online"] == y["harness_online"]


@pytest.fixture(scope="module")
def single():
    return _run()


@pytest.mark.parametrize("chunk", [1, None])  # one chain per task; slices of chains (auto: 2 tasks per CPU)
def test_rounds_equal_single_process(local_ray, single, chunk):
    chains = RayChains(chunk=chunk)
    got = _run(chains)
    _same(single, got)
    log = single[0].log
    # the run exercises both paths that need care: an online admission (later chains rerun under the
    # grown harness) and post-batch candidates judged by the Critic in the driver
    assert any("admitted" in e for e in log), log
    assert any(e.get("event") == "candidate" for e in log), log
    online_tasks = 2 * len(chains._slices(make_seeds(6, 0)))  # 2 rounds
    assert chains.submitted > online_tasks  # candidate evaluations (and reruns) were submitted as tasks too


def test_staged_queue_and_transfer_equal_single_process(local_ray):
    base = _run(staged_queue=3, rounds=1)
    got = _run(RayChains(), staged_queue=3, rounds=1)
    _same(base, got)
    held = make_seeds(4, 7)
    assert base[0].transfer(held, base[0].harness, 2) == got[0].transfer(held, got[0].harness, 2)


class DyingSolver(CapacitySolver):
    """A solver whose process exits (as if the node were lost) on its first call in a Ray worker."""

    def __init__(self, marker):
        super().__init__()
        self.marker, self.driver_pid = str(marker), os.getpid()

    def attempt(self, texts, n, seed):
        if os.getpid() != self.driver_pid:  # in a Ray worker
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(1)
        return super().attempt(texts, n, seed)


def test_a_killed_worker_loses_no_chain(local_ray, single, tmp_path):
    marker = tmp_path / "died"
    got = _run(RayChains(max_retries=2), solver=DyingSolver(marker))
    assert marker.exists()  # a worker did die mid-chain
    _same(single, got)


def test_runs_run_and_cli_with_ray(local_ray, tmp_path):
    from treadle.rsi.cli import app
    from treadle.rsi.runs import run

    seeds = make_seeds(5, 0)
    a = run(tmp_path / "a", seeds, loop=LoopConfig(rounds=1))
    b = run(tmp_path / "b", seeds, loop=LoopConfig(rounds=1), ray_address="auto")
    assert a["curve"] == b["curve"]
    for name in ("problems.jsonl", "log.jsonl", "ledger.jsonl", "repairs.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name
    r = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "c"), "--ray", "head:notaport"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "--ray" in r.output, r.output
    assert not (tmp_path / "c").exists()  # refused before the run folder was touched
    r = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "d"), "--rounds", "1", "--seeds", "5",
                                 "--ray", "auto"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "d" / "summary.json").read_text())["curve"]


def test_bad_chunk_is_refused(local_ray):
    with pytest.raises(ValueError, match="chunk"):
        RayChains(chunk=0)


@pytest.mark.parametrize("bad", ["", "head", "ray://head:", "head:0", "head:70000", 7])
def test_malformed_addresses_are_refused(bad):
    with pytest.raises(ValueError, match="Ray address"):
        check_address(bad)


@pytest.mark.parametrize("good", ["auto", "local", "ray://head:10001", "10.0.0.1:6379"])
def test_addresses_accepted(good):
    assert check_address(good) == good


def test_both_clis_check_ray_the_same_way(tmp_path, monkeypatch):
    """``--ray`` is checked by one helper (:func:`treadle.ray_cluster.check_ray_option`) in ``rsi run`` and
    ``weft rollouts sample``: a malformed address and a missing Ray are one line, exit 2, nothing written."""
    import importlib.util

    from treadle.ray_cluster import RayUnavailableError, check_ray_option
    from treadle.rsi.cli import app as rsi_app
    from treadle.weft.rollouts.cli import app as rollouts_app

    assert check_ray_option(" auto ") == "auto"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(RayUnavailableError, match="pip install"):
        check_ray_option("auto")
    for app, cmd in ((rsi_app, "run"), (rollouts_app, "sample")):
        for addr, says in (("head:notaport", "Ray address"), ("auto", "Ray is not installed")):
            out = tmp_path / f"{cmd}-{addr}"
            r = CliRunner().invoke(app, [cmd, "--out", str(out), "--ray", addr])
            assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
            assert "--ray" in r.output and says in r.output, r.output
            assert not out.exists()
