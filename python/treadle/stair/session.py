"""Multi-turn chat sessions with a STAIR bank (STAIR sec. 3.4: each earlier response feeds the bank).

A :class:`StairSession` runs ``B`` conversations side by side (rows), turn by turn, over a KV
cache: :meth:`StairSession.generate` (prefill the new user turn with the read-out on, then decode
natively, token by token) and the teacher-forced :meth:`StairSession.forward` (prompt and a given
response in one pass; the read-out is added on the prompt tokens only, as in a prefill). After each
turn the controlled layers' pre-RoPE K/V of the response span (see ``bank`` in
:func:`treadle.stair.attach`) are appended to each row's bank, detached, in order; a turn never reads
its own tokens.

Rows have ragged lengths: each new segment is right-aligned to the longest row and the padding
stays in the cache as masked holes (2-D attention mask over the whole cache, explicit position ids),
so every row's positions are its own. A pad token cannot be hidden from a recurrent layer (the Gated
DeltaNet layers of Qwen3.5 / Qwen3-Next: transformers drops their padding mask once a cache exists,
and a zero input still shifts the conv state and decays the recurrent state), so for models with
any non-softmax layer (:func:`has_recurrent_layers`) a forward never feeds a pad token before a
real one: rows whose segments have different lengths run as separate forwards, one per length,
each over a copy of its rows' cache, with the controller reading only those rows' banks
(:attr:`treadle.stair.StairController.bank_rows`); the results are scattered back into the shared
cache, in the same right-aligned layout (holes in the softmax layers' keys/values, each row's own
conv/recurrent state). Rows fed nothing in a forward (rows that finished decoding) run on pad
tokens whose keys/values are holes, and their recurrent states are put back afterwards. So each row
gets what a session of its own would get, while equal-length forwards (every decode step) stay one
batched forward. Softmax-only models always take the single batched forward.

Turns are rendered with the tokenizer's chat template; the template must be prefix-stable
(rendering a conversation plus one more message extends the earlier rendering), which ChatML
templates are.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

__all__ = ["StairSession", "TurnResult", "ContextOverflowError", "has_recurrent_layers"]

#: ``config.layer_types`` entries that are softmax attention (anything else is recurrent/linear).
_SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


class ContextOverflowError(ValueError):
    """A turn would run past the model's context (``max_position_embeddings``)."""


def has_recurrent_layers(model) -> bool:
    """True when some decoder layer of ``model`` is not softmax attention (e.g. the Gated DeltaNet
    ``linear_attention`` layers of Qwen3.5 / Qwen3-Next), read from ``config.layer_types`` and from
    the decoder layers themselves (a layer without a ``self_attn`` module). Such layers cannot skip
    padded tokens, so :class:`StairSession` never pads their rows."""
    types = getattr(model.config, "layer_types", None) or ()
    if any(t not in _SOFTMAX_LAYER_TYPES for t in types):
        return True
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers is not None and any(not isinstance(getattr(lay, "self_attn", None), torch.nn.Module)
                                      for lay in layers)


@dataclass
class TurnResult:
    """One generated turn.

    Attributes:
        texts: ``B`` decoded responses (special tokens removed).
        token_ids: ``B`` lists of generated ids (EOS included when generated).
        prefill_seconds: wall time of the prefill forward (with the read-out when enabled).
        bank_tokens: bank tokens per row after the turn.
    """

    texts: list
    token_ids: list
    prefill_seconds: float
    bank_tokens: list


class StairSession:
    """``B`` chat conversations over one KV cache, with a STAIR bank when a controller is given.

    Ragged rows are exact for softmax-only and for hybrid linear-attention models (see the module
    docstring); :attr:`model_calls` counts the model forwards the session made.

    Args:
        model: the HF causal LM (the controller's model when ``controller`` is given).
        tokenizer: its tokenizer (chat template; ``eos_token_id``; ``pad_token_id`` or EOS used as pad).
        controller: a :class:`treadle.stair.StairController` or None (a plain native session).
        batch_size: ``B`` rows.
        stair: add the read-out in this session (False: native, but the bank is still built, so
            that a native session can be compared on the same states).
        bank_budget: overrides ``controller.budget`` for this session's reads.

    Raises:
        ValueError: ``batch_size < 1``; the controller belongs to another model.
    """

    def __init__(self, model, tokenizer, controller=None, *, batch_size: int = 1, stair: bool = True,
                 bank_budget: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if controller is not None and controller.model is not model:
            raise ValueError("controller is attached to another model than `model`")
        self.model, self.tokenizer, self.controller = model, tokenizer, controller
        self.batch_size, self.stair, self.bank_budget = batch_size, bool(stair), bank_budget
        self.device = next(model.parameters()).device
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.recurrent = has_recurrent_layers(model)
        self.cache = None
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.model_calls = 0
        self.next_pos = [0] * batch_size
        self.pending: list[list[int]] = [[] for _ in range(batch_size)]
        self.messages: list[list[dict]] = [[] for _ in range(batch_size)]
        self.bank = controller.new_bank(batch_size) if controller is not None else None
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self._think = (vocab.get("<think>"), vocab.get("</think>"))
        self.turns = 0

    # ------------------------------------------------------------------ sizes
    @property
    def bank_tokens(self) -> list[int]:
        """Bank tokens per row."""
        return self.bank.lengths if self.bank is not None else [0] * self.batch_size

    @property
    def bank_bytes(self) -> int:
        """Bytes held by the bank (keys + values of all controlled layers and rows)."""
        return self.bank.nbytes if self.bank is not None else 0

    # ------------------------------------------------------------------ text -> segments
    def _render(self, messages, gen: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _prompt_ids(self, row: int, user: str) -> list[int]:
        before = self._render(self.messages[row], False)
        after = self._render(self.messages[row] + [{"role": "user", "content": user}], True)
        if not after.startswith(before):
            raise ValueError("the tokenizer's chat template is not prefix-stable (rendering one more message changes "
                             "the earlier text), so a session cannot extend its cache turn by turn")
        return self.pending[row] + self._encode(after[len(before):])

    def _closing_ids(self, row: int, user: str, body: str, generated_eos: bool) -> list[int]:
        msgs = self.messages[row] + [{"role": "user", "content": user}]
        start = self._render(msgs, True)
        full = self._render(msgs + [{"role": "assistant", "content": body}], False)
        tail = full[len(start):]
        closing = tail[len(body):] if tail.startswith(body) else ""
        ids = self._encode(closing)
        if generated_eos and ids and ids[0] == self.eos:
            ids = ids[1:]
        return ids

    def _span(self, ids: list[int]) -> list[bool]:
        """Which of a response's ids go into the bank (``controller.bank_span``)."""
        kind = self.controller.bank_span if self.controller is not None else "assistant"
        open_id, close_id = self._think
        out, inside, seen_close = [], False, False
        for t in ids:
            if t in (self.eos, self.pad) or t in (open_id, close_id):
                if t == open_id:
                    inside = True
                elif t == close_id:
                    inside, seen_close = False, True
                out.append(False)
                continue
            if kind == "assistant":
                out.append(True)
            elif kind == "reasoning":
                out.append(inside)
            else:  # answer
                out.append(not inside)
        if kind == "answer" and close_id is not None and close_id in ids:
            cut = ids.index(close_id)
            out = [o and i > cut for i, o in enumerate(out)]
        return out

    # ------------------------------------------------------------------ forward over one segment
    def _check_room(self, lengths: list[int], extra: int = 0) -> None:
        if not self.max_positions:
            return
        for b, n in enumerate(lengths):
            if self.next_pos[b] + n + extra > self.max_positions:
                raise ContextOverflowError(f"row {b}: the conversation would reach position {self.next_pos[b] + n + extra} "
                                           f"but the model's context is {self.max_positions} tokens "
                                           f"(max_position_embeddings); start a new session or shorten the turn")

    def _run(self, rows: list[int], segs, S: int, mask, cache, *, read: bool, inject, grad: bool):
        """One model forward over batch rows ``rows`` (segments right-aligned to ``S``) on ``cache``
        (those rows only) with attention mask ``mask (len(rows), L)``; returns (logits (G, S, V),
        captured K/V or None, the cache)."""
        G = len(rows)
        ids = torch.full((G, S), self.pad, dtype=torch.long)
        real = torch.zeros(G, S, dtype=torch.bool)
        pos = torch.zeros(G, S, dtype=torch.long)
        for i, r in enumerate(rows):
            s = segs[r]
            if s:
                ids[i, S - len(s):] = torch.tensor(s)
                real[i, S - len(s):] = True
                pos[i, S - len(s):] = torch.arange(self.next_pos[r], self.next_pos[r] + len(s))
            pos[i, :S - len(s)] = self.next_pos[r]
        mask = torch.cat([mask, real.long().to(self.device)], dim=1)
        ctrl = self.controller
        if ctrl is not None:
            ctrl.enabled = read and self.stair
            ctrl.capture = True
            ctrl.set_bank(self.bank)
            saved_budget = ctrl.budget
            if self.bank_budget is not None:
                ctrl.budget = self.bank_budget
            ctrl.bank_rows = None if G == self.batch_size else list(rows)
            ctrl.inject_mask = None if inject is None else inject[rows][:, inject.shape[1] - S:].to(self.device)
        if grad and cache is not None:
            _unpin_recurrent_states(cache)
        try:
            with torch.set_grad_enabled(grad):
                out = self.model(input_ids=ids.to(self.device), attention_mask=mask, position_ids=pos.to(self.device),
                                 cache=cache, use_cache=True)
            self.model_calls += 1
            kv = dict(ctrl.captured_kv()) if ctrl is not None else None
        finally:
            if ctrl is not None:
                ctrl.inject_mask = None
                ctrl.bank_rows = None
                ctrl.capture = False
                ctrl.enabled = True
                if self.bank_budget is not None:
                    ctrl.budget = saved_budget
        return out.logits, kv, out.cache

    def _forward(self, segs: list[list[int]], *, read: bool, inject=None, cache=None, grad: bool = False):
        """Feed one segment per row (possibly empty), right-aligned to the longest, ``S``.

        Returns ``(logits (B, S, V), real (B, S) bool, kv, cache)``: ``kv`` is layer ->
        ``(k (B, S, Hkv, D), v (B, S, Hkv, Dv))`` captured pre-RoPE K/V (None without a controller),
        ``cache`` the extended cache (``S`` more positions for every row). Uses ``cache`` (default:
        the session's, which may be extended in place) and does not change the session's
        bookkeeping. Models with recurrent layers run one forward per distinct non-zero segment
        length (see the module docstring); the logits of rows fed nothing are meaningless."""
        B = self.batch_size
        S = max(len(s) for s in segs)
        real = torch.zeros(B, S, dtype=torch.bool)
        for b, s in enumerate(segs):
            real[b, S - len(s):] = bool(s)
        cache = self.cache if cache is None else cache
        lengths = sorted({len(s) for s in segs if s})
        empty = [b for b in range(B) if not segs[b]]
        if not self.recurrent or (len(lengths) == 1 and (not empty or cache is not None)):
            saved = _row_states(cache, empty) if self.recurrent and empty else None
            logits, kv, cache = self._run(list(range(B)), segs, S, self.mask, cache, read=read, inject=inject,
                                          grad=grad)
            if saved is not None:  # the rows fed only pads get their recurrent states back
                _put_row_states(cache, empty, saved)
            return logits, real, kv, cache
        parts = []
        for n in lengths:
            rows = [b for b in range(B) if len(segs[b]) == n]
            idx = torch.tensor(rows, dtype=torch.long)
            sub = None if cache is None else _cache_rows(cache, lambda t: t.index_select(0, idx.to(t.device)))
            logits, kv, sub = self._run(rows, segs, n, self.mask[idx.to(self.mask.device)], sub, read=read,
                                        inject=inject, grad=grad)
            parts.append((rows, logits, kv, sub))
        cache = _scatter_caches(cache, [(rows, len(segs[rows[0]]), sub) for rows, _, _, sub in parts], B, S)
        logits = _stack_rows([(rows, lg) for rows, lg, _, _ in parts], B, S)
        kv = None
        if parts[0][2] is not None:
            kv = {li: tuple(_stack_rows([(rows, kvp[li][j]) for rows, _, kvp, _ in parts], B, S) for j in (0, 1))
                  for li in parts[0][2]}
        return logits, real, kv, cache

    def _advance(self, segs, real, cache) -> None:
        self.cache = cache
        self.mask = torch.cat([self.mask, real.long().to(self.device)], dim=1)
        for b, s in enumerate(segs):
            self.next_pos[b] += len(s)

    # ------------------------------------------------------------------ turns
    def _users(self, user) -> list[str]:
        users = [user] * self.batch_size if isinstance(user, str) else list(user)
        if len(users) != self.batch_size or not all(isinstance(u, str) for u in users):
            raise ValueError(f"user must be a str or a list of {self.batch_size} str, got {user!r}")
        return users

    @torch.no_grad()
    def generate(self, user, *, max_new_tokens: int = 16, temperature: float = 0.0, seed: int = 0) -> TurnResult:
        """One turn: prefill the user message(s) (read-out on), decode natively, bank the response.

        Args:
            user: one message for every row, or ``B`` messages.
            max_new_tokens: decoding budget.
            temperature: 0 = greedy; > 0 = sampling. Sampling noise is Gumbel noise drawn from a
                generator seeded with ``(seed, step)``, so sessions that share seeds and shapes draw
                the same noise whatever the logits (conditions share sampling seeds).
            seed: sampling seed.

        Returns:
            :class:`TurnResult`.

        Raises:
            ValueError: bad ``user``/``max_new_tokens``/``temperature``.
            ContextOverflowError: the turn could run past the context; nothing is changed.
        """
        import time

        users = self._users(user)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        segs = [self._prompt_ids(b, u) for b, u in enumerate(users)]
        self._check_room([len(s) for s in segs], extra=max_new_tokens)
        t0 = time.perf_counter()
        logits, real, kv, cache = self._forward(segs, read=True)
        prefill_s = time.perf_counter() - t0
        captured = [(kv, torch.zeros_like(real))]
        self._advance(segs, real, cache)
        B = self.batch_size
        gen: list[list[int]] = [[] for _ in range(B)]
        active = [True] * B
        nxt = self._pick(logits[:, -1], temperature, seed, 0)
        step = 0
        while any(active):
            feed = [[int(nxt[b])] if active[b] else [] for b in range(B)]
            for b in range(B):
                if active[b]:
                    gen[b].append(int(nxt[b]))
            logits, real, kv, cache = self._forward(feed, read=True)  # decode: the controller skips it
            span = torch.tensor([[bool(feed[b]) and self._span(gen[b])[-1]] for b in range(B)])
            captured.append((kv, span))
            self._advance(feed, real, cache)
            step += 1
            for b in range(B):
                if active[b] and (gen[b][-1] == self.eos or len(gen[b]) >= max_new_tokens):
                    active[b] = False
            if any(active):
                nxt = self._pick(logits[:, -1], temperature, seed, step)
        self._commit(captured)
        texts = []
        for b in range(B):
            body_ids = [t for t in gen[b] if t != self.eos]
            body = self.tokenizer.decode(body_ids, skip_special_tokens=True)
            texts.append(body)
            self.pending[b] = self._closing_ids(b, users[b], body, bool(gen[b]) and gen[b][-1] == self.eos)
            self.messages[b] += [{"role": "user", "content": users[b]}, {"role": "assistant", "content": body}]
        self.turns += 1
        return TurnResult(texts, gen, prefill_s, self.bank_tokens)

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, seed: int, step: int) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + step)
        u = torch.rand(logits.shape, generator=g, dtype=torch.float32).clamp_(1e-10, 1 - 1e-10)
        gumbel = -torch.log(-torch.log(u)).to(logits.device)
        return (logits.float() / temperature + gumbel).argmax(-1)

    def _commit(self, captured) -> None:
        if self.bank is None:
            return
        kvs = [c for c in captured if c[0]]
        if not kvs:
            return
        layers = kvs[0][0].keys()
        kv = {li: (torch.cat([c[0][li][0] for c in kvs], 1), torch.cat([c[0][li][1] for c in kvs], 1)) for li in layers}
        span = torch.cat([c[1] for c in kvs], 1)
        self.bank.append(kv, span)

    def forward(self, user, assistant, *, inject: str = "prompt", grad: bool = False, native_too: bool = False):
        """One teacher-forced turn: prompt + the given response in one pass; bank the response.

        Args:
            user, assistant: one message for every row, or ``B`` messages each.
            inject: ``"prompt"`` (read-out on the prompt tokens only, as in a prefill) or ``"all"``.
            grad: build the autograd graph (training); the session's cache is detached afterwards.
            native_too: also compute the native logits on the same inputs and prefix (no read-out,
                no grad), for ``KL(native || stair)``.

        Returns:
            dict with ``logits (B, S, V)``, ``native_logits`` (or None), ``labels (B, S)`` int64
            (the next token at response positions, -100 elsewhere; the position predicting the
            first response token is the last prompt token), ``prompt_mask (B, S)`` bool.

        Raises:
            ValueError: bad messages or ``inject``; ContextOverflowError (nothing is changed).
        """
        users, answers = self._users(user), self._users(assistant)
        if inject not in ("prompt", "all"):
            raise ValueError(f"inject must be 'prompt' or 'all', got {inject!r}")
        prompts = [self._prompt_ids(b, u) for b, u in enumerate(users)]
        bodies = [self._encode(a) for a in answers]
        closings = [self._closing_ids(b, u, a, False) for b, (u, a) in enumerate(zip(users, answers))]
        segs = [p + bd + c for p, bd, c in zip(prompts, bodies, closings)]
        self._check_room([len(s) for s in segs])
        S = max(len(s) for s in segs)
        B = self.batch_size
        prompt_mask = torch.zeros(B, S, dtype=torch.bool)
        labels = torch.full((B, S), -100, dtype=torch.long)
        span = torch.zeros(B, S, dtype=torch.bool)
        for b in range(B):
            off = S - len(segs[b])
            n_p, n_b = len(prompts[b]), len(bodies[b])
            prompt_mask[b, off:off + n_p] = True
            target = bodies[b] + ([self.eos] if closings[b] and closings[b][0] == self.eos else [])
            for j, t in enumerate(target):
                labels[b, off + n_p - 1 + j] = t
            sp = self._span(bodies[b])
            span[b, off + n_p:off + n_p + n_b] = torch.tensor(sp, dtype=torch.bool) if sp else span[b, :0]
        native = None
        if native_too:
            with torch.no_grad():
                native = self._forward(segs, read=False, cache=copy.deepcopy(self.cache))[0]
        inj = prompt_mask.float() if inject == "prompt" else None
        logits, real, kv, cache = self._forward(segs, read=True, inject=inj, grad=grad)
        if grad:
            _detach_cache(cache)
        self._advance(segs, real, cache)
        if self.bank is not None and kv:
            self.bank.append(kv, span)
        for b in range(B):
            self.pending[b] = []  # the closing was fed in this pass
            self.messages[b] += [{"role": "user", "content": users[b]}, {"role": "assistant", "content": answers[b]}]
        self.turns += 1
        return {"logits": logits, "native_logits": native, "labels": labels.to(logits.device),
                "prompt_mask": prompt_mask.to(logits.device)}

    def repeat(self, n: int) -> "StairSession":
        """A new session whose row ``i * n + j`` continues row ``i`` (``n`` samples per row); shares no
        mutable state with this one."""
        out = StairSession(self.model, self.tokenizer, self.controller, batch_size=self.batch_size * n,
                           stair=self.stair, bank_budget=self.bank_budget)
        if self.cache is not None:
            out.cache = _cache_rows(self.cache, lambda t: t.repeat_interleave(n, 0))
        out.mask = self.mask.repeat_interleave(n, 0)
        out.next_pos = [p for p in self.next_pos for _ in range(n)]
        out.pending = [list(p) for p in self.pending for _ in range(n)]
        out.messages = [list(m) for m in self.messages for _ in range(n)]
        if self.bank is not None:
            out.bank = self.bank.repeat_rows(n)
        out.turns = self.turns
        return out


def _stack_rows(parts, B: int, S: int) -> torch.Tensor:
    """Stack per-part ``(G, S_g, ...)`` tensors into ``(B, S, ...)``: row ``rows[i]`` gets part row
    ``i`` left-padded with zeros to ``S``; rows in no part are zeros. Differentiable."""
    like = parts[0][1]
    out = [None] * B
    for rows, t in parts:
        pad = [0, 0] * (t.dim() - 2) + [S - t.shape[1], 0]
        for i, r in enumerate(rows):
            out[r] = torch.nn.functional.pad(t[i], pad)
    zero = like.new_zeros((S, *like.shape[2:]))
    return torch.stack([zero if o is None else o for o in out])


_ROW_TENSORS = ("keys", "values")              # softmax layers (DynamicLayer): (B, Hkv, L, D)
_ROW_STATES = ("conv_states", "recurrent_states")  # linear-attention layers: state index -> (B, ...)


def _row_tensors(cache):
    """Every per-row tensor (batch first) a HF cache holds, as ``(kind, tensor)`` with kind ``"kv"``
    (softmax keys/values, ``(B, Hkv, L, D)``) or ``"state"`` (a linear-attention layer's conv or
    recurrent state, fixed size), in a fixed order.

    Raises:
        TypeError: a cache layer holds tensors of a kind this function does not know."""
    for layer in cache.layers if cache is not None else []:
        for name, val in vars(layer).items():
            if isinstance(val, torch.Tensor):
                if val.dim() == 0:  # a scalar setting (e.g. a sliding window size), not per row
                    continue
                if name not in _ROW_TENSORS:
                    raise TypeError(f"cannot split rows of a {type(layer).__name__} cache layer (tensor {name!r})")
                yield "kv", val
            elif isinstance(val, dict) and any(isinstance(t, torch.Tensor) for t in val.values()):
                if name not in _ROW_STATES:
                    raise TypeError(f"cannot split rows of a {type(layer).__name__} cache layer (states {name!r})")
                yield from (("state", t) for t in val.values() if isinstance(t, torch.Tensor))


def _cache_rows(cache, fn):
    """A deep copy of a HF cache whose per-row tensors are ``fn(tensor)`` (e.g. ``index_select`` or
    ``repeat_interleave`` on dim 0). Works for softmax and linear-attention (conv/recurrent state)
    layers; transformers' own ``batch_select_indices`` skips the latter."""
    memo = {id(t): fn(t) for _, t in _row_tensors(cache)}  # deepcopy puts these in place of the originals
    return copy.deepcopy(cache, memo)


def _scatter_caches(cache, parts, B: int, S: int):
    """The ``B``-row cache after a forward run as separate parts ``[(rows, n, sub_cache)]``, each
    part having fed its rows ``n`` tokens on a row selection of ``cache`` (None: no cache yet).

    Keys/values get ``S`` more positions, each part's ``n`` new ones right-aligned (the rest are
    holes, masked by the session's mask); recurrent states are the part's for its rows and the old
    ones (zeros without a cache: the state of an empty prefix) for rows in no part. Differentiable.

    Raises:
        TypeError: a cache layer does not keep every position (e.g. a sliding-window layer)."""
    old = list(_row_tensors(cache)) if cache is not None else None
    subs = [(rows, n, list(_row_tensors(sub))) for rows, n, sub in parts]
    template = subs[0][2]
    memo = {}
    for i, (kind, t) in enumerate(template):
        ot = old[i][1] if old is not None else None
        if kind == "kv":
            L = ot.shape[2] if ot is not None else 0
            new = t.new_zeros((B, t.shape[1], L + S, *t.shape[3:]))
            if ot is not None:
                new[:, :, :L] = ot
            for rows, n, tensors in subs:
                st = tensors[i][1]
                if st.shape[2] != L + n:
                    raise TypeError(f"a cache layer holds {st.shape[2]} positions after feeding {n} tokens to {L}: "
                                    f"rows of layers that drop positions (sliding windows) cannot be scattered")
                new[rows, :, L + S - n:] = st[:, :, L:]
        else:
            new = ot.clone() if ot is not None else t.new_zeros((B, *t.shape[1:]))
            for rows, _, tensors in subs:
                new[rows] = tensors[i][1]
        memo[id(t)] = new
    return copy.deepcopy(parts[0][2], memo)


def _row_states(cache, rows: list[int]) -> list:
    """Copies of the recurrent (conv/recurrent) states of batch rows ``rows``."""
    idx = torch.tensor(rows, dtype=torch.long)
    return [t.index_select(0, idx.to(t.device)) for kind, t in _row_tensors(cache) if kind == "state"]


def _put_row_states(cache, rows: list[int], saved: list) -> None:
    """Write :func:`_row_states` copies back into rows ``rows`` of ``cache``'s states, in place."""
    idx = torch.tensor(rows, dtype=torch.long)
    states = [t for kind, t in _row_tensors(cache) if kind == "state"]
    for t, v in zip(states, saved, strict=True):
        t.index_copy_(0, idx.to(t.device), v)


def _unpin_recurrent_states(cache) -> None:
    """Before a forward that builds a graph: make linear-attention layers store their new recurrent
    state in a fresh tensor. transformers reads the cached state as the chunked delta rule's initial
    state (which autograd saves) and then overwrites that same tensor in place (``copy_``), which
    breaks backward ("modified by an inplace operation") whenever a recurrent layer lies downstream
    of a controlled layer (Qwen3.5 layers 4..10 after layer 3). Marking the state uninitialised makes
    the cache allocate a new one on update; the forward still reads the old one."""
    for layer in cache.layers:
        flags = getattr(layer, "is_recurrent_states_initialized", None)
        if isinstance(flags, dict):
            for i in flags:
                flags[i] = False


def _detach_cache(cache) -> None:
    """Detach every tensor held by a HF cache in place (keys/values, and linear-attention layers'
    conv/recurrent states, which are dicts of tensors)."""
    for layer in getattr(cache, "layers", []) if cache is not None else []:
        for name, val in list(vars(layer).items()):
            if isinstance(val, torch.Tensor) and val.requires_grad:
                setattr(layer, name, val.detach())
            elif isinstance(val, dict):
                for k, t in list(val.items()):
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        val[k] = t.detach()
