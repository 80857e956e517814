"""Run folders of the training commands: checked before any work, so that a bad ``--out`` fails
fast and leaves nothing behind (no half-made folders, no model touched)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_out_dir", "make_out_dir"]


def check_out_dir(path: str | Path, name: str = "out_dir") -> Path:
    """Check that ``path`` can be a run folder, leaving nothing behind: not an existing file, no parent
    that is a file, the nearest existing ancestor writable, and the missing folders creatable (probed by
    creating and removing them).

    Returns:
        ``Path(path)`` (user-expanded).

    Raises:
        ValueError: naming ``name`` and the offending path.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name} {str(p)!r} exists and is a file, not a folder")
    q = p
    while not q.exists():
        if q.parent == q:
            break
        q = q.parent
    if q.exists() and not q.is_dir():
        raise ValueError(f"{name} {str(p)!r} cannot be created: {str(q)!r} is a file, not a folder")
    if q.exists() and not os.access(q, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {str(p)!r} is not writable (no write permission on {str(q)!r})")
    if q != p:  # probe: create the missing folders and remove them again (e.g. /proc refuses new folders)
        made = []
        try:
            for d in reversed([p, *p.parents][:[p, *p.parents].index(q)]):
                d.mkdir()
                made.append(d)
        except OSError as err:
            raise ValueError(f"{name} {str(p)!r} cannot be created: {err.strerror or err}") from None
        finally:
            for d in reversed(made):
                d.rmdir()
    return p


def make_out_dir(path: str | Path, name: str = "out_dir") -> Path:
    """:func:`check_out_dir`, then create the folder; ValueError (naming ``name``) when that fails."""
    p = check_out_dir(path, name)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{name} {str(p)!r} cannot be created: {err.strerror or err}") from None
    return p
