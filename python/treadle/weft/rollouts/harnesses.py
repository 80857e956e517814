"""Harnesses: how the model is wired to tools (seed: WEFT 4.1, "harness" in the WEFT sense).

Each harness renders the conversation for the model's chat template (tools always passed to it),
has ONE tolerant parser used for data generation, training and evaluation alike, and says how a
call and a tool result look in the history. ``parser`` and ``tolerance`` are stored in every
trajectory. An unparseable span becomes a :class:`ParseFailure` (a policy error, shown to the model
as an observation), a made-up tool name is dispatched and comes back ``unknown_tool``: never a crash.
Every parser is linear in the output's length (line scans and ``str.find``, regexes only on single lines
with no nested or adjacent overlapping quantifiers; JSON through :func:`treadle.untrusted.loads_json`,
which bounds nesting and rejects duplicated keys), so one degenerate output cannot stall the event loop
that parses it next to other rollouts.

Adding a harness is one class registered with ``@HARNESSES.register("name")``. OpenClaw (the
paper's third harness) lives in :mod:`~treadle.weft.rollouts.openclaw`; a harness may also define
``system_prompt(base, tools)`` (the whole system prompt) and ``args()`` (what changes its prompts).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from treadle.llm.records import ToolCall as NativeCall
from treadle.untrusted import loads_json, strip_fence
from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.records import ParsedCall, ParsedStep, ParseFailure, PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES


@runtime_checkable
class Harness(Protocol):
    name: str
    parser: ClassVar[str]
    tolerance: ClassVar[str]
    native_tools: ClassVar[bool]

    def instructions(self, tools: Sequence[dict]) -> str: ...
    def parse(self, out: PolicyOutput) -> ParsedStep: ...
    def assistant_message(self, out: PolicyOutput) -> dict[str, Any]: ...
    def tool_messages(self, calls: Sequence[ParsedCall], texts: Sequence[str]) -> list[dict[str, Any]]: ...
    def render(self, calls: Sequence[ToolCall], text: str = "") -> PolicyOutput: ...
    def render_malformed(self, call: ToolCall) -> PolicyOutput: ...


def openai_tools(tools: Sequence[dict]) -> list[dict]:
    """Runtime tool definitions (name, description, input_schema) -> OpenAI tool specs."""
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {"type": "object"})}}
            for t in tools]


def _args_obj(raw: Any) -> dict[str, Any]:
    """Tolerant arguments: a dict, a JSON object string, '' / None (no arguments). Raises ValueError otherwise."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, str):
        raw = loads_json(strip_fence(raw), what="tool-call arguments")
    if not isinstance(raw, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(raw).__name__}")
    return raw


def _blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], str]:
    """The bodies between ``open_tag`` and ``close_tag`` (an unclosed last block runs to the end of the text),
    and the text with the blocks removed: ``str.find`` scans, linear in the text."""
    bodies, rest, i = [], [], 0
    while True:
        a = text.find(open_tag, i)
        if a < 0:
            rest.append(text[i:])
            break
        rest.append(text[i:a])
        b = text.find(close_tag, a + len(open_tag))
        if b < 0:
            bodies.append(text[a + len(open_tag):])
            break
        bodies.append(text[a + len(open_tag):b])
        i = b + len(close_tag)
    return bodies, "".join(rest)


_ACTION_LINE = re.compile(r"Action[ \t]*:(.*)", re.I)
_INPUT_LINE = re.compile(r"Action[ \t]+Input[ \t]*:(.*)", re.I)
_STOP_LINE = re.compile(r"(?:Action[ \t]*:|Thought[ \t]*:|Observation[ \t]*:|Final[ \t]+Answer[ \t]*:)", re.I)
_FINAL = re.compile(r"Final[ \t]+Answer[ \t]*:", re.I)
_TOOL_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _react_actions(text: str) -> list[tuple[str, str, str]]:
    """``(name, raw input, raw span)`` per ``Action:`` line, its ``Action Input:`` (the next non-blank line) running
    until the next Action/Thought/Observation/Final Answer line; one pass over the lines (each line is
    ``lstrip``-ed before an anchored match, so no regex rescans whitespace)."""
    lines = text.split("\n")
    out, i, n = [], 0, len(lines)
    while i < n:
        m = _ACTION_LINE.match(lines[i].lstrip())
        if m is None:
            i += 1
            continue
        j = i + 1
        while j < n and not lines[j].strip():
            j += 1
        mi = _INPUT_LINE.match(lines[j].lstrip()) if j < n else None
        if mi is None:
            out.append((m.group(1).strip(), "", lines[i]))
            i += 1
            continue
        k = j + 1
        while k < n and _STOP_LINE.match(lines[k].lstrip()) is None:
            k += 1
        out.append((m.group(1).strip(), "\n".join([mi.group(1), *lines[j + 1:k]]).strip(), "\n".join(lines[i:k])))
        i = k
    return out


class _TextHarness:
    """Calls written in the text. Tolerance shared by text harnesses: when a server-side tool parser
    already turned them into native ``tool_calls``, those are read too (and kept in the history)."""

    native_tools: ClassVar[bool] = False

    def assistant_message(self, out: PolicyOutput) -> dict[str, Any]:
        return NativeHarness.assistant_message(self, out)  # type: ignore[arg-type]

    def parse(self, out: PolicyOutput) -> ParsedStep:
        text = self.parse_text(out)
        if not out.tool_calls:
            return text
        nat = NativeHarness.parse(self, out)  # type: ignore[arg-type]
        return ParsedStep(calls=nat.calls + text.calls, failures=nat.failures + text.failures, reply=text.reply)


@HARNESSES.register("hermes")
class HermesHarness(_TextHarness):
    """Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text;
    results come back as ``tool`` messages (the chat template wraps them in ``<tool_response>``)."""

    parser: ClassVar[str] = "hermes-json-v1"
    tolerance: ClassVar[str] = ("native tool_calls from a server-side parser; missing closing tag at end of text; ```json fences; 'parameters' for 'arguments'; "
                                "arguments as a JSON string; whitespace")

    def instructions(self, tools: Sequence[dict]) -> str:
        return ("To call a tool, write <tool_call>{\"name\": <tool>, \"arguments\": <object>}</tool_call>; "
                "several blocks call several tools. Without a tool call, your text is the reply to the user.")

    def parse_text(self, out: PolicyOutput) -> ParsedStep:
        calls, fails = [], []
        bodies, rest = _blocks(out.text, "<tool_call>", "</tool_call>")
        for i, raw in enumerate(bodies):
            try:
                obj = loads_json(strip_fence(raw), what="tool call")
                if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                    raise ValueError("expected an object with a string 'name'")
                calls.append(ParsedCall(id=f"call_{i}", name=obj["name"],
                                        arguments=_args_obj(obj.get("arguments", obj.get("parameters")))))
            except (ValueError, TypeError) as err:
                fails.append(ParseFailure(raw=raw[:500], message=f"{type(err).__name__}: {err}"))
        reply = rest.strip()
        return ParsedStep(calls=tuple(calls), failures=tuple(fails), reply=reply)

    def tool_messages(self, calls: Sequence[ParsedCall], texts: Sequence[str]) -> list[dict[str, Any]]:
        return [{"role": "tool", "name": c.name, "content": t} for c, t in zip(calls, texts)]

    def render(self, calls: Sequence[ToolCall], text: str = "") -> PolicyOutput:
        blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}) + "\n</tool_call>"
                           for c in calls)
        return PolicyOutput(text=(text + "\n" + blocks).strip() if blocks else text)

    def render_malformed(self, call: ToolCall) -> PolicyOutput:
        return PolicyOutput(text="<tool_call>\n{\"name\": \"" + call.name + "\", \"arguments\": {" + "\n</tool_call>")


@HARNESSES.register("react")
class ReActHarness(_TextHarness):
    """ReAct text: ``Thought: ...`` / ``Action: <tool>`` / ``Action Input: <JSON object>``; observations
    return as user messages ``Observation: ...``; ``Final Answer: ...`` (or no Action) is the reply."""

    parser: ClassVar[str] = "react-v1"
    tolerance: ClassVar[str] = ("native tool_calls from a server-side parser; case-insensitive keys; several Action blocks; empty or missing Action Input = {}; "
                                "```json fences; 'Final Answer:' optional")
    def instructions(self, tools: Sequence[dict]) -> str:
        return ("Answer in this format: 'Thought: <reasoning>' then either 'Action: <tool name>' and "
                "'Action Input: <JSON object>' (the result comes back as 'Observation: ...'), or "
                "'Final Answer: <reply to the user>'.")

    def parse_text(self, out: PolicyOutput) -> ParsedStep:
        calls, fails = [], []
        for i, (name, raw, span) in enumerate(_react_actions(out.text)):
            if not _TOOL_NAME.fullmatch(name):
                fails.append(ParseFailure(raw=span[:500], message=f"Action {name[:200]!r} is not a tool name"))
                continue
            try:
                calls.append(ParsedCall(id=f"call_{i}", name=name, arguments=_args_obj(raw)))
            except (ValueError, TypeError) as err:
                fails.append(ParseFailure(raw=span[:500], message=f"Action Input: {type(err).__name__}: {err}"))
        fa = _FINAL.search(out.text)
        if fa is not None:
            reply = out.text[fa.end():].strip()
        elif calls or fails:
            reply = ""
        else:
            reply = "\n".join(ln for ln in out.text.split("\n")
                              if not re.match(r"Thought[ \t]*:", ln.lstrip(), re.I)).strip()
        return ParsedStep(calls=tuple(calls), failures=tuple(fails), reply=reply)

    def tool_messages(self, calls: Sequence[ParsedCall], texts: Sequence[str]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "\n".join(f"Observation: {t}" for t in texts)}] if texts else []

    def render(self, calls: Sequence[ToolCall], text: str = "") -> PolicyOutput:
        if not calls:
            return PolicyOutput(text=f"Thought: done.\nFinal Answer: {text}")
        acts = "\n".join(f"Action: {c.name}\nAction Input: {json.dumps(c.arguments)}" for c in calls)
        return PolicyOutput(text=f"Thought: I will call {', '.join(c.name for c in calls)}.\n{acts}")

    def render_malformed(self, call: ToolCall) -> PolicyOutput:
        return PolicyOutput(text=f"Thought: calling {call.name}.\nAction: {call.name}\nAction Input: {{'oops': ")


@HARNESSES.register("native")
class NativeHarness:
    """Native OpenAI tool calls: the endpoint returns ``tool_calls``; results are ``tool`` messages with
    ``tool_call_id``; the text is the reply."""

    parser: ClassVar[str] = "openai-tool-calls-v1"
    tolerance: ClassVar[str] = "empty arguments = {}; ```json fences around the arguments string"
    native_tools: ClassVar[bool] = True  # calls arrive as native tool_calls (all harnesses pass the tools on)

    def instructions(self, tools: Sequence[dict]) -> str:
        return ""

    def parse(self, out: PolicyOutput) -> ParsedStep:
        calls, fails = [], []
        for tc in out.tool_calls:
            try:
                calls.append(ParsedCall(id=tc.id, name=tc.name, arguments=_args_obj(tc.arguments)))
            except (ValueError, TypeError) as err:
                fails.append(ParseFailure(raw=f"{tc.name}({tc.arguments[:400]})", message=f"{type(err).__name__}: {err}",
                                          id=tc.id))
        return ParsedStep(calls=tuple(calls), failures=tuple(fails), reply=out.text.strip())

    def assistant_message(self, out: PolicyOutput) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": out.text}
        if out.tool_calls:
            msg["tool_calls"] = [{"id": t.id, "type": "function",
                                  "function": {"name": t.name, "arguments": t.arguments}} for t in out.tool_calls]
        return msg

    def tool_messages(self, calls: Sequence[ParsedCall], texts: Sequence[str]) -> list[dict[str, Any]]:
        return [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": t} for c, t in zip(calls, texts)]

    def render(self, calls: Sequence[ToolCall], text: str = "") -> PolicyOutput:
        tcs = tuple(NativeCall(id=f"call_{i}", name=c.name, arguments=json.dumps(c.arguments))
                    for i, c in enumerate(calls))
        return PolicyOutput(text=text, tool_calls=tcs, finish_reason="tool_calls" if tcs else "stop")

    def render_malformed(self, call: ToolCall) -> PolicyOutput:
        return PolicyOutput(tool_calls=(NativeCall(id="call_0", name=call.name, arguments='{"oops": '),),
                            finish_reason="tool_calls")


def harness_args(h: Harness) -> dict[str, Any]:
    """A harness's constructor arguments that change its prompts (``{}`` for the argument-free ones)."""
    args = getattr(h, "args", None)
    return dict(args()) if callable(args) else {}


def harness_label(h: Harness) -> dict[str, Any]:
    """``{name, parser, tolerance}`` (and ``args`` when the harness has any) stored in every trajectory."""
    out = {"name": h.name, "parser": h.parser, "tolerance": h.tolerance}
    if harness_args(h):
        out["args"] = harness_args(h)
    return out
