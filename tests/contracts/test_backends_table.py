"""Contract: the surface is honest. ``treadle backends`` lists every public op, and says
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


@pytest.mark.parametrize("op", ["grpo_advantages", "stair_readout", "gated_lora", "gated_lora_linear"])
def test_every_kernel_backend_is_here(op):
    # the contract tests run over the backends available here: a missing C++ build or triton would
    # silently shrink them, so a green run must mean every CPU backend ran (as in CI)
    import cases

    assert cases.backends(op) == ["reference", "cpp", "triton"]
