"""PNG figures for run reports (matplotlib on the non-interactive Agg backend: no display needed)."""
from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["png_figure"]


@contextlib.contextmanager
def png_figure(path: str | Path, *, figsize: tuple[float, float], dpi: int = 110):
    """A new figure with one axes, saved to ``path`` (parents created) when the block ends.

    Usage::

        with png_figure(run_dir / "plot.png", figsize=(6, 3.5)) as (fig, ax):
            ax.plot(...)

    Args:
        path: destination PNG; overwritten if present.
        figsize: ``(width, height)`` in inches.
        dpi: pixels per inch of the saved PNG.

    Raises:
        ImportError: matplotlib is not installed. Nothing is written when the block raises.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield fig, ax
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
