"""Attach STAIR to a Hugging Face causal LM: the controller (STAIR sec. 3.4 / 4.4, DESIGN.md "STAIR").

How it plugs in (facts checked on transformers 5.24):

* pre-RoPE queries/keys/values: forward hooks on ``q_norm`` / ``k_norm`` (``q_proj`` / ``k_proj``
  where the model has no per-head norm; gated models carry the gate in ``q_proj``, so ``q_norm``)
  and ``v_proj`` of the controlled layers;
* the read-out is added by a custom attention function registered with ``AttentionInterface``
  **and** ``AttentionMaskInterface`` (same mask builder as the wrapped implementation, else a
  new-turn prefill on top of a cache silently gets no mask) under the name
  ``treadle_stair_<inner>``; it calls the model's own implementation (sdpa, eager, flash...) and adds
  ``dr`` to its output, i.e. before the output gate (gated models) and ``o_proj``, as the method
  requires;
* prefill vs decode: a forward with one query token over more than one key is a decode step and
  gets no read-out (prefill only; the modified prefix state carries the effect);
* STAIR's state (bank, normals, switches) lives on the controller: ``generate()`` rejects unknown
  kwargs, so nothing is passed through call arguments;
* auxiliary positions come from the model's own rotary embedding and ``apply_rotary_pos_emb``
  (partial RoPE included): bank key ``j`` gets position ``j``, a current token at input position
  ``p`` gets ``M_b + p`` (``M_b`` = its row's bank length after the prefix budget).

The controller is an ``nn.Module`` holding only its own parameters (``normals (L, Hq, D)``, or the
bank-free control's ``bias (L, Hq, Dv)``); the model is not a submodule of it and gains no
parameters, buffers or state-dict entries. :meth:`StairController.detach` restores the model
exactly (hooks removed, attention implementation restored).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from treadle.stair.arch import ArchInfo, UnsupportedModelError, inspect_model
from treadle.stair.bank import Bank, BankMismatchError, model_key

__all__ = ["attach", "StairController", "BANK_SPANS", "KINDS", "NormalsFileError", "AlreadyAttachedError",
           "read_normals_config"]

BANK_SPANS = ("assistant", "answer", "reasoning")
KINDS = ("stair", "bank_free")
_MODES = ("diff", "reflected", "reference")
_ATTR = "_treadle_stair"


class NormalsFileError(ValueError):
    """A saved normals file does not fit the controller (other model, layers, heads or shapes)."""


class AlreadyAttachedError(RuntimeError):
    """The model already has a STAIR controller attached (detach it first)."""


def _register(inner: str) -> str:
    """Register ``treadle_stair_<inner>`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"treadle_stair_{inner}"
    if name in AttentionInterface._global_mapping:
        return name
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(f"attention implementation {inner!r} is not registered with transformers")
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(inner)
    if mask_fn is None:
        raise UnsupportedModelError(f"attention implementation {inner!r} has no mask builder in AttentionMaskInterface; "
                                    f"STAIR wraps sdpa, eager, flash_attention_* or flex_attention")

    def stair_attention(module, query, key, value, attention_mask, **kwargs):
        state = getattr(module, _ATTR, None)
        if state is None:  # a layer of this model that STAIR does not control
            fn = ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager" else None
            if fn is None:
                import sys

                fn = sys.modules[type(module).__module__].eager_attention_forward
            return fn(module, query, key, value, attention_mask, **kwargs)
        ctrl, fn = state
        out, weights = fn(module, query, key, value, attention_mask, **kwargs)
        return ctrl._add_readout(module, query, key, out, kwargs), weights

    AttentionInterface.register(name, stair_attention)
    AttentionMaskInterface.register(name, mask_fn)
    return name


class StairController(nn.Module):
    """STAIR on one model; create it with :func:`attach`.

    Attributes (switches the session, trainer and evaluator flip):
        enabled: add the read-out at all (False: the model runs natively, hooks still capture).
        bank: the :class:`Bank` read by prefill steps (None: nothing read).
        budget: keep only each row's last ``budget`` bank tokens (None: all).
        mode: ``"diff"`` (STAIR), ``"reflected"`` (direct reflected read control), ``"reference"``.
        shuffle_seed: if set, V is permuted within each row's bank (K/V pairing control).
        inject_mask: optional ``(B, T)`` float/bool: the read-out is added only where it is 1
            (teacher-forced turns: the new turn's prompt tokens, as in prefill).
        bank_rows: None (a forward's batch row ``i`` reads bank row ``i``), or a list of bank row
            indices, one per batch row: a forward over a subset of a session's rows reads exactly
            those rows' banks (the bank is then trimmed to their longest row, so a single row reads
            what a session of its own would).
        capture: store the controlled layers' pre-RoPE K/V of every forward (for the bank).
        stats: counters ``readouts`` (read-outs added) and ``decode_skips`` (decode steps seen),
            counted in eager forwards only: under ``torch.compile`` a Python int that changes on
            every call is a guard that fails on every call (a recompile per forward, then a silent
            fall-back to eager after ``torch._dynamo.config.recompile_limit`` compiles).
    """

    def __init__(self, model, info: ArchInfo, layers: tuple, *, eps: float, bank_span: str, mode: str, kind: str,
                 budget: int | None, backend: str | None, seed: int):
        super().__init__()
        self.__dict__["_model"] = model  # not a submodule: the controller owns only its parameters
        self.__dict__["info"] = info
        self.layers = tuple(layers)
        self.eps, self.bank_span, self.mode, self.kind = float(eps), bank_span, mode, kind
        self.budget, self.backend, self.shuffle_seed = budget, backend, None
        self.enabled, self.capture, self.inject_mask = True, False, None
        self.bank_rows: list[int] | None = None
        self.bank: Bank | None = None
        self.stats = {"readouts": 0, "decode_skips": 0}
        self.model_key = model_key(model)
        self.model_name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        p = next(model.parameters())
        L, H, D = len(self.layers), info.num_heads, info.head_dim
        g = torch.Generator().manual_seed(int(seed))
        if kind == "stair":
            self.normals = nn.Parameter(torch.randn(L, H, D, generator=g, dtype=torch.float32).to(p.device))
        else:
            self.bias = nn.Parameter(torch.zeros(L, H, self.value_dim, dtype=torch.float32, device=p.device))
        self._q: dict = {}
        self._kv: dict = {}
        self._positions = None
        self._rot_cache: dict = {}
        self._handles: list = []
        self._orig_impl = None
        self._attached = False

    # ------------------------------------------------------------------ shapes
    @property
    def model(self):
        return self._model

    @property
    def num_heads(self) -> int:
        return self.info.num_heads

    @property
    def head_dim(self) -> int:
        return self.info.head_dim

    @property
    def value_dim(self) -> int:
        v = self.info.v_src[self.layers[0]]
        return int(v.out_features) // self.info.num_kv_heads

    @property
    def num_trainable(self) -> int:
        """Trainable parameters: ``len(layers) x Hq x D`` (``Dv`` for the bank-free control)."""
        return sum(p.numel() for p in self.parameters())

    def new_bank(self, batch_size: int) -> Bank:
        """An empty :class:`Bank` of ``batch_size`` rows that fits this controller."""
        p = next(self._model.parameters())
        return Bank(self.layers, batch_size, self.info.num_kv_heads, self.head_dim, self.value_dim, dtype=p.dtype,
                    device=p.device, key=self.model_key)

    def set_bank(self, bank: Bank | None) -> None:
        """Read ``bank`` from now on (None: no bank).

        Raises:
            BankMismatchError: the bank belongs to another model or layer set, or has other shapes.
        """
        if bank is not None:
            if not isinstance(bank, Bank):
                raise TypeError(f"bank must be a treadle.stair.Bank or None, got {type(bank).__name__}")
            if bank.key != self.model_key:
                raise BankMismatchError(f"the bank was captured from another model (fingerprint {bank.key!r}, this model "
                                        f"{self.model_key!r})")
            if tuple(bank.layers) != self.layers:
                raise BankMismatchError(f"the bank holds layers {bank.layers}, the controller controls {self.layers}")
            if (bank.num_kv_heads, bank.head_dim, bank.value_dim) != (self.info.num_kv_heads, self.head_dim,
                                                                    self.value_dim):
                raise BankMismatchError("the bank's Hkv/D/Dv differ from the model's")
        if bank is not self.bank:
            self._rot_cache.clear()
        self.bank = bank

    # ------------------------------------------------------------------ attach / detach
    def _attach(self) -> None:
        model, info = self._model, self.info
        inner = model.config._attn_implementation or "eager"
        if inner.startswith("treadle_stair_"):
            raise AlreadyAttachedError("this model already has a STAIR controller attached; detach it first")
        name = _register(inner)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = info.eager if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
        self._orig_impl = model.config._attn_implementation
        handles = []
        try:
            for li in self.layers:
                handles.append(info.q_src[li].register_forward_hook(self._q_hook(li)))
                handles.append(info.k_src[li].register_forward_hook(self._kv_hook(li, 0)))
                handles.append(info.v_src[li].register_forward_hook(self._kv_hook(li, 1)))
            handles.append(info.rotary.register_forward_pre_hook(self._rotary_hook))
            model.set_attn_implementation(name)
            for li in self.layers:
                setattr(info.attn[li], _ATTR, (self, fn))
        except Exception:
            for h in handles:
                h.remove()
            for li in self.layers:
                if hasattr(info.attn[li], _ATTR):
                    delattr(info.attn[li], _ATTR)
            if model.config._attn_implementation != self._orig_impl:
                model.set_attn_implementation(self._orig_impl)
            raise
        self._handles = handles
        self._attached = True

    def detach(self) -> None:
        """Remove every hook and restore the model's attention implementation: the model is exactly as
        before :func:`attach` (same logits bit for bit). Idempotent."""
        if not self._attached:
            return
        for h in self._handles:
            h.remove()
        self._handles = []
        for li in self.layers:
            if hasattr(self.info.attn[li], _ATTR):
                delattr(self.info.attn[li], _ATTR)
        self._model.set_attn_implementation(self._orig_impl)
        self._q.clear()
        self._kv.clear()
        self._rot_cache.clear()
        self._attached = False

    @property
    def attached(self) -> bool:
        return self._attached

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    # ------------------------------------------------------------------ hooks
    def _q_hook(self, li):
        def hook(module, args, out):
            self._q[li] = out
        return hook

    def _kv_hook(self, li, which):
        def hook(module, args, out):
            if self.capture:
                slot = self._kv.setdefault(li, [None, None])
                B, T = out.shape[0], out.shape[1]
                dim = self.head_dim if which == 0 else self.value_dim
                slot[which] = out.reshape(B, T, self.info.num_kv_heads, dim).detach()
        return hook

    def _rotary_hook(self, module, args, kwargs=None):
        if len(args) >= 2:
            self._positions = args[1]

    def captured_kv(self) -> dict:
        """layer -> ``(k (B, T, Hkv, D), v (B, T, Hkv, Dv))`` pre-RoPE K/V of the last forward
        (needs ``capture = True``)."""
        return {li: tuple(v) for li, v in self._kv.items()}

    # ------------------------------------------------------------------ the read-out
    def _bank_rotated(self, li: int, dtype: torch.dtype):
        bank = self.bank
        key = (li, bank.version, id(bank), self.budget, self.shuffle_seed, dtype)
        hit = self._rot_cache.get(key)
        if hit is not None:
            return hit
        k, v, lengths = bank.read(li, budget=self.budget, shuffle_seed=self.shuffle_seed)
        M = k.shape[2]
        if M:
            pos = torch.arange(M, device=k.device)[None]
            cos, sin = self.info.rotary(k, pos)
            k = self.info.apply_rotary(k, k, cos, sin)[0]
        hit = (k.to(dtype), v.to(dtype), lengths)
        self._rot_cache = {kk: vv for kk, vv in self._rot_cache.items() if kk[0] != li}
        self._rot_cache[key] = hit
        return hit

    def _count(self, name: str) -> None:
        if not torch.compiler.is_compiling():
            self.stats[name] += 1

    def _select_rows(self, k, v, lengths, rows, B: int):
        """Bank rows ``rows`` of a padded read, trimmed to their longest row."""
        n = self.bank.batch_size
        if len(rows) != B or not all(isinstance(r, int) and 0 <= r < n for r in rows):
            raise BankMismatchError(f"bank_rows must list {B} bank row indices in [0, {n}) (one per batch row), "
                                    f"got {rows!r}")
        idx = torch.tensor(rows, dtype=torch.long, device=k.device)
        lengths = lengths.index_select(0, idx.to(lengths.device))
        m = int(lengths.max()) if lengths.numel() else 0
        return k.index_select(0, idx)[:, :, :m], v.index_select(0, idx)[:, :, :m], lengths

    def _add_readout(self, module, query, key, out, kwargs):
        if not self.enabled:
            return out
        B, Hq, T, _ = query.shape
        if T == 1 and key.shape[2] > 1:  # a decode step: prefill only
            self._count("decode_skips")
            return out
        li = module.layer_idx
        i = self.layers.index(li)
        if self.kind == "bank_free":
            dr = self.bias[i].to(out.dtype)[None, None].expand(B, T, Hq, self.value_dim)
        else:
            if self.bank is None:
                return out
            rows = self.bank_rows
            if rows is None and self.bank.batch_size != B:
                raise BankMismatchError(f"the bank has {self.bank.batch_size} rows but the batch has {B}")
            k, v, lengths = self._bank_rotated(li, query.dtype)
            if rows is not None:
                k, v, lengths = self._select_rows(k, v, lengths, rows, B)
            if k.shape[2] == 0:
                return out
            q = self._q[li]
            q = q.reshape(B, T, Hq, self.head_dim).transpose(1, 2)
            pos = kwargs.get("position_ids")
            if pos is None:
                pos = self._positions
            if pos is None:
                raise RuntimeError("STAIR could not find the position ids of this forward")
            if pos.dim() == 3:
                pos = pos[0]
            pos = pos.to(q.device).expand(B, T) + lengths.to(q.device)[:, None]
            cos, sin = self.info.rotary(q, pos)
            q = self.info.apply_rotary(q, q, cos, sin)[0]
            from treadle.ops.stair_readout import stair_readout

            dr = stair_readout(q.to(k.dtype), k, v, self.normals[i], bank_lengths=lengths, eps=self.eps,
                               scale=float(module.scaling), mode=self.mode, backend=self.backend)
            dr = dr.transpose(1, 2)
        if self.inject_mask is not None:
            m = self.inject_mask
            if m.shape != (B, T):
                raise ValueError(f"inject_mask must have shape (B={B}, T={T}), got {tuple(m.shape)}")
            dr = dr * m.to(dr.dtype)[:, :, None, None]
        self._count("readouts")
        return out + dr.to(out.dtype)

    # ------------------------------------------------------------------ save / load
    def config_dict(self) -> dict:
        """What a saved normals file records (checked on load)."""
        return {"format": 1, "kind": self.kind, "model_name": self.model_name, "model_type": self.info.model_type,
                "model_key": self.model_key, "layers": list(self.layers), "eps": self.eps, "mode": self.mode,
                "bank_span": self.bank_span, "num_heads": self.num_heads, "num_kv_heads": self.info.num_kv_heads,
                "head_dim": self.head_dim, "value_dim": self.value_dim,
                "head_mapping": f"query head h reads kv head h // {self.num_heads // self.info.num_kv_heads}"}

    def save(self, path, extra: dict | None = None) -> Path:
        """Save the trainable parameters as safetensors with :meth:`config_dict` (and ``extra``) as metadata."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"stair_config": json.dumps(self.config_dict())}
        if extra:
            meta["extra"] = json.dumps(extra)
        tensors = {n: p.detach().to("cpu").contiguous() for n, p in self.named_parameters()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
        return path

    def load(self, path, *, strict_model: bool = True) -> dict:
        """Load parameters saved by :meth:`save`; returns the file's metadata dict.

        Raises:
            FileNotFoundError: no such file.
            NormalsFileError: not a STAIR normals file (see :func:`read_normals_config`); other kind,
                layers, heads or shapes; another model (``strict_model``). Nothing is changed when it raises.
        """
        path = Path(path)
        cfg, tensors = _read_normals(path, with_tensors=True)
        mine = self.config_dict()
        for k in ("kind", "layers", "num_heads", "num_kv_heads", "head_dim", "value_dim"):
            if cfg.get(k) != mine[k]:
                raise NormalsFileError(f"{path} was saved for {k}={cfg.get(k)!r} but this controller has {k}={mine[k]!r}; "
                                       f"refusing to load")
        if strict_model and cfg.get("model_key") != self.model_key:
            raise NormalsFileError(f"{path} was trained on another model ({cfg.get('model_name')!r}, fingerprint "
                                   f"{cfg.get('model_key')!r}); this model is {self.model_name!r} ({self.model_key!r})")
        own = dict(self.named_parameters())
        if set(tensors) != set(own) or any(tuple(tensors[n].shape) != tuple(own[n].shape) for n in own):
            raise NormalsFileError(f"{path} holds tensors {[(n, tuple(t.shape)) for n, t in tensors.items()]}, expected "
                                   f"{[(n, tuple(p.shape)) for n, p in own.items()]}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(tensors[n].to(p.device, p.dtype))
        return cfg


def read_normals_config(path) -> dict:
    """The STAIR config recorded in a normals file written by :meth:`StairController.save` (its
    ``stair_config`` metadata: kind, layers, eps, heads, ...; plus ``extra`` when saved with one), without
    loading the tensors.

    Raises:
        FileNotFoundError: no such file.
        NormalsFileError: not a STAIR normals file (not safetensors, truncated/corrupted, or no
            ``stair_config`` of format 1 in its metadata, e.g. a SCALE gates file).
    """
    return _read_normals(Path(path), with_tensors=False)[0]


def _read_normals(path: Path, *, with_tensors: bool):
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise FileNotFoundError(f"normals file {str(path)!r} does not exist"
                                + (" (it is a folder)" if path.is_dir() else ""))
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()} if with_tensors else {}
    except (SafetensorError, OSError) as err:
        raise NormalsFileError(f"{path} is not a STAIR normals file (not a readable safetensors file: {err})") from None
    try:
        cfg = json.loads(meta["stair_config"])
        if "extra" in meta:
            extra = json.loads(meta["extra"])
    except (KeyError, json.JSONDecodeError):
        raise NormalsFileError(f"{path} is not a STAIR normals file (no valid 'stair_config' in its metadata: "
                               f"not written by StairController.save)") from None
    if not isinstance(cfg, dict) or cfg.get("format") != 1:
        raise NormalsFileError(f"{path} is not a STAIR normals file (stair_config format "
                               f"{cfg.get('format') if isinstance(cfg, dict) else cfg!r}, expected 1)")
    if "extra" in meta:
        cfg["extra"] = extra
    return cfg, tensors


PAPER_LAYERS = (3, 11, 19)


def default_layers(model) -> tuple:
    """The layers ``layers="auto"`` picks: the paper's (3, 11, 19) where the model has them as
    softmax-attention layers, else up to three softmax-attention layers spread over the depth
    (e.g. (0, 2, 3) on a 4-layer model, (0, 1) on a 2-layer one).

    Raises:
        TypeError: ``model`` is not a HF model.
        UnsupportedModelError: unsupported architecture, or no softmax-attention layer.
    """
    from treadle.stair.arch import SUPPORTED, _base

    if not isinstance(model, nn.Module) or getattr(getattr(model, "config", None), "model_type", None) not in SUPPORTED:
        inspect_model(model, PAPER_LAYERS)  # raises TypeError / UnsupportedModelError naming what is supported
    full = [i for i, lay in enumerate(_base(model).layers) if isinstance(getattr(lay, "self_attn", None), nn.Module)]
    if all(i in full for i in PAPER_LAYERS):
        return PAPER_LAYERS
    if not full:
        raise UnsupportedModelError(f"{type(model).__name__} has no softmax-attention layer for STAIR to control")
    pick = sorted({full[round(j * (len(full) - 1) / 2)] for j in range(3)}) if len(full) >= 3 else full
    inspect_model(model, pick)
    return tuple(pick)


def attach(model, layers="auto", eps: float = 0.0, bank: str = "assistant", *, mode: str = "diff",
           kind: str = "stair", budget: int | None = None, backend: str | None = None,
           seed: int = 0) -> StairController:
    """Attach STAIR to ``model`` and return its controller (STAIR sec. 3.4; DESIGN.md "STAIR").

    Args:
        model: a HF causal LM: Qwen3, Qwen2, Llama, Qwen3.5 text, Qwen3-Next (see
            :data:`treadle.stair.arch.SUPPORTED`).
        layers: zero-based decoder layers to control (softmax-attention layers), or ``"auto"`` (the
            default, as the CLI's ``--layers auto``): the paper's 3, 11, 19 (also the full-attention
            layers of Qwen3.5/Qwen3-Next) where the model has them, else up to three softmax-attention
            layers spread over the depth (:func:`default_layers`), so the default works on any depth.
        eps: uniform mixing weight of ``pi_ref``, in ``[0, 1)``.
        bank: which response span the sessions bank: ``"assistant"`` (the whole response body),
            ``"answer"`` (after ``</think>``), ``"reasoning"`` (inside ``<think>...</think>``).
        mode: read-out of :func:`treadle.ops.stair_readout` (``"diff"``; ``"reflected"`` is the
            direct-read control).
        kind: ``"stair"`` (normals ``(L, Hq, D)``) or ``"bank_free"`` (the control with the same
            budget: a per-head vector ``(L, Hq, Dv)`` added to the attention output at prefill, no bank).
        budget: keep only each row's last ``budget`` bank tokens (None: all).
        backend: forced backend of the read-out op (None: the dispatch rule).
        seed: seed of the random initial normals.

    Returns:
        :class:`StairController` (the model's logits are unchanged until a non-empty bank is set).

    Raises:
        TypeError: ``model`` is not a HF model; layers are not ints (nor ``"auto"``).
        UnsupportedModelError: unsupported architecture, out-of-range or non-softmax layers.
        AlreadyAttachedError: a controller is already attached.
        ValueError: ``eps`` outside ``[0, 1)``, unknown ``bank``/``mode``/``kind``, ``budget < 1``.
            Nothing of the model is altered when it raises.
    """
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 <= float(eps) < 1.0:
        raise ValueError(f"eps must be a number in [0, 1), got {eps!r}")
    if bank not in BANK_SPANS:
        raise ValueError(f"bank must be one of {BANK_SPANS}, got {bank!r}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise ValueError(f"budget must be None (keep all) or an int >= 1 (last N bank tokens), got {budget!r}")
    if isinstance(layers, str):
        if layers.strip() != "auto":
            raise ValueError(f"layers must be 'auto' or an iterable of ints like (3, 11, 19), got {layers!r}")
        layers = default_layers(model)
    info = inspect_model(model, layers)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl.startswith("treadle_stair_") or any(hasattr(a, _ATTR) for a in info.attn.values()):
        raise AlreadyAttachedError("this model already has a STAIR controller attached; call controller.detach() first")
    ctrl = StairController(model, info, tuple(layers), eps=eps, bank_span=bank, mode=mode, kind=kind, budget=budget,
                           backend=backend, seed=seed)
    ctrl._attach()
    return ctrl
