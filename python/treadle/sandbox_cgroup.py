"""Per-sandbox control groups: one fresh ``pids`` and one fresh ``memory`` cgroup per sandboxed run.

:mod:`treadle.sandbox` puts its launcher (and so every process the sandboxed program starts) into the
cgroups made here before ``exec``, so a limit holds for the whole sandbox, not per process: ``pids.max``
bounds the processes and threads alive at once, ``memory.limit_in_bytes`` (cgroup v1) or ``memory.max``
(cgroup v2) bounds the resident memory of all of them together, including the pages of the sandbox's
tmpfs folders (its work folder, ``/tmp``, ``/dev/shm``); swap is capped at the same figure (v1
``memory.memsw.limit_in_bytes``, v2 ``memory.swap.max = 0``) where the kernel accounts it.

A cgroup can be made where this process may write its own cgroup's folder: root with cgroup v1, or a
delegated cgroup v2 subtree whose ``cgroup.subtree_control`` enables the controller. Where none can be
made, :meth:`SandboxCgroups.create` leaves that controller out and the caller falls back (see
:mod:`treadle.sandbox`: a sandbox without a memory cgroup may not fork).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["SandboxCgroups", "own_cgroup"]

_ROOT = Path("/sys/fs/cgroup")


def own_cgroup(controller: str) -> str | None:
    """The folder of this process's ``controller`` cgroup (``"pids"`` or ``"memory"``) if new child cgroups
    can be made in it (cgroup v1 with that controller, or cgroup v2 with it in ``cgroup.subtree_control``),
    else None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if controller in ctrl.split(","):
            base = _ROOT / ctrl
            if not base.is_dir():
                base = _ROOT / controller
        elif ctrl == "" and (_ROOT / "cgroup.controllers").exists():
            base = _ROOT
            try:
                if controller not in (base / path.lstrip("/") / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        d = base / path.lstrip("/")
        if d.is_dir() and os.access(d, os.W_OK):
            return str(d)
    return None


def _remove(d: str) -> None:
    for _ in range(50):  # processes killed a moment ago may still be leaving it
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class SandboxCgroups:
    """The fresh cgroups of one sandbox: :attr:`pids` and :attr:`memory` (folders, or None where the
    controller is not available here; with cgroup v2 both may be the same folder)."""

    def __init__(self, pids: str | None, memory: str | None) -> None:
        self.pids, self.memory = pids, memory

    @classmethod
    def create(cls, max_processes: int, memory_bytes: int) -> SandboxCgroups:
        """Make the cgroups with ``pids.max = max_processes`` and a memory limit of ``memory_bytes``."""
        tag = f"treadle-sandbox-{os.getpid()}-{time.monotonic_ns()}"
        made: dict[str, str | None] = {}
        for ctrl, settings in (("pids", [("pids.max", str(max_processes))]),
                               ("memory", [("memory.limit_in_bytes", str(memory_bytes)),
                                           ("memory.memsw.limit_in_bytes", str(memory_bytes)),
                                           ("memory.max", str(memory_bytes)), ("memory.swap.max", "0")])):
            parent = own_cgroup(ctrl)
            made[ctrl] = None
            if parent is None:
                continue
            d = os.path.join(parent, tag)
            try:
                os.makedirs(d, exist_ok=True)  # cgroup v2: pids and memory share one folder
                wrote = False
                for name, value in settings:
                    if os.path.exists(os.path.join(d, name)):
                        try:
                            _write(os.path.join(d, name), value)
                            wrote = True
                        except OSError:
                            if not name.endswith(("memsw.limit_in_bytes", "swap.max")):  # swap not accounted
                                raise
                if wrote:
                    made[ctrl] = d
                elif not any(d == v for v in made.values()):
                    _remove(d)
            except OSError:
                if not any(d == v for v in made.values()):
                    _remove(d)
        return cls(made["pids"], made["memory"])

    @property
    def folders(self) -> list[str]:
        return list(dict.fromkeys(d for d in (self.pids, self.memory) if d is not None))

    def enter(self) -> None:
        """Move the calling process into every cgroup (run in the launcher's child before ``exec``)."""
        for d in self.folders:
            _write(os.path.join(d, "cgroup.procs"), str(os.getpid()))

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the sandbox for exceeding its memory limit."""
        if self.memory is None:
            return False
        for name in ("memory.events", "memory.oom_control"):
            try:
                for line in Path(self.memory, name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value) > 0:
                        return True
            except (OSError, ValueError):
                continue
        return False

    def remove(self) -> None:
        """Remove the cgroups (idempotent; waits a moment for killed processes to leave)."""
        for d in self.folders:
            _remove(d)
        self.pids = self.memory = None
