"""Building atomic-task candidates from call strings (shared by the native environments' task modules)."""
from __future__ import annotations

from typing import Any

from treadle.weft.runtime.callparse import parse_call
from treadle.weft.tasks import AtomicTask, details_of
from treadle.weft.runtime.verify import CheckpointSpec


def candidate(name: str, request: str, gold: list[str], **checkpoint: Any) -> AtomicTask:
    """An :class:`AtomicTask` named ``name`` whose checkpoint replays ``gold`` (call strings); extra keyword
    arguments go to :class:`CheckpointSpec` (assertions, forbidden tools...)."""
    spec = CheckpointSpec(name=name, gold_calls=[parse_call(g) for g in gold], **checkpoint)
    return AtomicTask(name=name, request=request, details=details_of(request, spec), checkpoint=spec)
