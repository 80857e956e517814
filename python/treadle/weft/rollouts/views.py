"""Views: what the model is told (seed: WEFT 4.1). Goals, dependencies, initial state, checkpoints
and tools come from the :class:`~treadle.weft.rollouts.tasks.RolloutTask` and never change here.

- ``agentic``: the whole brief (every atomic request, dependency order) up front; later turns only
  say "Continue."; each turn ends when the model replies without a tool call.
- ``simuser``: an offline rule-based user simulator asks for one atomic task at a time, in
  dependency order, at the task's disclosure level (structured ``details`` on the atomic task);
  a withheld detail is given when the model asks (its reply holds a question mark). Completion is
  decided by the runtime's checkpoint on the environment state, never by the simulator; an
  exchange that does not complete within ``max_exchanges`` replies is stalled (capped).
  An LLM-persona simulator is not implemented.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from treadle.weft.rollouts.registry import VIEWS
from treadle.weft.rollouts.tasks import AtomicTask, RolloutTask


@runtime_checkable
class View(Protocol):
    name: str

    def args(self) -> dict[str, Any]: ...
    def turn_start(self, task: RolloutTask, atomic: AtomicTask, index: int) -> list[dict[str, Any]]: ...
    def after_reply(self, task: RolloutTask, atomic: AtomicTask, reply: str, done: bool,
                    exchange: int) -> list[dict[str, Any]] | None: ...


@VIEWS.register("agentic")
class AgenticView:
    """Whole brief up front; one reply ends a turn."""

    def args(self) -> dict[str, Any]:
        return {}

    def turn_start(self, task: RolloutTask, atomic: AtomicTask, index: int) -> list[dict[str, Any]]:
        if index:
            return [{"role": "user", "content": "Continue."}]
        brief = "\n".join(f"{i + 1}. {a.request}" for i, a in enumerate(task.ordered()))
        return [{"role": "user", "content": "Do these tasks in order, one reply per task:\n" + brief}]

    def after_reply(self, task, atomic, reply, done, exchange):
        return None


@VIEWS.register("simuser")
class SimUserView:
    """Rule-based user simulator (offline) with disclosure levels; ``max_exchanges`` caps a stalled turn."""

    def __init__(self, max_exchanges: int = 3):
        if not isinstance(max_exchanges, int) or max_exchanges < 1:
            raise ValueError(f"max_exchanges must be an int >= 1, got {max_exchanges!r}")
        self.max_exchanges = max_exchanges

    def args(self) -> dict[str, Any]:
        return {"max_exchanges": self.max_exchanges}

    def turn_start(self, task: RolloutTask, atomic: AtomicTask, index: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": atomic.disclose(task.disclosure)}]

    def after_reply(self, task, atomic, reply, done, exchange):
        if done or exchange + 1 >= self.max_exchanges:
            return None
        if "?" in reply:
            return [{"role": "user", "content": atomic.disclose(task.disclosure, extra=exchange + 1)}]
        return [{"role": "user", "content": "That is not done yet. " + atomic.disclose(task.disclosure, extra=exchange)}]
