"""Row-keyed sampling for TRL's transformers generation: a row's tokens do not depend on the other rows of its
batch, so a GRPO run on N data-parallel ranks samples what one process samples on the same global batch.

Why sampling is not rank-independent by itself: ``generate(do_sample=True)`` draws the next token of every row
from one random stream (``torch.multinomial`` over the whole ``(rows, vocab)`` tensor), so a row's draws depend
on how many rows come before it in its batch and how many decoding steps the batch runs; two ranks with half the
rows each (and seeding per rank does not change this) draw other tokens than one process with all of them.
Here each row gets its own generator, seeded by :func:`row_keys` (the run's seed, the trainer's global step, the
row's unpadded context ids and its occurrence among identical contexts in the call), and the next token is the
Gumbel-max draw ``argmax(warped scores / T + Gumbel noise)``, which is a sample of ``softmax(scores / T)``
after transformers' own top-k / top-p / min-p warpers, under greedy decoding. Rows of one GRPO group (TRL
repeats a prompt ``num_generations`` times in a row, and keeps a group on one rank when the per-device batch
is a multiple of it) then get the same keys on any number of ranks; prompts that are identical across groups
of one batch get distinct keys whose order depends on the split. What remains rank-dependent is the float
rounding of batched logits (left padding to another width), which flips a draw only at a near-tie. The
generators live on the logits' device (a key draws another stream on CUDA than on CPU; the ranks of one job
share a device type).

:class:`RowKeyedSampling` is a ``transformers.TrainerCallback``: at ``on_train_begin`` it wraps the trained
model's ``generate`` (the object TRL's ``unwrap_model_for_generation`` yields) so that sampling calls decode
greedily with :class:`RowGumbel`; non-sampling calls pass through. vLLM generation (``use_vllm=True``) does
not go through ``generate`` and is left as it is.
"""
from __future__ import annotations

import copy
import hashlib
import json

import torch
from transformers import TrainerCallback

__all__ = ["row_keys", "RowGumbel", "RowKeyedSampling"]


def row_keys(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seed: int, step: int) -> list[int]:
    """One 63-bit key per row of a generate call: a hash of ``seed``, ``step``, the row's unpadded context ids
    and its occurrence among the rows of the call with identical context ids."""
    ids = input_ids.tolist()
    masks = attention_mask.tolist() if attention_mask is not None else [[1] * len(r) for r in ids]
    seen: dict[bytes, int] = {}
    out = []
    for row, mask in zip(ids, masks):
        digest = hashlib.sha256(json.dumps([t for t, m in zip(row, mask) if m]).encode()).digest()
        k = seen.get(digest, 0)
        seen[digest] = k + 1
        h = hashlib.sha256(digest + f"|{int(seed)}|{int(step)}|{k}".encode()).digest()
        out.append(int.from_bytes(h[:8], "little") >> 1)
    return out


class RowGumbel:
    """A logits processor: ``warp(scores / T) + Gumbel noise`` with one generator per row (seeded by its key),
    so that greedy decoding (argmax) samples each row from ``softmax(warp(scores / T))`` with the row's own
    stream. ``warpers``: transformers logits warpers (top-k, top-p, min-p) applied after the temperature."""

    def __init__(self, keys: list[int], temperature: float = 1.0, warpers=()):
        if not temperature or temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature!r}")
        self.keys = list(keys)
        self.gens: list[torch.Generator] | None = None
        self.temperature = float(temperature)
        self.warpers = list(warpers)

    def noise(self, vocab: int, device=None) -> torch.Tensor:
        """The next Gumbel draws of every row, ``(rows, vocab)`` float64, on ``device`` (the generators live on
        the device of the first call: no host-to-device copy per token)."""
        if self.gens is None:
            dev = torch.device(device) if device is not None else torch.device("cpu")
            self.gens = [torch.Generator(device=dev).manual_seed(k) for k in self.keys]
        dev = self.gens[0].device if self.gens else device
        u = torch.stack([torch.rand(vocab, generator=g, dtype=torch.float64, device=dev) for g in self.gens])
        return -torch.log(-torch.log(u.clamp_min(1e-300)))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = scores.double() / self.temperature
        for w in self.warpers:
            s = w(input_ids, s)
        return (s + self.noise(scores.shape[-1], s.device).to(s.device)).to(scores.dtype)


def _warpers(gc) -> list:
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = []
    if gc.top_k is not None and gc.top_k > 0:
        out.append(TopKLogitsWarper(int(gc.top_k)))
    if gc.top_p is not None and gc.top_p < 1.0:
        out.append(TopPLogitsWarper(float(gc.top_p)))
    if getattr(gc, "min_p", None):
        out.append(MinPLogitsWarper(float(gc.min_p)))
    return out


class RowKeyedSampling(TrainerCallback):
    """A ``TrainerCallback`` that makes the trainer's sampling row-keyed (see the module docstring):
    ``GRPOTrainer(..., callbacks=[RowKeyedSampling()])``. ``seed``: default the ``TrainingArguments.seed``.
    Subclasses may override :meth:`processor` (what decodes a call's rows)."""

    def __init__(self, seed: int | None = None):
        self.seed = seed
        self.step = 0
        self._wrapped = None

    def processor(self, keys: list[int], generation_config, input_ids, attention_mask):
        """The logits processor of one sampling call (default :class:`RowGumbel`)."""
        return RowGumbel(keys, generation_config.temperature or 1.0, _warpers(generation_config))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.seed is None:
            self.seed = args.seed
        self.step = state.global_step
        if model is not None and self._wrapped is not model:
            self._install(model)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step

    def on_train_end(self, args, state, control, model=None, **kwargs):
        m, self._wrapped = self._wrapped, None
        if m is not None and "generate" in vars(m):
            del m.generate

    def _install(self, model) -> None:
        from transformers import LogitsProcessorList

        original = model.generate
        hook = self

        def generate(*args, generation_config=None, logits_processor=None, **kw):
            gc = generation_config if generation_config is not None else model.generation_config
            input_ids = kw.get("input_ids", args[0] if args else None)
            if not gc.do_sample or input_ids is None:
                return original(*args, generation_config=generation_config, logits_processor=logits_processor, **kw)
            keys = row_keys(input_ids, kw.get("attention_mask"), hook.seed, hook.step)
            proc = hook.processor(keys, gc, input_ids, kw.get("attention_mask"))
            greedy = copy.deepcopy(gc)
            greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p = False, None, None, None
            if hasattr(greedy, "min_p"):
                greedy.min_p = None
            return original(*args, generation_config=greedy,
                            logits_processor=LogitsProcessorList([*(logits_processor or []), proc]), **kw)

        model.generate = generate
        self._wrapped = model
