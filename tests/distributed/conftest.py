"""``run_ranks(fn, world, *args)``: run a module-level test worker on ``world`` CPU gloo processes
(:func:`treadle.distributed.spawn.spawn_gloo`) and get each rank's result."""
import pytest


@pytest.fixture
def run_ranks(tmp_path):
    from treadle.distributed.spawn import spawn_gloo

    def run(fn, world, *args):
        d = tmp_path / f"ranks_{fn.__name__}"
        d.mkdir()
        return spawn_gloo(fn, world, d, *args)

    return run
