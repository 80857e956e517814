"""``run_ranks(fn, world, *args)``: run a module-level test worker on ``world`` CPU gloo processes
(:func:`treadle.testing_ranks.spawn_gloo`) and get each rank's result."""
import pytest


@pytest.fixture
def run_ranks(tmp_path):
    from treadle.testing_ranks import spawn_gloo

    def run(fn, world, *args):
        d = tmp_path / f"ranks_{fn.__name__}"
        d.mkdir()
        return spawn_gloo(fn, world, d, *args)

    return run


@pytest.fixture
def treadle_cli(tmp_path):
    """``run(args, ranks=None, timeout=600)``: ``python -m treadle ARGS`` (``ranks`` None) or ``torchrun
    --standalone --nproc-per-node RANKS -m treadle ARGS`` with the C++ kernels (no Triton interpreter), one
    thread per rank and a private model cache; asserts exit 0 and returns the CompletedProcess."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun next to the interpreter"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TREADLE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "COLUMNS": "300"}

    def run(args, ranks=None, timeout=600):
        launch = ([sys.executable, "-m", "treadle"] if ranks is None else
                  [torchrun, "--standalone", "--nproc-per-node", str(ranks), "-m", "treadle"])
        res = subprocess.run([*launch, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stderr[-3000:]
        return res

    return run


@pytest.fixture
def outside_torchrun(tmp_path, monkeypatch):
    """No torchrun variables in the environment, a private model cache, wide CLI output."""
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "300")
    return monkeypatch
