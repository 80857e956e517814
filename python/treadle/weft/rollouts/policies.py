"""Policies: who writes the assistant turns.

- ``llm``: any role of :class:`treadle.llm.LLMClient` (OpenAI-compatible endpoint, the local
  server); endpoint failures (timeouts, garbage) come back as a :class:`PolicyOutput` with
  ``finish_reason="error"`` (a recorded failure), never an exception.
- ``hf``: a local Hugging Face model in process (generated token ids kept).
- ``replay``: plays the atomic task's reference (gold) calls through the harness, with seeded
  perturbations at chosen rates: ``wrong_argument``, ``skipped_call``, ``extra_call`` (the call is
  repeated), ``malformed_call`` and ``made_up_tool`` (both followed by the right call: a recovered
  error). Every step is labelled with its perturbations. Deterministic in ``(seed, task, atomic, attempt)``.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.harnesses import Harness
from treadle.weft.rollouts.records import PolicyOutput
from treadle.weft.rollouts.registry import POLICIES
from treadle.weft.rollouts.tasks import AtomicTask, RolloutTask
from treadle.untrusted import clip

PERTURBATIONS = ("wrong_argument", "skipped_call", "extra_call", "malformed_call", "made_up_tool")


@dataclass(frozen=True)
class PolicyContext:
    """Where a policy is asked to act: task, atomic task, its index, attempt, step, run seed."""

    task: RolloutTask
    atomic: AtomicTask
    index: int
    attempt: int
    step: int
    seed: int


@runtime_checkable
class Policy(Protocol):
    name: str

    def args(self) -> dict[str, Any]: ...
    async def act(self, messages: Sequence[dict], tools: Sequence[dict], harness: Harness,
                  ctx: PolicyContext) -> PolicyOutput: ...


@POLICIES.register("llm")
class LLMPolicy:
    """A role of an :class:`~treadle.llm.LLMClient` (the caller owns the client's lifetime)."""

    def __init__(self, client: Any, role: str = "policy", tag: str = "weft-rollouts"):
        roles = getattr(getattr(client, "config", None), "roles", None)
        if roles is None or not hasattr(client, "chat"):
            raise TypeError(f"client must be a treadle.llm.LLMClient, got {type(client).__name__}")
        if role not in roles:
            raise ValueError(f"role {role!r} is not in the LLM config; expected one of {sorted(roles)}")
        self.client, self.role, self.tag = client, role, tag

    def args(self) -> dict[str, Any]:
        """Role, model and sampling: what changes the outputs (part of every trajectory's key)."""
        rc = self.client.config.roles[self.role]
        return {"role": self.role, "model": rc.model, "sampling": rc.sampling.model_dump(mode="json")}

    async def act(self, messages, tools, harness, ctx):
        from treadle.llm import LLMCallError

        try:
            r = await self.client.chat(list(messages), role=self.role, tag=self.tag,
                                       tools=list(tools),
                                       sample_index=ctx.attempt)
        except LLMCallError as err:
            f = err.failure
            return PolicyOutput(finish_reason="error", error=f"{f.kind.value}: {f.message}"[:500])
        except Exception as err:  # noqa: BLE001  (a rollout records the failure; the batch goes on)
            return PolicyOutput(finish_reason="error", error=clip(f"{type(err).__name__}: {err}", 500))
        return PolicyOutput(text=r.text, tool_calls=r.tool_calls, finish_reason=r.finish_reason,
                            token_ids=r.token_ids)


def mutate_call(call: ToolCall) -> ToolCall:
    """The same call with its first argument (by name) perturbed, or an unexpected argument if it has none."""
    if not call.arguments:
        return ToolCall(name=call.name, arguments={"unexpected": 1})
    key = sorted(call.arguments)[0]
    v = call.arguments[key]
    if isinstance(v, bool):
        w: Any = not v
    elif isinstance(v, (int, float)):
        w = v + 7
    elif isinstance(v, str):
        w = "wrong-" + v
    else:
        w = []
    return ToolCall(name=call.name, arguments={**call.arguments, key: w})


@POLICIES.register("replay")
class ReplayPolicy:
    """Reference calls with seeded perturbations at ``rates`` (each in [0, 1], summing to <= 1)."""

    def __init__(self, rates: dict[str, float] | None = None, seed: int = 0):
        rates = dict(rates or {})
        bad = sorted(set(rates) - set(PERTURBATIONS))
        if bad:
            raise ValueError(f"unknown perturbation(s) {bad}; expected some of {list(PERTURBATIONS)}")
        if any(not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in rates.values()) or sum(rates.values()) > 1:
            raise ValueError(f"perturbation rates must be in [0, 1] and sum to <= 1, got {rates}")
        self.rates, self.seed = rates, seed

    def args(self) -> dict[str, Any]:
        return {"rates": dict(sorted(self.rates.items())), "seed": self.seed}

    def plan(self, harness: Harness, ctx: PolicyContext) -> list[PolicyOutput]:
        """Every step of this attempt (the last one is the reply without calls)."""
        h = hashlib.sha256(f"{self.seed}|{ctx.seed}|{ctx.task.name}|{ctx.atomic.name}|{ctx.attempt}".encode())
        rng = random.Random(int.from_bytes(h.digest()[:8], "big"))
        steps: list[PolicyOutput] = []
        batch: list[ToolCall] = []
        labels: list[str] = []

        def flush() -> None:
            if batch:
                steps.append(harness.render(batch).model_copy(update={"perturbations": tuple(labels)}))
                batch.clear()
                labels.clear()

        for call in ctx.atomic.checkpoint.gold_calls or []:
            u, acc, p = rng.random(), 0.0, None
            for name in PERTURBATIONS:
                acc += self.rates.get(name, 0.0)
                if u < acc:
                    p = name
                    break
            if p == "skipped_call":
                labels.append(p)
            elif p == "wrong_argument":
                batch.append(mutate_call(call))
                labels.append(p)
            elif p == "extra_call":
                batch.extend([call, call])
                labels.append(p)
            elif p in ("malformed_call", "made_up_tool"):
                flush()
                bad = (harness.render_malformed(call) if p == "malformed_call"
                       else harness.render([ToolCall(name=call.name + "_v2", arguments=call.arguments)]))
                steps.append(bad.model_copy(update={"perturbations": (p,)}))
                batch.append(call)
            else:
                batch.append(call)
        final = harness.render([], f"Done with {ctx.atomic.name}.")
        if batch:
            flush()
        elif labels:  # only skipped calls left: the label goes on the reply
            final = final.model_copy(update={"perturbations": tuple(labels)})
        steps.append(final)
        return steps

    async def act(self, messages, tools, harness, ctx):
        steps = self.plan(harness, ctx)
        return steps[min(ctx.step, len(steps) - 1)]


@POLICIES.register("hf")
class HFPolicy:
    """A local Hugging Face causal LM in process: the prompt is rendered with the tokenizer's chat template
    and the tools, generated with ``model.generate`` on a worker thread (one at a time), and the generated
    token ids are kept on the output. ``finish_reason`` is ``"length"`` when ``max_new_tokens`` ran out.
    The text is decoded without special tokens; native tool calls are not produced (use a text harness)."""

    def __init__(self, model: Any, tokenizer: Any, max_new_tokens: int = 256, temperature: float = 0.0):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tokenizer has no chat_template; the hf policy renders prompts with it")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature = max_new_tokens, float(temperature)
        self._lock = None

    def args(self) -> dict[str, Any]:
        return {"model": str(getattr(self.model, "name_or_path", "") or type(self.model).__name__),
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature}

    def _generate(self, messages: list[dict], tools: list[dict], seed: int) -> PolicyOutput:
        import torch

        tok = self.tokenizer
        prompt = tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        enc = tok(prompt, add_special_tokens=False, return_tensors="pt")
        kw: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "pad_token_id": tok.pad_token_id,
                              "eos_token_id": tok.eos_token_id, "do_sample": self.temperature > 0}
        if self.temperature > 0:
            kw["temperature"] = self.temperature
            torch.manual_seed(seed)
        with torch.no_grad():
            out = self.model.generate(**enc, **kw)
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        stopped = bool(new) and new[-1] == tok.eos_token_id
        return PolicyOutput(text=tok.decode(new, skip_special_tokens=True), token_ids=tuple(new),
                            finish_reason="stop" if stopped or len(new) < self.max_new_tokens else "length")

    async def act(self, messages, tools, harness, ctx):
        import anyio

        if self._lock is None:
            self._lock = anyio.Lock()
        seed = int.from_bytes(hashlib.sha256(f"{ctx.seed}|{ctx.task.name}|{ctx.atomic.name}|{ctx.attempt}|"
                                             f"{ctx.step}".encode()).digest()[:4], "big")
        try:
            async with self._lock:
                return await anyio.to_thread.run_sync(self._generate, list(messages), list(tools), seed)
        except Exception as err:  # noqa: BLE001  (a failed generation is a recorded failure)
            return PolicyOutput(finish_reason="error", error=clip(f"{type(err).__name__}: {err}", 500))
