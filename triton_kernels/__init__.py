"""Triton kernels of treadle (GPU path; run on CPU tensors under TRITON_INTERPRET=1 for tests).

Imported lazily by the ops in ``treadle.ops`` only when the Triton backend is chosen.
"""
