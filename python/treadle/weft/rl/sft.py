"""``treadle model train-tiny --task tools``: the tiny tool-using policy, trained by SFT on gold trajectories.

Data: :func:`~treadle.weft.rl.worlds.episodes` (train split) played with their gold calls through the
runtime on the real shop server (:func:`~treadle.weft.rl.gold.play_gold`), rendered in the Hermes
harness, tokenised with :func:`treadle.weft.rollouts.tokens.tokenize_conversation` (loss on the
assistant's own tokens only). Model: the math model's family (tiny ``Qwen3ForCausalLM``) with the
tool tokenizer (:mod:`~treadle.weft.rl.vocab`). No system message and no tool schemas are rendered:
the tiny model's chat template has none, and the policy learns the tools from the gold calls.

Evaluation: sampled (T = 1) per-turn success on held-out atomic turns (unseen customers, products,
amounts): each held-out turn starts from the gold history and state and is sampled ``eval_samples``
times (:func:`~treadle.weft.rl.sampling.sample_groups`), plus greedy per-turn and whole-task success.

Cached like the math model: ``cache_root() / "tiny-qwen3-tools"``, same completion marker, lock and
atomic rename (:mod:`treadle.models.tiny`). The cache key is the whole :class:`ToolTrainConfig` plus
:func:`recipe_fingerprint` (the tokenizer's vocabulary and chat template and the drawn train/held-out
worlds and gold calls, written to ``tool_recipe.json``): a cached policy trained on other data, another
vocabulary or other settings is retrained on the next default load, not silently reused.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from treadle.models.tiny import (TinyLMConfig, TrainResult, build_model, clean_stale_tmp, cache_lock, save_checkpoint, cache_root,
                                 check_checkpoint, pinned_threads)

__all__ = ["ToolTrainConfig", "TOOLS_SLOT", "tool_slot", "train_tool_policy", "load_tool_model", "evaluate_policy",
           "gold_episodes", "recipe_fingerprint", "RECIPE_FILE", "ToolModelError", "check_tool_model",
           "check_tool_tokenizer"]

TOOLS_SLOT = "tiny-qwen3-tools"
RECIPE_FILE = "tool_recipe.json"


def tool_slot(out: str | os.PathLike | None, quick: bool) -> Path:
    """The tool policy's checkpoint folder: ``out``, else ``cache_root() / TOOLS_SLOT`` (``-quick`` appended
    for the quick setting, so the quick policy never replaces the default one)."""
    return Path(out).expanduser() if out is not None else cache_root() / (TOOLS_SLOT + ("-quick" if quick else ""))


_d = TinyLMConfig.default


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class ToolTrainConfig(TinyLMConfig):
    """Everything that determines the tiny tool policy (same config + seed -> same weights on one CPU):
    the fields of :class:`treadle.models.tiny.TinyLMConfig` (seed, optimizer, schedule, Qwen3 shape,
    ``max_new_tokens`` per assistant step, threads) with this recipe's defaults, plus:

    Attributes:
        train_episodes: size of the train pool (drawn once, sampled with replacement per batch; a batch
            is ``batch_size`` conversations).
        eval_episodes: held-out episodes (two atomic turns each) for the success table.
        eval_samples: sampled candidates per held-out turn (T = 1).
        max_steps: assistant steps per turn.
    """

    steps: int = _d("steps", 600)
    batch_size: int = _d("batch_size", 16)
    lr: float = _d("lr", 3e-3)
    warmup: int = _d("warmup", 40)
    hidden_size: int = _d("hidden_size", 128)
    num_layers: int = _d("num_layers", 3)
    intermediate_size: int = _d("intermediate_size", 384)
    max_new_tokens: int = _d("max_new_tokens", 72)
    train_episodes: int = Field(1200, ge=1, strict=True)
    eval_episodes: int = Field(30, ge=1, strict=True)
    eval_samples: int = Field(4, ge=2, strict=True)
    max_steps: int = Field(4, ge=1, strict=True)

    @classmethod
    def quick(cls, **overrides) -> "ToolTrainConfig":
        """A seconds-long setting for tests and ``--quick`` (the policy stays weak)."""
        kw = dict(steps=6, batch_size=4, train_episodes=12, hidden_size=32, num_layers=2, num_heads=2,
                  num_kv_heads=1, intermediate_size=64, eval_episodes=3, eval_samples=2, warmup=1,
                  max_new_tokens=24, max_steps=2)
        kw.update(overrides)
        return cls(**kw)


def recipe_fingerprint(cfg: "ToolTrainConfig", n: int = 24) -> str:
    """sha256 (16 hex digits) of what the SFT data depends on besides the config: the tool tokenizer's
    vocabulary and chat template, and the first ``n`` drawn train and held-out episodes (task JSON with
    gold calls, world SQL). Changes when templates, entity pools, the tool vocabulary or the chat format
    change (code edits that leave the data alone keep it). Cheap: no runtime, no model."""
    import hashlib
    import json

    from treadle.weft.rl.vocab import build_tool_tokenizer
    from treadle.weft.rl.worlds import episodes

    tok = build_tool_tokenizer()
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(str(tok.chat_template).encode())
    for split, start in (("train", cfg.seed * 1_000_000), ("heldout", cfg.seed * 1_000_000)):
        for e in episodes(n, split, start=start):
            h.update(e.task.model_dump_json().encode())
            h.update(e.seed_sql.encode())
    return h.hexdigest()[:16]


def _recipe_of(path: Path) -> str | None:
    import json

    try:
        return json.loads((path / RECIPE_FILE).read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _write_recipe(dest: Path, fingerprint: str) -> None:
    import json

    tmp = dest / (RECIPE_FILE + ".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint}), encoding="utf-8")
    tmp.replace(dest / RECIPE_FILE)


def gold_episodes(n: int, split: str, *, start: int = 0, verify: bool = False):
    """``n`` episodes played with their gold calls in a fresh runtime (list of GoldEpisode)."""
    import anyio

    from treadle.weft.rl.gold import play_gold, shop_server
    from treadle.weft.rl.worlds import episodes
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.runtime import Runtime

    async def main():
        async with Runtime() as rt:
            h = await shop_server(rt)
            return [await play_gold(rt, h, e, HermesHarness(), verify=verify) for e in episodes(n, split, start=start)]

    return anyio.run(main)


def _batch(samples, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), t), pad_id, dtype=torch.long)
    lab = torch.full((len(samples), t), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, :len(s.input_ids)] = torch.tensor(s.input_ids)
        lab[i, :len(s.labels)] = torch.tensor(s.labels)
    return ids, lab


def evaluate_policy(model, tokenizer, golds, *, samples: int, seed: int, max_new_tokens: int, max_steps: int = 4,
                    chunk: int = 16) -> dict:
    """Held-out success of ``model`` on the turns of ``golds`` (each from its gold history and state).

    Returns:
        ``{"turn_success_sampled", "turn_success_greedy", "task_success_greedy", "turns", "samples",
        "per_template": {template: sampled success}}``; sampled = mean verdict over ``samples``
        candidates per turn at T = 1; greedy task success = every turn of the episode passes greedily.
    """
    import anyio

    from treadle.weft.rl.gold import shop_server
    from treadle.weft.rl.sampling import HFSampler, sample_segments
    from treadle.weft.rollouts.harnesses import HermesHarness
    from treadle.weft.runtime import Runtime

    harness = HermesHarness()
    starts = [s for g in golds for s in g.starts]

    async def main():
        out = {"sampled": [], "greedy": []}
        async with Runtime() as rt:
            h = await shop_server(rt)
            for name, temp, g in (("sampled", 1.0, samples), ("greedy", 0.0, 1)):
                sampler = HFSampler(model, tokenizer, temperature=temp, max_new_tokens=max_new_tokens)
                for i in range(0, len(starts), chunk):
                    grps, _ = await sample_segments(rt, h, starts[i:i + chunk], g, sampler, tokenizer, harness,
                                                    seed=seed + i, max_steps=max_steps, replay_check=False)
                    out[name] += grps
        return out

    res = anyio.run(main)
    sampled = [c.r for grp in res["sampled"] for c in grp.candidates]
    greedy_turn = {(grp.task_id, grp.turn): grp.candidates[0].r for grp in res["greedy"]}
    tasks: dict[str, list[int]] = {}
    for (tid, _), r in greedy_turn.items():
        tasks.setdefault(tid, []).append(r)
    per_template: dict[str, list[int]] = {}
    for grp in res["sampled"]:
        per_template.setdefault(grp.template, []).extend(c.r for c in grp.candidates)
    return {"turn_success_sampled": sum(sampled) / max(len(sampled), 1),
            "turn_success_greedy": sum(greedy_turn.values()) / max(len(greedy_turn), 1),
            "task_success_greedy": sum(all(v) for v in tasks.values()) / max(len(tasks), 1),
            "turns": len(starts), "samples": samples,
            "per_template": {k: sum(v) / len(v) for k, v in sorted(per_template.items())}}


def train_tool_policy(config: ToolTrainConfig | None = None, out_dir: str | os.PathLike | None = None, *,
                      force: bool = False, progress: bool = True, console=None) -> TrainResult:
    """Train the tiny tool policy and save it (see the module docstring).

    Returns:
        :class:`treadle.models.tiny.TrainResult`; ``accuracy`` holds the held-out success numbers of
        :func:`evaluate_policy` plus ``cpu_seconds`` (process CPU time of the training).

    Raises:
        TypeError: ``config`` is not a ToolTrainConfig.
        CheckpointError / CorruptCheckpointError: as :func:`treadle.models.tiny.train_tiny`.
    """
    cfg = ToolTrainConfig() if config is None else config
    if not isinstance(cfg, ToolTrainConfig):
        raise TypeError(f"config must be a ToolTrainConfig, got {type(cfg).__name__}")
    dest = Path(out_dir).expanduser() if out_dir is not None else cache_root() / TOOLS_SLOT
    with cache_lock(dest):
        if dest.exists() and not force:
            info = check_checkpoint(dest, require_marker=True)
            return TrainResult(dest, info.get("accuracy", {}), 0.0, info.get("params", 0),
                               info.get("final_loss", float("nan")))
        clean_stale_tmp(dest, console)
        with pinned_threads(cfg.threads):
            result = _train_and_save(cfg, dest, progress, console)
    if console is not None:
        a = result.accuracy
        console.print(f"held-out ({a['turns']} atomic turns, unseen customers/products/amounts): sampled T=1 per-turn "
                      f"success {a['turn_success_sampled']:.1%} ({a['samples']} samples/turn), greedy per-turn "
                      f"{a['turn_success_greedy']:.1%}, greedy whole-task {a['task_success_greedy']:.1%}; "
                      f"per template {a['per_template']}")
        console.print(f"saved {dest}: {result.seconds:.0f} s wall, {a['cpu_seconds']:.0f} s CPU")
    return result


def _train_and_save(cfg: ToolTrainConfig, dest: Path, progress: bool, console) -> TrainResult:
    import random

    from tqdm.auto import tqdm

    from treadle.cli_output import progress_enabled  # a bar only on a terminal
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from treadle.weft.rl.vocab import build_tool_tokenizer
    from treadle.weft.rollouts.tokens import tokenize_conversation

    t0, c0 = time.perf_counter(), time.process_time()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tool_tokenizer()
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    golds = gold_episodes(cfg.train_episodes, "train", start=cfg.seed * 1_000_000)
    samples = [s for g in golds for s in tokenize_conversation(g.messages, None, tokenizer)]
    if console is not None:
        console.print(f"training tiny Qwen3 tool policy ({n_params / 1e6:.2f}M parameters, {cfg.steps} steps x "
                      f"{cfg.batch_size} conversations from {len(samples)} gold shop episodes) -> {dest}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=cfg.warmup,
                                                        num_training_steps=cfg.steps, min_lr_rate=cfg.min_lr_rate)
    rng = random.Random(cfg.seed)
    model.train()
    ema = float("nan")
    bar = tqdm(range(cfg.steps), desc="train-tiny tools", disable=not progress_enabled(progress), dynamic_ncols=True)
    for _ in bar:
        ids, labels = _batch(rng.choices(samples, k=cfg.batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=ids, labels=labels).loss  # right padding, labels -100 on pads: no mask needed
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    train_cpu, train_wall = time.process_time() - c0, time.perf_counter() - t0
    held = gold_episodes(cfg.eval_episodes, "heldout", start=cfg.seed * 1_000_000)
    acc = evaluate_policy(model, tokenizer, held, samples=cfg.eval_samples, seed=cfg.seed + 17,
                          max_new_tokens=cfg.max_new_tokens, max_steps=cfg.max_steps)
    acc.update(cpu_seconds=train_cpu, train_wall_seconds=train_wall, eval_seconds=time.perf_counter() - t0 - train_wall)
    seconds = time.perf_counter() - t0
    save_checkpoint(model, tokenizer, dest, cfg, acc, n_params, ema, seconds)
    _write_recipe(dest, recipe_fingerprint(cfg))  # after the rename: a kill in between leaves no key -> retrain
    return TrainResult(dest, acc, seconds, n_params, ema)


class ToolModelError(ValueError):
    """A checkpoint cannot be the tool policy: its tokenizer lacks what the sampler, the chat rendering or the
    update need (pad / eos token, chat template), or the model is not a causal LM of a large enough vocabulary.
    The message says what is missing."""


# one conversation of the shapes the tool policy renders: user, assistant call, tool result, assistant answer
_PROBE = [{"role": "user", "content": "Find customer ada@example.com"},
          {"role": "assistant", "content": '<tool_call>{"name": "find_customer", "arguments": {}}</tool_call>'},
          {"role": "tool", "content": '{"id": 1}'},
          {"role": "assistant", "content": "done"}]


def check_tool_tokenizer(tok) -> None:
    """Raise :class:`ToolModelError` unless ``tok`` has what the tool policy uses: a pad token (left padding of
    the sampler's batches and the update's), an eos token that ends the assistant turns the chat template
    renders (the sampler stops on it, :func:`~treadle.weft.rollouts.tokens.tokenize_conversation` cuts turns at
    it), and a chat template that renders user, assistant and ``tool`` messages, with a generation prompt."""
    missing = []
    if tok.pad_token_id is None:
        missing.append("no pad token (the sampler left-pads its batches; set tokenizer.pad_token, e.g. to the eos "
                       "token, and save it again)")
    if tok.eos_token_id is None or not tok.eos_token:
        missing.append("no eos token (the sampler stops an assistant step on it)")
    if not getattr(tok, "chat_template", None):
        missing.append("no chat template (the conversations are rendered with it; tokenizer_config.json has no "
                       "chat_template)")
    if missing:
        raise ToolModelError("the tokenizer has " + "; ".join(missing))
    try:
        text = tok.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=False)
        tok.apply_chat_template(_PROBE[:3], tokenize=False, add_generation_prompt=True)
    except Exception as err:  # jinja errors (e.g. a template that refuses the 'tool' role) are not one class
        raise ToolModelError(f"the chat template cannot render a tool conversation (user, assistant, tool "
                             f"messages): {type(err).__name__}: {' '.join(str(err).split())}") from None
    if tok.eos_token not in text:
        raise ToolModelError(f"the chat template does not end assistant turns with the eos token "
                             f"{tok.eos_token!r} (the sampler stops on it)")


def check_tool_model(path: str | os.PathLike) -> None:
    """Check a checkpoint folder as the tool policy WITHOUT loading its weights: the folder
    (:func:`treadle.models.tiny.check_checkpoint`), a causal-LM config whose vocabulary holds every token id of
    the tokenizer, and the tokenizer (:func:`check_tool_tokenizer`). Cheap: meant before any run folder is
    written.

    Raises:
        FileNotFoundError / CheckpointError: as :func:`~treadle.models.tiny.check_checkpoint`.
        ToolModelError: what the model or its tokenizer lacks.
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = Path(path).expanduser()
    check_checkpoint(p)
    try:
        config = AutoConfig.from_pretrained(p)
    except (OSError, ValueError, KeyError) as err:
        raise ToolModelError(f"config.json cannot be read as a model config: {' '.join(str(err).split())}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ToolModelError(f"model type {config.model_type!r} is not a causal language model")
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError, TypeError) as err:
        raise ToolModelError(f"no usable tokenizer in the folder: {' '.join(str(err).split())}") from None
    check_tool_tokenizer(tok)
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ToolModelError(f"the tokenizer has {len(tok)} tokens but the model's vocabulary only {vocab} "
                             f"(ids beyond it have no embedding)")


def load_tool_model(path: str | os.PathLike | None = None, *, train_if_missing: bool = True,
                    config: ToolTrainConfig | None = None, console=None, progress: bool = False,
                    name: str = TOOLS_SLOT):
    """``(model, tokenizer)`` of the tool policy: ``path`` (a checkpoint folder), else the cached
    ``cache_root() / name`` (trained with ``config`` when missing, trained with other settings, or on
    other data: see :func:`recipe_fingerprint`).

    Raises:
        FileNotFoundError: no checkpoint and ``train_if_missing`` is False.
        CheckpointError and subclasses: see :func:`treadle.models.tiny.check_checkpoint`.
        ToolModelError: ``path``'s model or tokenizer lacks what the tool policy needs (:func:`check_tool_model`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config or ToolTrainConfig()
    if path is None:
        p = cache_root() / name
        if not p.exists():
            if not train_if_missing:
                raise FileNotFoundError(f"no cached tool policy at {p}; run `treadle model train-tiny --task tools`")
            train_tool_policy(cfg, p, console=console, progress=progress)
        info = check_checkpoint(p, require_marker=True)
        if train_if_missing and (info.get("config") != cfg.as_dict() or _recipe_of(p) != recipe_fingerprint(cfg)):
            train_tool_policy(cfg, p, force=True, console=console, progress=progress)
    else:
        p = Path(path).expanduser()
        check_tool_model(p)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(p)
    check_tool_tokenizer(tok)
    return model.eval(), tok
