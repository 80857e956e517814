"""Triton helpers shared by several kernel files."""
import triton
import triton.language as tl


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    # UPCAST: the CPU interpreter's tl.dot mishandles bfloat16 operands, so there they go in as fp32
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
