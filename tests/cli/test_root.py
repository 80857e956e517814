"""The root ``treadle`` command: help without torch, areas loaded lazily, one-line usage errors (exit 2)."""
import subprocess
import sys

from typer.testing import CliRunner

from treadle.cli import AREAS, _areas, app

runner = CliRunner()


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom treadle.cli import app\n"
            "for argv in (['--help'], ['--version']):\n"
            "    try:\n        app(argv)\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
            "bad = [m for m in ('torch', 'transformers', 'peft', 'matplotlib') if m in sys.modules]\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for name, *_ in _areas().items():
        assert name in res.stdout


def test_every_present_area_is_listed_and_runs():
    present = _areas()
    assert {"model", "stair", "scale", "weft"} <= set(present)
    assert all(len(entry) in (2, 3) for entry in AREAS)  # AREAS stays open to (name, module[, help]) entries
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for name in present:
        assert name in res.output
        sub = runner.invoke(app, [name, "--help"])
        assert sub.exit_code == 0, (name, sub.output)
        assert "Usage:" in sub.output


def test_usage_errors_are_one_line_naming_the_flag_exit_2():
    for argv, words in ((["nope"], ["No such command 'nope'"]),
                        (["model", "train-tiny", "--steps", "x"], ["--steps"]),
                        (["model", "train-tiny", "--bogus"], ["--bogus"])):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2, (argv, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
        assert all(w in lines[0] for w in words), lines


def test_errors_found_by_commands_go_to_stderr_as_one_error_line(tmp_path):
    """Errors a command finds itself (rsi, llm, weft sample, bench) print like click's usage errors: one
    ``Error: <flag>: ...`` line on stderr (never on stdout, where a pipe or a redirect would hide it), exit 2."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for argv, flag in ((["rsi", "run", "--out", str(afile)], "--out"),
                       (["llm", "ledger", str(tmp_path / "none.jsonl")], "PATH"),
                       (["weft", "sample", "--out", str(afile)], "--out"),
                       (["bench", "--ops", "nope"], "--ops")):
        res = subprocess.run([sys.executable, "-m", "treadle", *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert res.stdout == "", (argv, res.stdout)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {flag}: "), (argv, res.stderr)
    assert afile.read_text() == "mine"


def test_threads_above_the_machines_cpus_are_refused_before_any_work(tmp_path, monkeypatch):
    """``--threads 100000`` made OpenMP fail to allocate thread stacks: a segfault with hundreds of lines.
    Every command taking --threads refuses more than this machine's CPUs, before loading anything."""
    from treadle.cli_models import MAX_THREADS

    monkeypatch.setenv("TREADLE_CACHE", str(tmp_path / "cache"))
    for cmd in (["model", "train-tiny"], ["model", "eval"], ["stair", "train"], ["stair", "eval"], ["scale", "sft"],
                ["scale", "train"], ["scale", "sweep"]):
        res = runner.invoke(app, [*cmd, "--threads", str(MAX_THREADS + 1)])
        assert res.exit_code == 2, (cmd, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and "'--threads'" in lines[0] and f"less than or equal to {MAX_THREADS}" in lines[0], (
            cmd, res.output)
    assert not (tmp_path / "cache").exists()


def test_bench_refuses_an_empty_ops_list_and_a_file_out_before_running(tmp_path):
    """``--ops ,`` named no suite and ran every suite (minutes); ``--out <file>`` was a FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for argv, words in ((["bench", "--ops", ","], "--ops: no suite named in ','"),
                        (["bench", "--ops", "grpo", "--out", str(afile)], "--out"),
                        (["bench", "--ops", "grpo", "--out", str(afile / "sub")], "is a file, not a folder")):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2, (argv, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], (argv, res.output)
    assert afile.read_text() == "mine"


def test_a_bad_treadle_backend_is_one_line_before_any_command(tmp_path):
    """``TREADLE_BACKEND=nope treadle backends`` (or any command) was a 60-line traceback."""
    import os

    from treadle.cli import _BACKEND_NAMES
    from treadle.dispatch import BACKENDS

    assert _BACKEND_NAMES == BACKENDS
    env = {**os.environ, "TREADLE_BACKEND": "nope", "TREADLE_CACHE": str(tmp_path / "cache")}
    for argv in (["backends"], ["demo", "--quick", "--sections", "grpo-op", "--out", str(tmp_path / "d")]):
        res = subprocess.run([sys.executable, "-m", "treadle", *argv], capture_output=True, text=True, timeout=120,
                             env=env)
        assert res.returncode == 2 and res.stdout == "", (argv, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: $TREADLE_BACKEND: unknown backend 'nope'"), res.stderr
    assert not (tmp_path / "d").exists()
    res = subprocess.run([sys.executable, "-m", "treadle", "--help"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stderr  # help still works
