"""Run folders in the ``treadle`` commands: one option name (``--out``, with the older ``--run-dir`` as a
hidden alias), the rule of :func:`treadle.run_dirs.open_run_dir` as a usage error (exit 2, before any
work), and Ctrl-C: the run is recorded as interrupted and the command says what was saved and how to
resume, then exits 130.
"""
from __future__ import annotations

import contextlib
import shlex
import sys
from pathlib import Path

import typer
from typer import _click as click  # typer vendors click

__all__ = ["pick_out", "open_run", "recorded", "usage_error", "usage_exit", "resume_hint", "OUT_HELP_SUFFIX"]

OUT_HELP_SUFFIX = (" A finished run of the same config there is resumed (its results shown), another config is "
                   "refused; --overwrite replaces it.")


def usage_error(message: str) -> click.exceptions.UsageError:
    """A one-line usage error (exit 2); ``message`` names the flag."""
    return click.exceptions.UsageError(" ".join(str(message).split()))


def usage_exit(message: str) -> None:
    """Print ``Error: <message>`` as one line on stderr and exit 2: what every command prints for bad input
    (the root group prints click's usage errors the same way), also when a sub-app runs on its own."""
    typer.echo("Error: " + " ".join(str(message).split()), err=True)
    raise typer.Exit(2)


def pick_out(out: Path | None, alias: Path | None, default: str | Path) -> Path:
    """The run folder from ``--out`` or its hidden alias ``--run-dir`` (not both), else ``default``."""
    if out is not None and alias is not None and Path(out) != Path(alias):
        raise usage_error(f"--run-dir is the old name of --out; give one of them, got --out {out} and "
                          f"--run-dir {alias}")
    chosen = out if out is not None else alias
    return Path(default) if chosen is None else Path(chosen)


def open_run(out: Path, *, command: str, config: dict, overwrite: bool = False, ignore: tuple = ()):
    """:func:`treadle.run_dirs.open_run_dir` for ``--out``; its refusals become usage errors (exit 2)."""
    from treadle.run_dirs import RunDirError, open_run_dir

    try:
        return open_run_dir(out, command=command, config=config, flag="--out", overwrite=overwrite, ignore=ignore)
    except RunDirError as err:
        raise usage_error(str(err)) from None


def resume_hint() -> str:
    """The command line to rerun (``treadle ...``) when run as ``treadle``, else "the same command"."""
    if Path(sys.argv[0]).name in ("treadle", "treadle.exe"):
        return "`" + shlex.join(["treadle", *sys.argv[1:]]) + "`"
    return "the same command"


@contextlib.contextmanager
def recorded(run, console, saved=lambda: "nothing resumable", resumable: bool = False):
    """Start ``run`` (write its ``run.json``), and record how it ended. On Ctrl-C: status
    ``interrupted``, one message saying what was saved (``saved()``) and how to resume, exit 130. A usage
    error (bad input found after the start): status ``refused`` with the message, exit 2; the corrected
    command may then reuse the folder with another config if nothing but ``run.json`` was written."""
    run.start()
    try:
        yield run
    except KeyboardInterrupt:
        run.end("interrupted")
        how = (f"rerun {resume_hint()} to resume from there" if resumable
               else f"rerun {resume_hint()} to start it again (same folder, same config)")
        console.print(f"Interrupted. Saved: {saved()} in {run.path}; {how}.", markup=False)
        raise typer.Exit(130) from None
    except typer.Exit as err:
        run.end("finished" if err.exit_code == 0 else "failed")
        raise
    except click.exceptions.UsageError as err:  # bad input found once the model or data was loaded
        run.end("refused", error=err.format_message())
        raise
    except BaseException:
        run.end("failed")
        raise
    run.end("finished")
