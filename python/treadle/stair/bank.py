"""STAIR's per-row, per-layer bank of earlier assistant-response keys/values (STAIR sec. 3.4 / 4.4).

Keys are stored **before** RoPE (after ``k_proj`` and the per-head ``k_norm`` where the model has
one) and values after ``v_proj``; both detached, appended in conversation order, read-only during
the turn that reads them. Rows of a batch have their own banks with ragged lengths; a read pads
them to the longest row and returns ``bank_lengths``. Prefix budgets keep only the last ``N`` bank
tokens of each row (the paper's 2K/8K/32K study); the read-out then re-numbers them ``0..N-1``.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["Bank", "BankMismatchError", "model_key"]


class BankMismatchError(ValueError):
    """A bank built for another model, another layer set or another batch was given to a controller."""


def model_key(model) -> str:
    """A short fingerprint of a model's shape-defining config (model_type, sizes), used to refuse
    banks and normals from other models."""
    cfg = model.config
    fields = [getattr(cfg, "model_type", "?")] + [str(getattr(cfg, k, None)) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "intermediate_size", "rope_parameters", "rope_theta", "layer_types")]
    return hashlib.sha256("|".join(fields).encode()).hexdigest()[:16]


class Bank:
    """Bank of ``B`` rows x controlled layers.

    Args:
        layers: the controlled layer indices (tuple of ints).
        batch_size: ``B`` rows.
        num_kv_heads, head_dim, value_dim: ``Hkv``, ``D`` (keys) and ``Dv`` (values).
        dtype, device: storage dtype/device of the bank tensors.
        key: the model fingerprint (:func:`model_key`) the bank belongs to.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, layers, batch_size: int, num_kv_heads: int, head_dim: int, value_dim: int, *,
                 dtype: torch.dtype = torch.float32, device="cpu", key: str = ""):
        if batch_size < 1 or num_kv_heads < 1 or head_dim < 1 or value_dim < 1:
            raise ValueError(f"Bank sizes must be >= 1, got batch_size={batch_size}, num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}, value_dim={value_dim}")
        self.layers = tuple(layers)
        self.batch_size, self.num_kv_heads, self.head_dim, self.value_dim = batch_size, num_kv_heads, head_dim, value_dim
        self.dtype, self.device, self.key = dtype, torch.device(device), key
        empty_k = torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype, device=self.device)
        empty_v = torch.zeros(num_kv_heads, 0, value_dim, dtype=dtype, device=self.device)
        self._k = {li: [empty_k] * batch_size for li in self.layers}
        self._v = {li: [empty_v] * batch_size for li in self.layers}
        self.version = 0

    # ------------------------------------------------------------------ sizes
    @property
    def lengths(self) -> list[int]:
        """Bank tokens per row."""
        return [int(k.shape[1]) for k in self._k[self.layers[0]]]

    @property
    def num_tokens(self) -> int:
        """Bank tokens summed over rows."""
        return sum(self.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes held by the bank tensors (keys + values, all layers and rows)."""
        return sum(t.numel() * t.element_size() for d in (self._k, self._v) for rows in d.values() for t in rows)

    def __repr__(self) -> str:
        return (f"Bank(layers={self.layers}, rows={self.batch_size}, tokens per row={self.lengths}, "
                f"{self.nbytes / 1024:.1f} KiB)")

    # ------------------------------------------------------------------ writes
    def append(self, kv: dict, span: torch.Tensor) -> None:
        """Append, per row, the tokens selected by ``span`` (detached, in order).

        Args:
            kv: layer -> ``(k (B, T, Hkv, D), v (B, T, Hkv, Dv))`` pre-RoPE keys and values of one forward.
            span: ``(B, T)`` bool, True on the tokens to bank (assistant response body).

        Raises:
            BankMismatchError: ``kv`` misses a controlled layer or has other shapes.
            ValueError: ``span`` of the wrong shape.
        """
        missing = [li for li in self.layers if li not in kv]
        if missing:
            raise BankMismatchError(f"no captured K/V for controlled layer(s) {missing}")
        k0 = kv[self.layers[0]][0]
        if span.shape != k0.shape[:2] or span.shape[0] != self.batch_size:
            raise ValueError(f"span must have shape (B={self.batch_size}, T={k0.shape[1]}), got {tuple(span.shape)}")
        span = span.to(torch.bool).cpu()
        if not bool(span.any()):
            return
        for li in self.layers:
            k, v = kv[li]
            if k.shape[2:] != (self.num_kv_heads, self.head_dim) or v.shape[2:] != (self.num_kv_heads, self.value_dim):
                raise BankMismatchError(f"layer {li}: K/V of shapes {tuple(k.shape)}/{tuple(v.shape)} do not fit a bank of "
                                        f"Hkv={self.num_kv_heads}, D={self.head_dim}, Dv={self.value_dim}")
            for b in range(self.batch_size):
                idx = span[b].nonzero().flatten().to(k.device)
                if idx.numel() == 0:
                    continue
                kb = k[b].index_select(0, idx).detach().to(self.dtype).to(self.device).transpose(0, 1)
                vb = v[b].index_select(0, idx).detach().to(self.dtype).to(self.device).transpose(0, 1)
                self._k[li][b] = torch.cat([self._k[li][b], kb], dim=1)
                self._v[li][b] = torch.cat([self._v[li][b], vb], dim=1)
        self.version += 1

    def repeat_rows(self, n: int) -> "Bank":
        """A new bank whose row ``i * n + j`` is a copy of row ``i`` (for ``n`` samples per row)."""
        out = Bank(self.layers, self.batch_size * n, self.num_kv_heads, self.head_dim, self.value_dim,
                   dtype=self.dtype, device=self.device, key=self.key)
        for li in self.layers:
            out._k[li] = [t for t in self._k[li] for _ in range(n)]
            out._v[li] = [t for t in self._v[li] for _ in range(n)]
        return out

    def clear(self) -> None:
        """Empty every row."""
        for li in self.layers:
            self._k[li] = [t[:, :0] for t in self._k[li]]
            self._v[li] = [t[:, :0] for t in self._v[li]]
        self.version += 1

    # ------------------------------------------------------------------ reads
    def read(self, layer: int, *, budget: int | None = None, shuffle_seed: int | None = None):
        """Padded bank of one layer.

        Args:
            layer: a controlled layer.
            budget: keep only each row's last ``budget`` tokens (None: all).
            shuffle_seed: if set, permute the values within each row's bank (the K/V pairing
                control), deterministically for the seed.

        Returns:
            ``(k (B, Hkv, M, D), v (B, Hkv, M, Dv), lengths (B,) int64)``, M = the longest row
            (zero-padded beyond each row's length), pre-RoPE keys.

        Raises:
            BankMismatchError: ``layer`` is not in the bank.
        """
        if layer not in self._k:
            raise BankMismatchError(f"layer {layer} is not in this bank (layers {self.layers})")
        ks, vs = self._k[layer], self._v[layer]
        if budget is not None:
            ks = [t[:, max(0, t.shape[1] - budget):] for t in ks]
            vs = [t[:, max(0, t.shape[1] - budget):] for t in vs]
        if shuffle_seed is not None:
            g = torch.Generator().manual_seed(int(shuffle_seed) * 7919 + layer)
            vs = [t[:, torch.randperm(t.shape[1], generator=g).to(t.device)] for t in vs]
        lengths = torch.tensor([t.shape[1] for t in ks], dtype=torch.int64, device=self.device)
        m = int(lengths.max()) if lengths.numel() else 0
        k = torch.zeros(self.batch_size, self.num_kv_heads, m, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros(self.batch_size, self.num_kv_heads, m, self.value_dim, dtype=self.dtype, device=self.device)
        for b, (kb, vb) in enumerate(zip(ks, vs)):
            k[b, :, :kb.shape[1]] = kb
            v[b, :, :vb.shape[1]] = vb
        return k, v, lengths
