"""Comma-separated number lists given on the command line (``--levels 1,2,3``, ``--Ls=-4,-2``)."""
from __future__ import annotations

import typer

__all__ = ["parse_list"]


def parse_list(text: str, option: str, *, kind: type = int, example: str = "1,2,3", minimum: float | None = None,
               allow_empty: bool = False) -> tuple:
    """``"1, 2,3"`` -> ``(1, 2, 3)`` (items converted with ``kind``; blank items ignored).

    Args:
        text: the option's value.
        option: the option's name for the message, e.g. ``"--levels"``.
        kind: ``int`` or ``float``.
        example: a valid value shown in the message.
        minimum: smallest value allowed (None: any).
        allow_empty: accept ``""`` as the empty tuple.

    Raises:
        typer.BadParameter: an item that is not a ``kind``, an item below ``minimum``, or an empty list
            when ``allow_empty`` is False (exit code 2, the message names ``option``).
    """
    what = "ints" if kind is int else "numbers"
    bound = f" >= {minimum:g}" if minimum is not None else ""
    try:
        out = tuple(kind(x) for x in text.split(",") if x.strip())
        ok = (bool(out) or allow_empty) and (minimum is None or all(v >= minimum for v in out))
    except ValueError:
        ok = False
    if not ok:
        raise typer.BadParameter(f"expected comma-separated {what}{bound} like {example}, got {text!r}",
                                 param_hint=option)
    return out
