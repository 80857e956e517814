"""Run folders of the ``treadle`` commands: checked before any work, so that a bad ``--out`` fails
fast and leaves nothing behind (no half-made folders, no model touched), and one rule for every
command (:func:`open_run_dir`): a finished run folder is resumed if the config matches, refused if it
does not, replaced only with ``--overwrite``; each run folder records treadle's version and commit,
the command line, start and end times and the machine (``run.json``)."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ["check_out_dir", "make_out_dir", "open_run_dir", "RunDir", "RunDirError", "StoredFileError",
           "read_stored_json", "read_run_record",
           "record_problem", "machine_info", "RUN_RECORD"]


def check_out_dir(path: str | Path, name: str = "out_dir") -> Path:
    """Check that ``path`` can be a run folder, leaving nothing behind: not an existing file, no parent
    that is a file, the nearest existing ancestor writable, and the missing folders creatable (probed by
    creating and removing them).

    Returns:
        ``Path(path)`` (user-expanded).

    Raises:
        ValueError: naming ``name`` and the offending path.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{name} {str(p)!r} exists and is a file, not a folder")
    q = p
    while not q.exists():
        if q.parent == q:
            break
        q = q.parent
    if q.exists() and not q.is_dir():
        raise ValueError(f"{name} {str(p)!r} cannot be created: {str(q)!r} is a file, not a folder")
    if q.exists() and not os.access(q, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {str(p)!r} is not writable (no write permission on {str(q)!r})")
    if q != p:  # probe: can a new folder be made where the missing ones go (e.g. /proc refuses new folders)?
        # A private probe folder, never the target itself: processes that check the same --out at once
        # (the ranks torchrun started) never see each other's probe or remove a folder another one made.
        probe = q / f".treadle-probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            probe.mkdir()
        except OSError as err:
            raise ValueError(f"{name} {str(p)!r} cannot be created: {err.strerror or err}") from None
        probe.rmdir()
    return p


def make_out_dir(path: str | Path, name: str = "out_dir") -> Path:
    """:func:`check_out_dir`, then create the folder; ValueError (naming ``name``) when that fails."""
    p = check_out_dir(path, name)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{name} {str(p)!r} cannot be created: {err.strerror or err}") from None
    return p


# ---------------------------------------------------------------------------------------------- the run rule
RUN_RECORD = "run.json"
SCHEMA_VERSION = 1


class RunDirError(ValueError):
    """A run folder cannot be used as asked (another config inside, not a treadle run folder...).
    The message names the CLI flag and says what to do."""


class StoredFileError(ValueError):
    """A file a run wrote earlier (a config, a summary, a state file) no longer reads as what was written:
    cut, hand-edited, or of another shape. The message names the file; the file is left as it is."""


def read_stored_json(path: str | Path, *, what: str, expect: type = dict):
    """The JSON value a run stored in ``path``, checked to be an ``expect`` (dict by default).

    Raises:
        StoredFileError: the file cannot be read, is not JSON (or nests too deep), or holds another type;
            one line naming the file and ``what`` it should be (the ``treadle`` command prints it as
            ``Error: ...``, exit 2).
    """
    import json

    p = Path(path)
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        reason = " ".join(str(err).split())[:120]
        raise StoredFileError(f"{p}: the {what} does not read as JSON ({type(err).__name__}: {reason}); it is left "
                              f"as it is: restore or remove it, or use another --out") from None
    if not isinstance(value, expect):
        raise StoredFileError(f"{p}: the {what} holds a JSON {type(value).__name__}, not the "
                              f"{'object' if expect is dict else expect.__name__} treadle wrote; it is left as it is: "
                              f"restore or remove it, or use another --out")
    return value


def file_sha256(path: str | Path) -> str:
    """SHA-256 hex digest of a file's bytes, read in 1 MiB blocks: what a run's config records of an input
    file (so that another input is another config) and what checkpoint markers record of their weights.

    Raises:
        OSError: the file cannot be read."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _git_commit() -> str | None:
    """The commit of the source checkout treadle runs from (None for an installed wheel)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=5)
    return out.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def machine_info() -> dict:
    """Host, OS, Python, CPU model and count, torch version and CUDA device (when torch is imported)."""
    import platform
    import sys

    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"host": platform.node(), "os": platform.platform(), "python": platform.python_version(),
            "cpu": cpu, "cpu_count": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json_atomic(path: Path, data: dict) -> None:
    import json

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    parts = [f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(parts[:6]) + (f" (+{len(parts) - 6} more)" if len(parts) > 6 else "")


class RunDir:
    """One command's run folder under the rule every ``treadle`` command follows:

    - a new or empty folder: the run starts there;
    - a folder holding a run of the SAME config: the run is resumed (``resumed`` is True;
      ``finished`` says whether that run had completed: commands then show its results instead of
      redoing the work, and STAIR continues from its checkpoint);
    - a folder holding a run of ANOTHER config: refused (:class:`RunDirError`, with the differences),
      unless that run ended (refused, failed, interrupted) with nothing written but ``run.json``: the
      folder is then taken as new (the attempt kept in ``history``), as there is no result to lose;
    - with ``overwrite`` (``--overwrite``) a run folder's contents are deleted and the run starts afresh;
    - a non-empty folder without a run record: refused even with ``overwrite`` (it is not ours to delete).

    ``run.json`` records: the command, its command line, the config, treadle's version and git commit,
    the machine, start and end times, the status (``running``, ``finished``, ``interrupted``,
    ``failed``, ``refused``: bad input found after the start) and every earlier start in this folder (``history``).

    Create with :func:`open_run_dir` (checks first, changes nothing until :meth:`start`).
    """

    def __init__(self, path: Path, flag: str, command: str, config: dict, record: dict | None, overwrite: bool):
        self.path, self.flag, self.command, self.config = path, flag, command, config
        self.previous = record
        self.overwrite = overwrite and record is not None
        self.resumed = record is not None and not self.overwrite
        self.finished = self.resumed and record.get("status") == "finished"
        self.record: dict = {}

    def start(self) -> "RunDir":
        """Create (or empty, with ``overwrite``) the folder and write ``run.json`` (status ``running``)."""
        import shutil
        import sys

        from treadle import __version__

        if self.overwrite and self.path.exists():
            for child in self.path.iterdir():
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunDirError(f"{self.flag} {str(self.path)!r} cannot be created: {err.strerror or err}") from None
        history = []
        if self.resumed and self.previous:
            history = [*self.previous.get("history", []),
                       {k: self.previous.get(k) for k in ("argv", "started", "ended", "status", "treadle_version",
                                                           "git_commit")}]
        self.record = {"schema_version": SCHEMA_VERSION, "command": self.command, "argv": list(sys.argv),
                       "config": self.config, "treadle_version": __version__, "git_commit": _git_commit(),
                       "machine": machine_info(), "started": _now(), "ended": None, "status": "running",
                       "history": history}
        _write_json_atomic(self.path / RUN_RECORD, self.record)
        return self

    def end(self, status: str = "finished", **extra) -> None:
        """Record the end time and ``status`` (``finished``, ``interrupted`` or ``failed``)."""
        if not self.record:
            return
        self.record.update({"ended": _now(), "status": status, **extra})
        _write_json_atomic(self.path / RUN_RECORD, self.record)


def read_run_record(path: str | Path) -> dict | None:
    """The ``run.json`` of a run folder, or None (no record, or unreadable); its shape is checked by
    :func:`record_problem` (:func:`open_run_dir` refuses a record of the wrong shape in one line)."""
    import json

    p = Path(path) / RUN_RECORD
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):
        return None


_RECORD_FIELDS = {"command": str, "config": dict, "status": str, "history": list}


def record_problem(record: object) -> str | None:
    """Why ``record`` (a parsed ``run.json``) is not a run record treadle can read, or None: a hand-edited
    file of the wrong shape is reported in one line instead of failing deep inside a command."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not an object"
    for key, typ in _RECORD_FIELDS.items():
        if key in record and record[key] is not None and not isinstance(record[key], typ):
            return f"its {key!r} is a {type(record[key]).__name__}, not a {typ.__name__}"
    if not isinstance(record.get("command"), str):
        return "it names no command"
    if any(not isinstance(h, dict) for h in record.get("history") or []):
        return "its 'history' holds entries that are not objects"
    return None


def _nothing_saved(p: Path, record: dict) -> bool:
    """Whether the run recorded in ``p`` ended without writing anything but its ``run.json``."""
    return record.get("status") not in ("running", "finished") and all(c.name == RUN_RECORD for c in p.iterdir())


def open_run_dir(path: str | Path, *, command: str, config: dict, flag: str = "--out", overwrite: bool = False,
                 ignore: tuple = ()) -> RunDir:
    """Check ``path`` as the run folder of ``command`` with ``config`` (see :class:`RunDir` for the
    rule), changing nothing. Call :meth:`RunDir.start` once the other checks passed.

    Args:
        path: the folder (``--out``).
        command: e.g. ``"scale train"``.
        config: JSON-able dict of everything that changes the results (not threads, progress...).
        flag: the CLI option that gave ``path``, for messages.
        overwrite: replace a run of another config (``--overwrite``).
        ignore: config keys that may differ on resume (e.g. STAIR's ``steps``: more steps continue).

    Raises:
        RunDirError: ``path`` is not usable (a file, not writable), holds files but no run record,
            holds a run of another command, or (without ``overwrite``) of another config.
    """
    import json

    try:
        p = check_out_dir(path, flag)
    except ValueError as err:
        raise RunDirError(str(err)) from None
    config = json.loads(json.dumps(config, default=str))
    record = read_run_record(p)
    problem = record_problem(record) if record is not None else None
    if problem:
        raise RunDirError(f"{flag} {str(p)!r} holds a {RUN_RECORD} that is not a treadle run record ({problem}); "
                          f"fix or remove it, or give another folder")
    if record is None:
        if p.is_dir() and any(p.iterdir()):
            raise RunDirError(f"{flag} {str(p)!r} is a non-empty folder that is not a treadle run folder (no "
                              f"{RUN_RECORD}); give a new or empty folder")
        return RunDir(p, flag, command, config, None, overwrite)
    if record.get("command") != command:
        raise RunDirError(f"{flag} {str(p)!r} holds a `treadle {record.get('command')}` run, not `treadle {command}`; "
                          f"give another folder")
    old = {k: v for k, v in (record.get("config") or {}).items() if k not in ignore}
    new = {k: v for k, v in config.items() if k not in ignore}
    if old != new and not overwrite and _nothing_saved(p, record):
        # an attempt that ended (refused, failed, interrupted) before writing anything: no result to keep,
        # so the corrected command takes the folder (the attempt stays in run.json's history)
        return RunDir(p, flag, command, config, record, False)
    if old != new and not overwrite:
        raise RunDirError(f"{flag} {str(p)!r} holds a run with another config ({_diff(old, new)}); rerun with the same "
                          f"settings to resume it, add --overwrite to replace it, or give another {flag}")
    if old == new:
        record = {**record, "config": config}  # resumed: ignored keys take the new values
    return RunDir(p, flag, command, config, record, overwrite)
