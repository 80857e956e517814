"""Memory of ``topk_entropy_from_hidden``: what the forward keeps for the backward is O(tokens x k)
(the sparse gradient), never a chunk of logits; the peak by the chunk arithmetic at the GPU
figures' shape (V 151,936, d 4,096, 4,096 tokens, k 100, bf16) is at least 8x below full logits."""
import torch

from treadle.ops.topk_entropy import _CHUNK_ELEMENTS, peak_extra_bytes, topk_entropy_from_hidden


def test_chunk_arithmetic_at_the_figures_shape():
    V, d, tokens, k = 151_936, 4096, 4096, 100
    chunk = max(1, _CHUNK_ELEMENTS // V)
    ours = peak_extra_bytes(tokens, V, d, k, chunk)
    full = peak_extra_bytes(tokens, V, d, k, chunk, full_logits=True)
    assert full / ours >= 8, (full / 2**20, ours / 2**20)


def test_forward_saves_only_the_sparse_gradient():
    torch.manual_seed(0)
    m, d, V, k = 37, 16, 503, 7
    h = torch.randn(m, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = topk_entropy_from_hidden(h, w, k=k, chunk_size=5)
    out.backward()
    assert h.grad is not None and w.grad is not None
    for shape, _ in saved:
        assert V not in shape or shape == (V, d), f"a logits-sized tensor is kept for the backward: {shape}"
    sparse = [s for s, dt in saved if s == (m, k)]
    assert len(sparse) == 2  # indices and weights of the k selected logits a row
