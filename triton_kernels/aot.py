"""What the ahead-of-time GPU structure check compiles: one :class:`AotSpec` per kernel and config.

Every kernel file under ``triton_kernels/`` that launches on a GPU exposes ``aot_specs() ->
list[AotSpec]``: each config the op can launch, with the signature the JIT would specialise it with
(tensor pointers and int arguments that are multiples of 16 get ``tt.divisibility`` 16, an int equal
to 1 becomes a constant). ``bench/gpu_aot.py`` compiles each for sm_90a on a CPU (no GPU, no
driver) and reads registers, spills, shared memory, wgmma, TMA and warp specialisation from the
ptxas log, the PTX and the TTGIR, and fails a kernel that does not get what its spec expects.

This module imports nothing but the standard library, so kernel files can import it at no cost.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class AotSpec:
    """One kernel at one launch config, as the JIT would compile it on an sm_90 device."""

    kernel: str
    """Name of the kernel in reports, e.g. ``"stair_fwd"``."""
    config: str
    """Short label of the config, e.g. ``"BM128-BN64-w4-s2"``."""
    fn: Callable[..., Any]
    """The ``@triton.jit`` function itself."""
    signature: dict[str, str]
    """Every argument's type as ``triton.compiler.ASTSource`` wants it (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"constexpr"``, ``"tensordesc<bf16[64, 128]>"``)."""
    constexprs: dict[str, Any]
    """Values of the ``constexpr`` arguments (and of int arguments specialised to a constant)."""
    divisible_by_16: tuple[str, ...] = ()
    """Arguments the JIT marks ``tt.divisibility`` 16 (pointers; ints that are multiples of 16)."""
    num_warps: int = 4
    num_stages: int = 2
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Further ``triton.compile`` options (``maxnreg``, ...)."""
    expect_wgmma: bool = False
    """The design uses Hopper wgmma: the PTX must contain ``wgmma.mma_async``."""
    expect_tma: bool = False
    """The design loads by TMA: the PTX must contain ``cp.async.bulk.tensor``."""
    expect_warp_specialized: bool = False
    """The design is warp specialised: the TTGIR must contain ``ttg.warp_specialize``."""
    global_scratch: bool = False
    """The kernel builds device-side tensor descriptors (needs ``triton.set_allocator`` at launch)."""
