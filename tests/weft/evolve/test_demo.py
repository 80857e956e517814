"""The weft-evolve demo section writes its files and prints the attribution table."""
import io
import json

from rich.console import Console

from treadle.weft.evolve.demo import run


def test_demo_section_quick(tmp_path):
    buf = io.StringIO()
    run(tmp_path, True, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "failure attribution on the fault catalogue" in text and "reference plan R = 1.00" in text
    assert text.index("held-apart fault set") < text.index("failure attribution on the fault catalogue")
    held = json.loads((tmp_path / "heldout.json").read_text())
    assert held["accuracy"] >= 0.9 and held["blamed_on_policy"] == held["policy_blamed_elsewhere"] == []
    assert "of which composed cross-server (ada-across-shop-and-crm): 21 of 21 correct (16 wrong bindings" in text
    conf = json.loads((tmp_path / "confusion.json").read_text())
    assert conf["accuracy"] >= 0.95 and conf["observed"] >= 60
    composed = json.loads((tmp_path / "composed.json").read_text())
    assert {n["server"] for n in composed["nodes"]} == {"shop", "crm"} and composed["reference_reward"] == 1.0
    assert len((tmp_path / "certification.jsonl").read_text().splitlines()) == 17
    cases = [json.loads(x) for x in (tmp_path / "faults.jsonl").read_text().splitlines()]
    composed = [c for c in cases if c["id"].startswith("composed/")]
    # every composed fault kind is in the table: 16 task faults (5 wrong bindings, 4 in free text, 3 dropped edges,
    # 4 cycles) and 5 policy cases (a node skipped), each observed and attributed to what was injected
    kinds = {c["id"].split("/")[2].split(":")[1] for c in composed}
    assert kinds == {"wrong_binding", "unbound_text", "dropped_edge", "cycle", "skipped_node"}
    assert len(composed) == 21 and all(c["observed"] for c in composed)
    assert all(c["attribution"]["blame"] == c["label"] for c in composed)
    assert sum(c["label"] == "task" for c in composed) == 16
