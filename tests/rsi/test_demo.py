import io

import pytest
from rich.console import Console


@pytest.mark.slow
def test_demo_section_quick(tmp_path):
    from treadle.rsi.demo import run

    buf = io.StringIO()
    out = run(tmp_path, True, Console(file=buf, width=120))
    assert set(out) == {"tiny-model", "capacity"}
    for name in out:
        assert (tmp_path / name / "curve.png").stat().st_size > 1000
        assert (tmp_path / name / "problems.jsonl").exists()
        assert len(out[name]["curve"]) == 3
    assert out["capacity"]["curve"][-1] < out["capacity"]["curve"][0]
    assert "RSI difficulty curve" in buf.getvalue()
