"""Stored state the CLI reads back (``state.json`` of an RSI run; ``run.json`` is covered with the run-folder
guards): a hand-edited or truncated file of the wrong shape is one clear error, and the folder is left as it is."""
import pytest

from treadle.rsi.loop import LoopConfig
from treadle.rsi.math_tasks import make_seeds
from treadle.rsi.runs import RunMismatchError, run


@pytest.fixture(scope="module")
def rsi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rsi") / "r"
    run(out, make_seeds(4, 0), (), LoopConfig(rounds=1))
    return out


@pytest.mark.parametrize("state", ["[]", "{}", '{"round": "1"}', '{"round": -1}', "{" * 10_000, '{"round": 1}',
                                   '{"round": 1, "harness": 5, "h0": {}, "chains": [], "curve": 1, "curve_ci": 2}'])
def test_an_rsi_state_json_of_the_wrong_shape_is_one_line(rsi_run, state):
    good = (rsi_run / "state.json").read_text()
    try:
        (rsi_run / "state.json").write_text(state)
        with pytest.raises(RunMismatchError, match="not a readable run state") as ei:
            run(rsi_run, make_seeds(4, 0), (), LoopConfig(rounds=2))
        assert "\n" not in str(ei.value)
        assert (rsi_run / "state.json").read_text() == state
    finally:
        (rsi_run / "state.json").write_text(good)


# ---- every JSON file a run stored and a command reads back: one clear error, the file left as it is ----------
@pytest.mark.parametrize("text, words", [
    ("", "does not read as JSON"), ("{", "does not read as JSON"), ("{" * 100_000, "does not read as JSON"),
    ("[1, 2]", "holds a JSON list"), ('"text"', "holds a JSON str"), ("\xff\xfe", "does not read as JSON"),
])
def test_a_stored_json_file_of_the_wrong_shape_is_one_clear_error(tmp_path, text, words):
    from treadle.run_dirs import StoredFileError, read_stored_json

    p = tmp_path / "summary.json"
    p.write_bytes(text.encode("latin-1"))
    before = p.read_bytes()
    with pytest.raises(StoredFileError, match=words) as err:
        read_stored_json(p, what="run summary")
    assert str(p) in str(err.value) and "run summary" in str(err.value) and "\n" not in str(err.value)
    assert p.read_bytes() == before
    with pytest.raises(StoredFileError, match="does not read as JSON"):
        read_stored_json(tmp_path / "missing.json", what="run summary")


def test_the_treadle_command_prints_a_damaged_stored_file_as_one_line(tmp_path):
    import typer
    from typer.testing import CliRunner

    from treadle.cli import _RootGroup
    from treadle.run_dirs import read_stored_json
    from treadle.testing import assert_usage_error

    (tmp_path / "results.json").write_text('{"cut": ')
    app = typer.Typer(cls=_RootGroup)

    @app.command()
    def show(out: str) -> None:
        read_stored_json(f"{out}/results.json", what="sweep results")

    @app.command()
    def other() -> None:  # two commands: a group, as the treadle command is
        pass

    assert_usage_error(CliRunner().invoke(app, ["show", str(tmp_path)]), "results.json", "sweep results")
