"""Views: what the model is told (seed: WEFT 4.1). Goals, dependencies, initial state, checkpoints
and tools come from the :class:`~treadle.weft.rollouts.tasks.RolloutTask` and never change here.

- ``agentic``: the whole brief (every atomic request, dependency order) up front; later turns only
  say "Continue."; each turn ends when the model replies without a tool call.
- ``simuser``: an offline rule-based user simulator asks for one atomic task at a time, in
  dependency order, at the task's disclosure level (structured ``details`` on the atomic task);
  a withheld detail is given when the model asks (its reply holds a question mark). Completion is
  decided by the runtime's checkpoint on the environment state, never by the simulator; an
  exchange that does not complete within ``max_exchanges`` replies is stalled (capped).
- ``simuser-llm``: the same simulator, but each user message is written by an LLM (a role of
  :class:`treadle.llm.LLMClient`) playing a persona. The LLM is given only what the disclosure rule
  reveals (the request with withheld details replaced by ``[ask me]``), so it cannot leak a detail
  the model has not asked for; it never decides completion (the checkpoint does). An endpoint
  failure or an empty message raises :class:`UserSimulatorError` (the batch records the rollout as
  failed, ``failure`` set; siblings go on).
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


class UserSimulatorError(RuntimeError):
    """The LLM user simulator's endpoint failed or returned no usable message (an infrastructure failure
    of the rollout, never a policy error)."""


DEFAULT_PERSONA = ("You are a customer of an online shop, writing to its support agent. You are polite, brief "
                   "and a little impatient.")


@VIEWS.register("simuser-llm")
class LLMUserView(SimUserView):
    """SimUser whose messages an LLM writes in a persona (seed: WEFT 4.1, "user simulation agent").

    Args:
        client: a :class:`treadle.llm.LLMClient` (the caller owns its lifetime; CLI: ``--llm-config``).
        role: the client's role that plays the user.
        persona: who the user is (system text of every simulator call).
        max_exchanges: cap of a stalled turn (as ``simuser``).

    Raises:
        TypeError / ValueError: not a client, unknown role, empty persona, bad cap (at construction).
    """

    needs_client = True

    def __init__(self, client: Any, role: str = "user", persona: str = DEFAULT_PERSONA, max_exchanges: int = 3,
                 tag: str = "weft-simuser"):
        super().__init__(max_exchanges)
        roles = getattr(getattr(client, "config", None), "roles", None)
        if roles is None or not hasattr(client, "chat"):
            raise TypeError(f"client must be a treadle.llm.LLMClient, got {type(client).__name__}")
        if role not in roles:
            raise ValueError(f"user simulator role {role!r} is not in the LLM config; expected one of {sorted(roles)}")
        if not isinstance(persona, str) or not persona.strip():
            raise ValueError("persona must be a non-empty string")
        self.client, self.role, self.persona, self.tag = client, role, persona.strip(), tag

    def args(self) -> dict[str, Any]:
        rc = self.client.config.roles[self.role]
        return {"max_exchanges": self.max_exchanges, "role": self.role, "model": rc.model, "persona": self.persona,
                "sampling": rc.sampling.model_dump(mode="json")}

    async def _say(self, task: RolloutTask, atomic: AtomicTask, situation: str, exchange: int) -> list[dict[str, Any]]:
        from treadle.llm import LLMCallError

        system = (f"{self.persona}\nYou play the USER, never the agent. Write only your next message to the agent, "
                  "in plain words, one or two sentences, no quotes. Anything shown as [ask me] is a detail you do "
                  "not say yet; never invent details.")
        try:
            r = await self.client.chat([{"role": "system", "content": system}, {"role": "user", "content": situation}],
                                       role=self.role, tag=self.tag, sample_index=exchange)
        except LLMCallError as err:
            f = err.failure
            raise UserSimulatorError(f"user simulator ({self.role}): {f.kind.value}: {f.message}"[:500]) from None
        text = (r.text or "").strip().strip('"').strip()
        if not text:
            raise UserSimulatorError(f"user simulator ({self.role}) returned an empty message "
                                     f"(finish_reason={r.finish_reason!r})")
        return [{"role": "user", "content": text}]

    async def turn_start(self, task, atomic, index):
        goal = atomic.disclose(task.disclosure)
        return await self._say(task, atomic, f"What you want from the agent now: {goal}\n"
                                             "Write your first message about it.", 0)

    async def after_reply(self, task, atomic, reply, done, exchange):
        if done or exchange + 1 >= self.max_exchanges:
            return None
        asked = "?" in reply
        goal = atomic.disclose(task.disclosure, extra=exchange + 1 if asked else exchange)
        how = ("The agent asked you something: answer with the details you know (shown above), no others."
               if asked else "It is not done yet: say so briefly and restate what you need.")
        return await self._say(task, atomic, f"What you want from the agent now: {goal}\n"
                                             f"The agent replied: {reply or '(nothing)'}\n{how}", exchange + 1)
