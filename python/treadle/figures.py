"""PNG figures for run reports, through matplotlib's object API (``matplotlib.figure.Figure``):
no backend is selected and no pyplot state is touched, so a script or notebook that imports treadle
keeps its own matplotlib backend and figures."""
from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["png_figure"]


@contextlib.contextmanager
def png_figure(path: str | Path, *, figsize: tuple[float, float], dpi: int = 110, ncols: int = 1):
    """A new figure with one axes (or a row of ``ncols``), saved to ``path`` (parents created) when the block ends.

    Usage::

        with png_figure(run_dir / "plot.png", figsize=(6, 3.5)) as (fig, ax):
            ax.plot(...)

    The figure is a standalone ``matplotlib.figure.Figure`` (``fig.subplots()``, ``fig.savefig()``):
    ``matplotlib.use`` is never called and pyplot is never imported.

    Args:
        path: destination PNG; overwritten if present.
        figsize: ``(width, height)`` in inches.
        dpi: pixels per inch of the saved PNG.
        ncols: axes side by side; with more than one, ``ax`` is their array.

    Raises:
        ImportError: matplotlib is not installed. Nothing is written when the block raises.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    ax = fig.subplots(1, ncols) if ncols > 1 else fig.subplots()
    yield fig, ax
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
