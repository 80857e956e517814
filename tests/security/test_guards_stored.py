"""Stored state the CLI reads back (``state.json`` of an RSI run; ``run.json`` is covered with the run-folder
guards): a hand-edited or truncated file of the wrong shape is one clear error, and the folder is left as it is."""
import pytest

from treadle.rsi.loop import LoopConfig
from treadle.rsi.math_tasks import make_seeds
from treadle.rsi.runs import RunMismatchError, run


@pytest.fixture(scope="module")
def rsi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rsi") / "r"
    run(out, make_seeds(4, 0), (), LoopConfig(rounds=1))
    return out


@pytest.mark.parametrize("state", ["[]", "{}", '{"round": "1"}', '{"round": -1}', "{" * 10_000, '{"round": 1}',
                                   '{"round": 1, "harness": 5, "h0": {}, "chains": [], "curve": 1, "curve_ci": 2}'])
def test_an_rsi_state_json_of_the_wrong_shape_is_one_line(rsi_run, state):
    good = (rsi_run / "state.json").read_text()
    try:
        (rsi_run / "state.json").write_text(state)
        with pytest.raises(RunMismatchError, match="not a readable run state") as ei:
            run(rsi_run, make_seeds(4, 0), (), LoopConfig(rounds=2))
        assert "\n" not in str(ei.value)
        assert (rsi_run / "state.json").read_text() == state
    finally:
        (rsi_run / "state.json").write_text(good)
