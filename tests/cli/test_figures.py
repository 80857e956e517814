"""treadle.figures draws through matplotlib's object API: the caller's backend and pyplot state are untouched."""
import subprocess
import sys


def test_png_figure_keeps_the_callers_backend_and_pyplot_state(tmp_path):
    code = f"""
import sys
import matplotlib
matplotlib.use("svg")
from treadle.figures import png_figure
with png_figure({str(tmp_path / 'sub' / 'a.png')!r}, figsize=(3, 2)) as (fig, ax):
    ax.plot([0, 1], [1, 0])
assert matplotlib.get_backend().lower() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    data = (tmp_path / "sub" / "a.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_png_figure_writes_nothing_when_the_block_raises(tmp_path):
    from treadle.figures import png_figure

    try:
        with png_figure(tmp_path / "b.png", figsize=(3, 2)) as (fig, ax):
            raise KeyError("x")
    except KeyError:
        pass
    assert not (tmp_path / "b.png").exists()
