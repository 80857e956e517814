"""The weft-evolve demo section writes its files and prints the attribution table."""
import io
import json

from rich.console import Console

from treadle.weft.evolve.demo import run


def test_demo_section_quick(tmp_path):
    buf = io.StringIO()
    run(tmp_path, True, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "failure attribution on injected faults" in text and "reference plan R = 1.00" in text
    conf = json.loads((tmp_path / "confusion.json").read_text())
    assert conf["accuracy"] >= 0.95 and conf["observed"] >= 60
    composed = json.loads((tmp_path / "composed.json").read_text())
    assert {n["server"] for n in composed["nodes"]} == {"shop", "crm"} and composed["reference_reward"] == 1.0
    assert len((tmp_path / "certification.jsonl").read_text().splitlines()) == 17
