"""Contract: the surface is honest (issue 12). ``treadle backends`` lists every public op, and says
exactly what runs for the ops that have no compiled kernel."""
import pytest

import treadle
from treadle import dispatch, ops


def test_every_public_op_is_listed():
    assert set(treadle.backends()) == set(ops.__all__)


@pytest.mark.parametrize("op", ["topk_entropy", "topk_entropy_from_hidden"])
def test_topk_ops_say_they_run_pytorch_only(op):
    for dev, row in treadle.backends()[op].items():
        assert row["backend"] == "reference" and "no C++/Triton kernel" in row["reason"], (dev, row)
    for name in ("cpp", "triton"):
        with pytest.raises(dispatch.BackendUnavailableError, match="no .* kernel"):
            dispatch.choose(op, "cpu", name)
