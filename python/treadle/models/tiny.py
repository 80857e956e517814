"""The embedded default backbone: a tiny Qwen3-architecture LM trained locally on generated problems.

:func:`train_tiny` builds a character-level tokenizer with the ``tokenizers`` library (wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template), trains a few-million-parameter
``Qwen3ForCausalLM`` on :mod:`treadle.data` problems (supervised, loss on the answer tokens only),
prints held-out greedy accuracy per difficulty level and saves a standard HF checkpoint
(``save_pretrained``: loadable with ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained``).

Checkpoints are written to ``<dest>.tmp-<pid>`` (which holds a ``.treadle-partial`` sentinel while
being written), completed with a ``treadle_checkpoint.json`` marker (config, accuracy, SHA-256 of
the weights) and only then renamed to ``<dest>``: a killed run never leaves a folder that loads
as if it were complete. :func:`load_default_model` trains the default model if the cache is empty,
or loads any local HF checkpoint instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

__all__ = ["TinyLMConfig", "TinyTrainConfig", "TrainResult", "CheckpointError", "CorruptCheckpointError", "NotACausalLMError",
           "build_tokenizer", "cache_root", "pinned_threads", "default_checkpoint_dir", "train_tiny", "load_default_model",
           "check_checkpoint", "check_weight_files", "has_tokenizer_files", "TOKENIZER_FILES", "checkpoint_vocab_size",
           "accuracy_table", "MARKER", "PARTIAL"]

MARKER = "treadle_checkpoint.json"
PARTIAL = ".treadle-partial"
DEFAULT_NAME = "tiny-qwen3"
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPECIALS = ["<|pad|>", "<|unk|>", "<|im_start|>", "<|im_end|>"]
_ROLES = ["system", "user", "assistant"]


class CheckpointError(RuntimeError):
    """A checkpoint path cannot be used (base class of the specific errors below)."""


class CorruptCheckpointError(CheckpointError):
    """A half-written or damaged checkpoint (killed run, truncated copy, edited weights)."""


class NotACausalLMError(CheckpointError, ValueError):
    """The folder holds a HF model that is not a causal LM (or no model config at all)."""


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TinyLMConfig:
    """The fields every tiny-LM recipe shares (the math model's :class:`TinyTrainConfig`, the WEFT tool
    policy's :class:`treadle.weft.rl.sft.ToolTrainConfig`): seed, optimizer and schedule, Qwen3 shape,
    decoding budget, threads. Defaults are the math recipe's; a recipe changes one with
    :meth:`default` (which keeps the field's constraints).

    A frozen pydantic dataclass (``dataclasses.asdict`` works): bad values raise ``pydantic.ValidationError``
    (a ``ValueError``) naming the field, before anything is trained.

    Attributes:
        seed: seeds the data stream and the initialisation.
        steps: optimizer steps; batch_size: training examples per step.
        lr, warmup, weight_decay, grad_clip: AdamW with linear warm-up over ``warmup`` steps, then
            cosine decay to ``min_lr_rate * lr`` (``transformers.get_cosine_with_min_lr_schedule_with_warmup``).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: Qwen3 shape (head_dim =
            hidden_size / num_heads).
        max_new_tokens: decoding budget for evaluation.
        threads: torch intra-op threads while training (restored afterwards). Pinned, like the STAIR
            and SCALE demos, so that the float reductions, and so the weights, do not depend on the
            machine's core count; one thread is also the fastest on a shared 2-core machine (OpenMP
            spinning costs more than it gives on these tiny GEMMs).
    """

    seed: int = Field(0, ge=0, strict=True)
    steps: int = Field(1500, ge=1, strict=True)
    batch_size: int = Field(32, ge=1, strict=True)
    lr: float = Field(2e-3, gt=0, allow_inf_nan=False)
    min_lr_rate: float = Field(0.1, ge=0, le=1)
    warmup: int = Field(100, ge=0, strict=True)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    hidden_size: int = Field(192, ge=1, strict=True)
    num_layers: int = Field(4, ge=1, strict=True)
    num_heads: int = Field(4, ge=1, strict=True)
    num_kv_heads: int = Field(2, ge=1, strict=True)
    intermediate_size: int = Field(512, ge=1, strict=True)
    max_new_tokens: int = Field(10, ge=1, strict=True)
    threads: int = Field(1, ge=1, strict=True)

    @classmethod
    def default(cls, name: str, value):
        """Field ``name`` of this config with another default and the same constraints (for a subclass:
        ``steps: int = TinyLMConfig.default("steps", 600)``)."""
        from pydantic.fields import FieldInfo

        return FieldInfo.merge_field_infos(cls.__pydantic_fields__[name], default=value)

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyLMConfig":
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads}) and "
                             f"num_heads by num_kv_heads ({self.num_kv_heads})")
        return self

    def as_dict(self) -> dict:
        """JSON-ready fields (what the checkpoint's marker records and is compared against)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TinyTrainConfig(TinyLMConfig):
    """Everything that determines the trained tiny math model (same config + seed -> same weights on one
    CPU): the fields of :class:`TinyLMConfig` plus the data mixture.

    Attributes:
        level_weights: training mixture, level -> relative weight (held-out prompts never trained on;
            levels 5-6 are left out by default: the tiny model does not learn them in the budget, and
            level 6's long prompts would set every batch's padded width).
        final_fraction, final_level_weights: a final phase (data annealing): the last
            ``round(final_fraction * steps)`` optimizer steps draw their problems from
            ``final_level_weights`` instead (0: no final phase). It lands at the cosine schedule's
            low learning rates, so it consolidates the levels it weights without a separate schedule.
        eval_per_level: held-out problems per level for the accuracy table.
        pack_width: row width in tokens of the packed training batches
            (:func:`treadle.models.packing.packed_sft_batch`: whole conversations packed into rows,
            each attending only to itself); 0: one right-padded row per problem (the earlier
            layout, the same loss up to float rounding but about 20% padding).
    """

    level_weights: dict[int, float] = Field(default_factory=lambda: {1: 4.0, 2: 4.0, 3: 3.0, 4: 3.0})
    final_fraction: float = Field(0.2, ge=0, lt=1)
    final_level_weights: dict[int, float] | None = Field(default_factory=lambda: {1: 3.0, 2: 2.0, 3: 1.0, 4: 1.0})
    eval_per_level: int = Field(100, ge=1, strict=True)
    pack_width: int = Field(96, ge=0, strict=True)

    @classmethod
    def quick(cls, **overrides) -> "TinyTrainConfig":
        """A seconds-long setting for tests and ``--quick`` smoke runs (the model stays weak)."""
        kw = dict(steps=8, batch_size=16, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                  intermediate_size=64, eval_per_level=4, warmup=2)
        kw.update(overrides)
        return cls(**kw)

    @field_validator("level_weights", "final_level_weights")
    @classmethod
    def _levels_exist(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        from treadle.data.arithmetic import difficulty

        if v is None:
            return v
        if not v or any(w < 0 for w in v.values()) or not sum(v.values()) > 0:
            raise ValueError(f"level_weights must map difficulty levels to weights >= 0 with a positive sum, got {v}")
        for lv in v:
            difficulty(int(lv))
        return v

    @model_validator(mode="after")
    def _final_phase(self) -> "TinyTrainConfig":
        if self.final_fraction and self.final_level_weights is None:
            raise ValueError(f"final_fraction={self.final_fraction} needs final_level_weights (the final phase's "
                             f"mixture)")
        return self

    @property
    def final_steps(self) -> int:
        """Optimizer steps in the final phase: ``round(final_fraction * steps)``."""
        return round(self.final_fraction * self.steps)


@dataclass
class TrainResult:
    """What :func:`train_tiny` did: ``path`` of the checkpoint, held-out ``accuracy`` per level,
    ``seconds`` of wall time, ``params`` (parameter count), ``final_loss``."""

    path: Path
    accuracy: dict
    seconds: float
    params: int
    final_loss: float


# --------------------------------------------------------------------------------------------
# tokenizer, cache
# --------------------------------------------------------------------------------------------
def build_tokenizer(extra_tokens: Sequence[str] = (), model_max_length: int = 512):
    """A character-level ``PreTrainedTokenizerFast`` with a ChatML chat template, built locally.

    Vocabulary: ``<|pad|> <|unk|> <|im_start|> <|im_end|>`` (special), the roles ``system user
    assistant`` as single tokens, then printable ASCII and newline, one token per character, then
    ``extra_tokens`` (one token each, matched longest-first anywhere in the text; the tool policy's
    vocabulary extension, :mod:`treadle.weft.rl.vocab`). ``eos_token`` is ``<|im_end|>``; padding is on
    the left (for batched generation).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(_SPECIALS + _ROLES + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(_SPECIALS)
    tok.add_tokens(_ROLES + list(extra_tokens))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", unk_token="<|unk|>",
                                   eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE, padding_side="left",
                                   model_max_length=model_max_length)


def cache_root() -> Path:
    """``$TREADLE_CACHE`` if set, else ``~/.cache/treadle``."""
    env = os.environ.get("TREADLE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "treadle"


def default_checkpoint_dir(name: str = DEFAULT_NAME) -> Path:
    """Where the default tiny model lives: ``cache_root() / name`` (``tiny-qwen3``)."""
    return cache_root() / name


def _sha256(path: Path) -> str:
    from treadle.run_dirs import file_sha256

    return file_sha256(path)


def check_checkpoint(path: str | os.PathLike, *, require_marker: bool = False) -> dict | None:
    """Check a checkpoint folder before loading it.

    Args:
        path: the folder.
        require_marker: True for treadle's own cache folders: a missing completion marker then
            means a half-written checkpoint.

    Returns:
        The completion marker's content, or None for a foreign HF checkpoint (no marker).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NotACausalLMError: not a folder, or no ``config.json`` (and no treadle marker).
        CorruptCheckpointError: a ``.treadle-partial`` sentinel (killed while writing), a missing
            marker where one is required, or weights whose size/SHA-256 differ from the marker's.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint path {str(p)!r} does not exist; give a local Hugging Face checkpoint "
                                f"folder (config.json + weights), or omit it to use the default tiny model")
    if not p.is_dir():
        raise NotACausalLMError(f"checkpoint path {str(p)!r} is a file; expected a Hugging Face checkpoint folder")
    marker = p / MARKER
    if (p / PARTIAL).exists():
        raise CorruptCheckpointError(f"{p} is a half-written checkpoint (a training run was killed while saving it); "
                                     f"delete it, or run {_retrain_hint(p)}")
    if not marker.exists():
        if require_marker:
            if not any(p.iterdir()):  # an empty folder: --overwrite trains into it
                raise CorruptCheckpointError(f"{p} is an empty folder, not a checkpoint (no {MARKER}); delete it, "
                                             f"or run {_retrain_hint(p)}")
            # non-empty without a marker: the user's files, or a checkpoint whose marker was removed; either way
            # refuse_foreign_folder keeps --overwrite from replacing it, so never suggest --overwrite here
            raise CorruptCheckpointError(f"{p} has no completion marker ({MARKER}): it is not a treadle checkpoint "
                                         f"(or a damaged one), and treadle never replaces such a non-empty folder, "
                                         f"even with --overwrite; move its files away or delete it yourself, or use "
                                         f"another folder")
        if not (p / "config.json").exists():
            raise NotACausalLMError(f"{p} has no config.json: not a Hugging Face model checkpoint")
        return None
    try:
        info = json.loads(marker.read_text())
        files = info["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"{marker} is unreadable ({err}); delete {p} and retrain "
                                     f"({_retrain_hint(p)})") from None
    for name, meta in files.items():
        f = p / name
        if not f.exists():
            raise CorruptCheckpointError(f"{p} is missing {name}, listed in its completion marker; delete it and retrain "
                                         f"({_retrain_hint(p)})")
        if f.stat().st_size != meta["size"] or _sha256(f) != meta["sha256"]:
            raise CorruptCheckpointError(f"{f} does not match the size/SHA-256 recorded when it was saved (truncated or "
                                         f"modified); delete {p} and retrain ({_retrain_hint(p)})")
    return info


#: files from which ``AutoTokenizer`` builds a real tokenizer; without any of them transformers silently builds
#: a tokenizer of one token (no error), so a checkpoint needs at least one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer_config.json")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether checkpoint folder ``path`` holds any of :data:`TOKENIZER_FILES`."""
    p = Path(path).expanduser()
    return any((p / name).is_file() for name in TOKENIZER_FILES)


def check_weight_files(path: str | os.PathLike) -> None:
    """Check, without loading them, that a checkpoint folder's weights are present and complete: some weight
    file exists, every shard an index lists exists, and each ``*.safetensors`` file is as long as its header
    says (a copy cut short fails here, not halfway through loading).

    Raises:
        CorruptCheckpointError: no weights, a missing shard, or a truncated / unreadable safetensors file.
    """
    p = Path(path).expanduser()
    for index in p.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CorruptCheckpointError(f"{index} is not a readable weight index ({err})") from None
        missing = sorted(s for s in shards if not (p / s).is_file())
        if missing:
            raise CorruptCheckpointError(f"{p} is missing the weight shard(s) {', '.join(missing)} listed in "
                                         f"{index.name}")
    weights = sorted(p.glob("*.safetensors"))
    if not weights and not any(p.glob("*.bin")) and not any(p.glob("*.pt")) and not any(p.glob("*.pth")):
        raise CorruptCheckpointError(f"{p} has no weight files (*.safetensors, pytorch_model*.bin)")
    for f in weights:
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 8 + n <= size else None
            if header is None:
                raise ValueError("its header runs past the end of the file")
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise CorruptCheckpointError(f"{f} is not a readable safetensors file (truncated or damaged: "
                                         f"{err})") from None
        if 8 + n + end > size:
            raise CorruptCheckpointError(f"{f} is truncated: {size} bytes, its header describes {8 + n + end}")


def refuse_foreign_folder(dest: str | os.PathLike) -> None:
    """Refuse to replace ``dest`` when it is a non-empty folder that is not a treadle checkpoint (neither a
    completion marker nor a half-written sentinel): it holds the user's files, which ``force`` /
    ``--overwrite`` must never delete.

    Raises:
        NotACausalLMError: ``dest`` is such a folder (or a file).
    """
    p = Path(dest).expanduser()
    if p.is_file():
        raise NotACausalLMError(f"{p} is a file, not a checkpoint folder")
    if p.is_dir() and any(p.iterdir()) and not (p / MARKER).exists() and not (p / PARTIAL).exists():
        raise NotACausalLMError(f"{p} is a non-empty folder that is not a treadle checkpoint (no {MARKER}); it is "
                                f"never replaced, even with --overwrite: give a new or empty folder")


def _retrain_hint(p: Path) -> str:
    """The command that retrains checkpoint folder ``p`` in place (its slot's flags, ``--overwrite``)."""
    flags = {DEFAULT_NAME: "", DEFAULT_NAME + "-quick": " --quick", DEFAULT_NAME + "-tools": " --task tools"}
    if p.parent.resolve() == cache_root().resolve() and p.name in flags:
        return f"`treadle model train-tiny{flags[p.name]} --overwrite`"
    return f"`treadle model train-tiny --out {p} --overwrite`"


#: seconds to wait for another process training into the same folder before giving up
LOCK_TIMEOUT = 1800.0


@contextlib.contextmanager
def cache_lock(dest: Path, timeout: float | None = None):
    """Hold ``<parent>/.<name>.lock`` (``filelock.FileLock``) while training or checking ``dest``.

    Raises:
        CheckpointError: the folder's parent cannot be created or the lock file cannot be written
            (unwritable path), or another process held the lock for ``timeout`` seconds.
    """
    from filelock import FileLock, Timeout

    timeout = LOCK_TIMEOUT if timeout is None else timeout
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(lock_path), timeout=timeout)
        lock.acquire()
    except Timeout:
        raise CheckpointError(f"another process has been training into {dest} for over {timeout:.0f} s "
                              f"(lock {lock_path}); wait for it, or choose another folder") from None
    except OSError as err:
        raise CheckpointError(f"cannot write the checkpoint folder {dest}: {err.strerror or err}; "
                              f"choose a writable folder") from None
    try:
        yield
    finally:
        lock.release()


def clean_stale_tmp(dest: Path, console) -> None:
    """Remove ``<dest>.tmp-<pid>`` folders left by training processes that no longer run."""
    for stale in dest.parent.glob(f"{dest.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        alive = pid.isdigit() and int(pid) != os.getpid() and Path(f"/proc/{pid}").exists()
        if not alive:
            if console is not None:
                console.print(f"[yellow]removing {stale}: a partial checkpoint left by a killed run[/yellow]")
            shutil.rmtree(stale, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------
def build_model(cfg: TinyLMConfig, tokenizer):
    """A freshly initialised tiny causal LM of ``cfg``'s architecture for ``tokenizer``'s vocabulary."""
    from treadle.models.builders import build_tiny_model

    model = build_tiny_model(
        "qwen3", seed=cfg.seed, vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def sft_batch(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch: ``input_ids (B, T)``, ``attention_mask (B, T)``, ``labels (B, T)``
    (right-padded; labels are -100 except on the answer and its ``<|im_end|>``)."""
    rows, labels = [], []
    for p in problems:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}], tokenize=False,
                                               add_generation_prompt=True)
        pid = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        aid = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(pid + aid)
        labels.append([-100] * len(pid) + aid)
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), t), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, :len(r)] = torch.tensor(r)
        lab[i, :len(r)] = torch.tensor(lb)
        mask[i, :len(r)] = 1
    return ids, mask, lab


def _sft_loss(model, tokenizer, problems, pack_width: int) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens of ``problems`` (one training step's loss).

    ``use_cache=False``: no KV cache is built while training. ``pack_width > 0``: packed rows
    (block-diagonal attention from the restarting ``position_ids``) and the last layer's MLP only
    where the loss looks (:mod:`treadle.models.packing`). 0: right-padded rows; pads come after every
    real token and carry label -100, so causal attention needs no mask.
    """
    from treadle.models.packing import last_mlp_on_loss_positions, packed_sft_batch

    if not pack_width:
        ids, _, labels = sft_batch(tokenizer, problems)
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    ids, labels, positions = packed_sft_batch(tokenizer, problems, pack_width)
    with last_mlp_on_loss_positions(model, labels):
        return model(input_ids=ids, labels=labels, position_ids=positions, use_cache=False).loss


def _heldout_sets(cfg: TinyTrainConfig) -> dict[int, list]:
    from treadle.data.arithmetic import LEVELS, ProblemGenerator

    gen = ProblemGenerator(cfg.seed + 10_007)
    return {lv: gen.batch(lv, cfg.eval_per_level, split="heldout") for lv in range(1, len(LEVELS) + 1)}


@contextlib.contextmanager
def pinned_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)``; the previous count is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train_tiny(config: TinyTrainConfig | None = None, out_dir: str | os.PathLike | None = None, *, force: bool = False,
               progress: bool = True, console=None) -> TrainResult:
    """Train the tiny Qwen3 LM and save it as a HF checkpoint (see the module docstring).

    Args:
        config: training settings (default :class:`TinyTrainConfig`: about 1.6M parameters,
            1500 steps of 32 problems on one pinned thread, the last 300 weighted towards levels 1-2;
            packed rows; 258-261 s of process CPU time on one Xeon core measured under load 14-16,
            evaluation and save included).
        out_dir: destination folder (default :func:`default_checkpoint_dir`).
        force: replace an existing checkpoint at ``out_dir`` (otherwise an existing complete one is
            kept and returned without training).
        progress: show a tqdm progress bar.
        console: a rich Console for messages and the accuracy table (None: silent).

    Returns:
        :class:`TrainResult`.

    Raises:
        TypeError: ``config`` is not a TinyTrainConfig.
        CheckpointError: ``out_dir`` cannot be written, or another process holds its lock for longer
            than :data:`LOCK_TIMEOUT` seconds.
        CorruptCheckpointError: ``out_dir`` holds a damaged checkpoint and ``force`` is False.
        NotACausalLMError: ``force`` and ``out_dir`` is a non-empty folder that is not a treadle
            checkpoint (the user's files are never replaced).
    """
    cfg = TinyTrainConfig() if config is None else config
    if not isinstance(cfg, TinyTrainConfig):
        raise TypeError(f"config must be a TinyTrainConfig, got {type(cfg).__name__}")
    dest = Path(out_dir).expanduser() if out_dir is not None else default_checkpoint_dir()
    if force:
        refuse_foreign_folder(dest)  # before any work: the user's files are never replaced
    with cache_lock(dest):
        if dest.exists() and not force:
            info = check_checkpoint(dest, require_marker=True)
            return TrainResult(dest, {int(k): v for k, v in info.get("accuracy", {}).items()}, 0.0,
                               info.get("params", 0), info.get("final_loss", float("nan")))
        clean_stale_tmp(dest, console)
        with pinned_threads(cfg.threads):
            result = _train_and_save(cfg, dest, progress, console)
    if console is not None:
        console.print(accuracy_table(result.accuracy, title=f"held-out greedy accuracy ({cfg.eval_per_level} per level)"))
        console.print(f"saved {dest} in {result.seconds:.0f} s")
    return result


def _train_and_save(cfg: TinyTrainConfig, dest: Path, progress: bool, console) -> TrainResult:
    from tqdm.auto import tqdm
    from treadle.cli_output import progress_enabled  # a bar only on a terminal
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from treadle.data.arithmetic import ProblemGenerator
    from treadle.models.generation import accuracy_by_level

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = build_model(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    if console is not None:
        console.print(f"training tiny Qwen3 ({n_params / 1e6:.2f}M parameters, {cfg.steps} steps x "
                      f"{cfg.batch_size} problems, seed {cfg.seed}, {cfg.threads} thread(s)) -> {dest}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    # fused: one kernel for all parameters instead of a loop of small ops per tensor (same update)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98), fused=True)
    sched = get_cosine_with_min_lr_schedule_with_warmup(opt, num_warmup_steps=cfg.warmup,
                                                        num_training_steps=cfg.steps, min_lr_rate=cfg.min_lr_rate)
    gen = ProblemGenerator(cfg.seed)
    weights = {int(k): float(v) for k, v in cfg.level_weights.items() if v > 0}
    final = {int(k): float(v) for k, v in (cfg.final_level_weights or {}).items() if v > 0}
    model.train()
    ema = float("nan")
    bar = tqdm(range(cfg.steps), desc="train-tiny", disable=not progress_enabled(progress), dynamic_ncols=True)
    first_final = cfg.steps - cfg.final_steps
    for step in bar:
        mix = final if step >= first_final else weights
        loss = _sft_loss(model, tokenizer, gen.mixture(cfg.batch_size, mix, split="train"), cfg.pack_width)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    accuracy = accuracy_by_level(model, tokenizer, _heldout_sets(cfg), max_new_tokens=cfg.max_new_tokens)
    seconds = time.perf_counter() - t0
    save_checkpoint(model, tokenizer, dest, cfg, accuracy, n_params, ema, seconds)
    return TrainResult(dest, accuracy, seconds, n_params, ema)


def save_checkpoint(model, tokenizer, dest: Path, cfg: TinyTrainConfig, accuracy: dict, n_params: int, loss: float,
                    seconds: float) -> None:
    """Write a trained tiny model into ``dest`` whole or not at all (a temporary folder, then a rename)."""
    tmp = dest.parent / f"{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / PARTIAL).write_text("written by treadle.models.tiny; removed when the checkpoint is complete\n")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(tmp.iterdir()) if f.is_file() and f.name not in (PARTIAL, MARKER)}
    info = {"format": 1, "config": cfg.as_dict(), "accuracy": {str(k): v for k, v in accuracy.items()},
            "params": n_params, "final_loss": loss, "train_seconds": seconds, "files": files,
            "torch": torch.__version__}
    (tmp / MARKER).write_text(json.dumps(info, indent=1))
    (tmp / PARTIAL).unlink()
    with contextlib.suppress(FileNotFoundError):
        os.sync()
    refuse_foreign_folder(dest)  # last guard (every trainer saves here): never delete a folder that is not ours
    if dest.exists():  # force: move the old one aside first, so dest is never half-populated
        old = dest.parent / f"{dest.name}.old-{os.getpid()}"
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)


def checkpoint_vocab_size(path: str | os.PathLike) -> int | None:
    """The vocabulary size of a local HF checkpoint's text model, read through
    ``AutoConfig.from_pretrained(path).get_text_config()`` (so nested ``text_config`` s of multimodal
    configs, e.g. Qwen3.5's, are found); None when the config has no ``vocab_size``.

    Raises:
        NotACausalLMError: ``path`` holds no loadable model config.
    """
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(Path(path).expanduser())
    except (OSError, ValueError) as err:
        raise NotACausalLMError(f"{path} is not a loadable Hugging Face model config: {err}") from None
    vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    return int(vocab) if vocab else None


def accuracy_table(accuracy: dict, *, title: str = "accuracy per difficulty level"):
    """A rich Table of level -> accuracy, with each level's knobs."""
    from rich.table import Table

    from treadle.data.arithmetic import difficulty

    t = Table(title=title)
    for col in ("level", "kind", "digits", "ops", "depth", "distractors", "accuracy"):
        t.add_column(col, justify="right")
    for lv, acc in sorted(accuracy.items()):
        d = difficulty(int(lv))
        t.add_row(str(lv), d.kind, str(d.digits), str(d.ops), str(d.depth), str(d.distractors), f"{acc:.0%}")
    return t


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def load_default_model(path: str | os.PathLike | None = None, *, train_if_missing: bool = True,
                       config: TinyTrainConfig | None = None, name: str = DEFAULT_NAME, console=None,
                       progress: bool = True):
    """The default backbone/policy: a local HF checkpoint, or the cached tiny model (trained on demand).

    Args:
        path: any local Hugging Face causal-LM checkpoint folder; None -> ``$TREADLE_MODEL`` when
            set (and ``name`` is the default), else the tiny model in ``cache_root() / name``.
        train_if_missing: train the tiny model (:func:`train_tiny` with ``config``) when the cache
            folder does not exist, or retrain it when it was trained with other settings than
            ``config`` (e.g. by an older treadle).
        config: training settings used when training is needed.
        name: cache folder name (the default model is ``tiny-qwen3``).

    Returns:
        ``(model, tokenizer)``: the model in eval mode on CPU, float32.

    Raises:
        FileNotFoundError: ``path`` does not exist; or the cache is empty and ``train_if_missing``
            is False.
        NotACausalLMError: ``path`` is not a causal-LM checkpoint.
        CorruptCheckpointError: a half-written/damaged checkpoint (the message says how to fix it).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if path is None and name == DEFAULT_NAME and os.environ.get("TREADLE_MODEL"):
        path = os.environ["TREADLE_MODEL"]
    if path is None:
        dest = cache_root() / name
        if not dest.exists():
            if not train_if_missing:
                raise FileNotFoundError(f"no cached tiny model at {dest}; run `treadle model train-tiny` first")
            train_tiny(config, dest, console=console, progress=progress)
        info = check_checkpoint(dest, require_marker=True)
        want = (config or TinyTrainConfig()).as_dict()
        if train_if_missing and info.get("config") != want:
            if console is not None:
                console.print(f"[yellow]{dest} was trained with other settings than the current default; "
                              f"retraining[/yellow]")
            train_tiny(config or TinyTrainConfig(), dest, force=True, console=console, progress=progress)
            check_checkpoint(dest, require_marker=True)
        p = dest
    else:
        p = Path(path).expanduser()
        check_checkpoint(p)
    try:
        cfg = AutoConfig.from_pretrained(p)
    except (OSError, ValueError) as err:
        raise NotACausalLMError(f"{p} is not a loadable Hugging Face model config: {err}") from None
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise NotACausalLMError(f"{p} holds a {cfg.model_type!r} model ({type(cfg).__name__}), which is not a causal LM "
                                f"(AutoModelForCausalLM cannot load it)")
    if not (p / MARKER).exists():
        check_weight_files(p)  # a foreign checkpoint: weights present and not cut short (treadle's: SHA-256 above)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as err:
        raise CorruptCheckpointError(f"could not load the weights in {p}: {err}") from None
    if not has_tokenizer_files(p):
        raise CheckpointError(f"{p} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save the model's "
                              f"tokenizer into the folder (tokenizer.save_pretrained)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError, TypeError) as err:
        raise CheckpointError(f"could not load a tokenizer from {p}: {err}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer
