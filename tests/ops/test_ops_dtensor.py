"""Every public op refuses a DTensor in EACH of its tensor arguments, naming the op and the argument.

A one-rank gloo process group in this process is enough to make a replicated DTensor on the CPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from treadle.distributed import DTensorInputError
from treadle.ops.gated_lora import gated_lora, gated_lora_linear
from treadle.ops.grpo_advantages import grpo_advantages
from treadle.ops.stair_readout import stair_readout
from treadle.ops.topk_entropy import topk_entropy, topk_entropy_from_hidden

pytest.importorskip("torch.distributed.tensor")


@pytest.fixture(scope="module")
def replicate():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    mesh = init_device_mesh("cpu", (1,))
    yield lambda t: distribute_tensor(t, mesh, [Replicate()])
    if own:
        dist.destroy_process_group()


def _g(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape)), dtype=dtype)


LORA = dict(scaling=2.0, L=-2.0, U=2.0, tau=1.0)
# op name -> (function, positional tensor names, keyword tensors, other kwargs); every call valid as given
CALLS = {
    "grpo_advantages": (grpo_advantages, ("rewards", "group_ids"),
                        lambda: dict(rewards=_g(4), group_ids=torch.tensor([0, 0, 1, 1]),
                                     valid=torch.ones(4, dtype=torch.bool), flags=torch.zeros(4, dtype=torch.bool)),
                        {}),
    "gated_lora": (gated_lora, ("x", "base_out", "lora_A", "lora_B", "gate_weight", "gate_bias"),
                   lambda: dict(x=_g(3, 8), base_out=_g(3, 4), lora_A=_g(2, 8), lora_B=_g(4, 2), gate_weight=_g(8),
                                gate_bias=_g(1)), LORA),
    "gated_lora_linear": (gated_lora_linear, ("x", "weight", "bias", "lora_A", "lora_B", "gate_weight", "gate_bias"),
                          lambda: dict(x=_g(3, 8), weight=_g(4, 8), bias=_g(4), lora_A=_g(2, 8), lora_B=_g(4, 2),
                                       gate_weight=_g(8), gate_bias=_g(1)), LORA),
    "stair_readout": (stair_readout, ("q", "k_bank", "v_bank", "normals"),
                      lambda: dict(q=_g(1, 2, 3, 8), k_bank=_g(1, 1, 4, 8), v_bank=_g(1, 1, 4, 8), normals=_g(2, 8),
                                   bank_lengths=torch.tensor([3])), dict(eps=0.1)),
    "topk_entropy": (topk_entropy, ("logits",),
                     lambda: dict(logits=_g(2, 3, 30), mask=torch.ones(2, 3, dtype=torch.bool)), dict(k=5)),
    "topk_entropy_from_hidden": (topk_entropy_from_hidden, ("hidden", "lm_head_weight"),
                                 lambda: dict(hidden=_g(2, 8), lm_head_weight=_g(30, 8),
                                              mask=torch.ones(2, dtype=torch.bool)), dict(k=5)),
}


def _call(op, tensors, kwargs):
    fn, positional, _, _ = CALLS[op]
    args = [tensors.pop(n) for n in positional]
    return fn(*args, **tensors, **kwargs)


CASES = [(op, name) for op, (_, _, make, _) in CALLS.items() for name in make()]


@pytest.mark.parametrize("op", list(CALLS))
def test_each_call_runs_on_plain_tensors(op):
    # so that in the test below the DTensor is the only thing wrong with the call
    _, _, make, kwargs = CALLS[op]
    out = _call(op, make(), kwargs)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("op,name", CASES)
def test_a_dtensor_in_any_tensor_argument_is_refused_by_name(replicate, op, name):
    _, _, make, kwargs = CALLS[op]
    tensors = make()
    shape = tuple(tensors[name].shape)
    tensors[name] = replicate(tensors[name])
    with pytest.raises(DTensorInputError) as info:
        _call(op, tensors, kwargs)
    msg = str(info.value)
    assert msg.startswith(f"treadle op {op!r} got a DTensor for {name!r} (placements (Replicate(),), global shape "
                          f"{shape}); treadle ops take plain tensors."), msg
    assert msg.endswith(f"{name}.full_tensor() (sharded; a collective) or {name}.to_local() (replicated)"), msg
