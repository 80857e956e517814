"""What the ``treadle`` commands print, and what they keep third-party libraries from printing.

- :func:`make_console`: a rich Console that wraps at the terminal's width on a terminal, and does not
  wrap at 80 columns when the output is a file or a pipe (tables keep their rows on one line).
- :func:`quiet_third_party`: silences transformers' and huggingface_hub's progress bars and info
  logs ("Loading weights ...") and the FutureWarning / DeprecationWarning noise of transformers, peft
  and trl in our commands (``PYTHONWARNINGS`` given by the user wins; ``TREADLE_VERBOSE=1`` keeps all).
- :func:`progress_enabled`: tqdm bars only on a terminal (never a tqdm stream in a log file).
"""
from __future__ import annotations

import os
import sys
import warnings

from rich.console import Console

__all__ = ["make_console", "quiet_third_party", "progress_enabled", "PIPE_WIDTH"]

# width of tables and rules when the output is not a terminal (COLUMNS, when set, wins)
PIPE_WIDTH = 200


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def make_console(stderr: bool = False) -> Console:
    """A rich Console for command output: the terminal's width on a terminal; on a file or a pipe
    :data:`PIPE_WIDTH` columns (or ``$COLUMNS``) and no soft wrapping of long lines."""
    stream = sys.stderr if stderr else sys.stdout
    if _is_terminal(stream) or os.environ.get("COLUMNS"):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)


def progress_enabled(requested: bool = True) -> bool:
    """Whether to draw tqdm progress bars: asked for, and stderr is a terminal."""
    return bool(requested) and _is_terminal(sys.stderr)


def quiet_third_party() -> None:
    """Silence third-party progress bars, info logs and deprecation warnings for this process.

    Environment variables are set only when the user has not set them (so that they act on libraries
    imported later too); already-imported libraries are told directly. Nothing is done with
    ``TREADLE_VERBOSE=1``.
    """
    if os.environ.get("TREADLE_VERBOSE", "") not in ("", "0"):
        return
    for key, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                       ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    if not sys.warnoptions:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"(transformers|peft|trl|accelerate)(\.|$)")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
