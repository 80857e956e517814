"""Loading the model of a ``treadle`` command: ``--model PATH``, else ``$TREADLE_MODEL``, else the embedded
tiny model (``--quick``: the seconds-long quick one, in its own ``tiny-qwen3-quick`` slot). Every way a
checkpoint can be unusable (missing, not a causal LM, truncated weights, no tokenizer or no chat
template) is one usage error naming where the path came from (``--model`` or ``$TREADLE_MODEL``), exit 2.
"""
from __future__ import annotations

import os
from pathlib import Path

from treadle.cli_runs import usage_error

__all__ = ["load_model", "QUICK_SLOT", "model_source", "THREADS_HELP", "MAX_THREADS"]

QUICK_SLOT = "tiny-qwen3-quick"
#: the most ``--threads`` a command accepts: this machine's CPUs (more never speeds up a kernel, and a huge
#: count makes OpenMP fail to allocate its thread stacks: a segfault, not an error)
MAX_THREADS = os.cpu_count() or 1
THREADS_HELP = ("torch CPU threads (default: 1 for the embedded tiny model, whose GEMMs are too small for threads "
                f"to pay; else torch's default; 0: leave as is; at most this machine's {MAX_THREADS} CPUs).")


def model_source(model_path, flag: str = "--model") -> str:
    """Which setting gave the checkpoint: ``flag``, ``$TREADLE_MODEL`` or the embedded tiny model."""
    if model_path is not None:
        return flag
    return "$TREADLE_MODEL" if os.environ.get("TREADLE_MODEL") else "the embedded tiny model"


def load_model(model_path, quick: bool, console, *, threads: int | None = None, train_if_missing: bool = True,
               need_chat_template: bool = True, cuda: bool = True, source: str = "--model"):
    """``(model, tokenizer)`` for a command.

    Args:
        threads: torch CPU threads; 0 leaves torch's setting; None (the commands' default): 1 for the
            embedded tiny model (its GEMMs are too small for threads to pay, as in the demos), else as is.
        source: the CLI flag or argument that gives ``model_path`` (for messages).

    Raises:
        click UsageError (exit 2): the checkpoint cannot be used; the message names its source.
    """
    import torch
    from safetensors import SafetensorError

    from treadle.models.tiny import CheckpointError, TinyTrainConfig, load_default_model

    src = model_source(model_path, source)
    if threads is None:
        threads = 1 if src == "the embedded tiny model" or (quick and model_path is None) else 0
    if threads:
        torch.set_num_threads(threads)
    if quick and model_path is None:
        cfg, name, src = TinyTrainConfig.quick(), QUICK_SLOT, "the quick tiny model"
    else:
        cfg, name = None, "tiny-qwen3"
    shown = model_path
    if shown is None and src == "$TREADLE_MODEL":
        shown = os.environ.get("TREADLE_MODEL")
    prefix = f"{src} {str(shown)!r}: " if shown is not None else f"{src}: "
    try:
        model, tok = load_default_model(model_path, config=cfg, name=name, console=console, progress=False,
                                        train_if_missing=train_if_missing)
    except (CheckpointError, FileNotFoundError) as err:
        raise usage_error(prefix + str(err)) from None
    except SafetensorError as err:  # a damaged plain HF checkpoint (no treadle manifest to catch it earlier)
        where = Path(shown).expanduser() if shown is not None else Path(".")
        files = sorted(str(f) for f in where.glob("*.safetensors")) or [str(where)]
        raise usage_error(f"{prefix}could not read the model weights {', '.join(files)} (truncated or not a "
                          f"safetensors file?): {err}") from None
    except (OSError, ValueError, RuntimeError) as err:
        raise usage_error(f"{prefix}could not load the checkpoint: {err}") from None
    if need_chat_template and not getattr(tok, "chat_template", None):
        raise usage_error(f"{prefix}its tokenizer has no chat template; treadle's prompts are chat turns, so give a "
                          f"chat/instruct checkpoint (or add a chat_template to its tokenizer_config.json)")
    if cuda and torch.cuda.is_available():
        model = model.cuda()
    return model, tok
