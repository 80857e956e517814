"""The OpenClaw harness: the paper's third harness (seed: WEFT 4.1, "ReAct/OpenClaw/Hermes"), rebuilt
from OpenClaw's public documentation and its open source (``docs/concepts/system-prompt.md``,
``docs/concepts/agent.md``, ``src/agents/system-prompt.ts``), not from WEFT's code (unpublished).

What is reproduced:

- the system prompt is OpenClaw's, assembled from fixed sections in OpenClaw's order: the identity line,
  ``## Tooling`` (one ``- name: summary`` line per tool, "Tool names are case-sensitive"), ``## Tool Call
  Style``, ``## Safety``, ``## Workspace``, ``## Workspace Files (injected)``, ``## Reply Tags`` (full mode),
  ``# Project Context`` and ``## Silent Replies`` / ``## Heartbeats`` (full mode), ``## Runtime``;
- the workspace bootstrap files (``AGENTS.md``, ``SOUL.md``, ``TOOLS.md``, ``IDENTITY.md``, ``USER.md``,
  ``HEARTBEAT.md``) are injected under ``# Project Context`` as ``## <file>`` blocks in that order; a blank
  file is skipped, a missing one injects ``[MISSING] Expected at: <path>``, a file over
  ``bootstrap_max_chars`` (default 20 000) keeps its first 70 % and last 20 % around a truncation marker;
  with a ``SOUL.md`` present the "embody its persona" line is added;
- the tool protocol: OpenClaw's embedded runtime (pi-agent-core) calls tools through the provider's
  native function calling, and returns each result as a tool-result message tied to the call id: here
  native OpenAI ``tool_calls`` and ``tool`` messages (the parser of :class:`NativeHarness`);
- reply conventions: ``<think>`` blocks are dropped and ``<final>...</final>`` is the visible reply (its
  reasoning-tag format), ``[[reply_to_current]]`` / ``[[reply_to: id]]`` tags are stripped, a reply that
  is exactly ``NO_REPLY`` (its silent-reply token) is an empty reply.

Not reproduced (no public specification to follow, or meaningless outside a messaging gateway): the
Skills, Memory, Messaging, Documentation, Sandbox and CLI/self-update sections, sub-agents, the
``read``/``exec`` core tools (the task's MCP tools are the only tools), channel routing, compaction.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from treadle.weft.rollouts.harnesses import NativeHarness
from treadle.weft.rollouts.records import ParsedStep, PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES

BOOTSTRAP_FILES = ("AGENTS.md", "SOUL.md", "TOOLS.md", "IDENTITY.md", "USER.md", "HEARTBEAT.md")
SILENT_REPLY_TOKEN = "NO_REPLY"
IDENTITY_LINE = "You are a personal assistant running inside OpenClaw."
# the tag's body is bounded and cannot contain brackets, so a text of many unclosed tags is scanned once
_REPLY_TAG = re.compile(r"\[\[[ \t]*reply_to(?:_current[ \t]*|[ \t]*:[^\[\]\n]{0,200})\]\]")
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
_FINAL = re.compile(r"<final>(.*?)(?:</final>|\Z)", re.S)


def truncate_bootstrap(text: str, max_chars: int, name: str) -> str:
    """OpenClaw's trimming of a long bootstrap file: first 70 % + marker + last 20 % of ``max_chars``."""
    if len(text) <= max_chars:
        return text
    head, tail = int(max_chars * 0.7), int(max_chars * 0.2)
    return (text[:head] + f"\n[...truncated, read {name} for full content...]\n" + text[len(text) - tail:])


def default_workspace(base: str, tools: Sequence[dict]) -> dict[str, str]:
    """Bootstrap files of a fresh rollout workspace: ``AGENTS.md`` holds the task's operating
    instructions (``base``), ``TOOLS.md`` notes on the task's tools; the persona files are blank
    (OpenClaw skips blank files)."""
    notes = "\n".join(f"- `{t['name']}`: arguments are checked against its JSON schema; "
                      "an error comes back as the tool result." for t in tools)
    return {"AGENTS.md": f"# AGENTS.md\n\n{base}\nWork through the user's requests in order; verify with a read "
                         "tool when unsure.\n",
            "SOUL.md": "", "TOOLS.md": f"# TOOLS.md - tool notes\n\n{notes}\n" if notes else "",
            "IDENTITY.md": "", "USER.md": "", "HEARTBEAT.md": ""}


@HARNESSES.register("openclaw")
class OpenClawHarness(NativeHarness):
    """OpenClaw's system prompt and workspace injection over native tool calls (see the module doc).

    Args:
        workspace: bootstrap files ``{file name: content}`` (a file absent from the mapping is MISSING);
            None: :func:`default_workspace` of the task (``AGENTS.md`` = the task instructions).
        workspace_dir: read the bootstrap files from this folder instead (absent files are MISSING).
        prompt_mode: ``"full"`` (main agent) or ``"minimal"`` (sub-agent: no reply tags, silent replies,
            heartbeats).
        bootstrap_max_chars: per-file cap before trimming (OpenClaw's ``agents.defaults.bootstrapMaxChars``).

    Raises:
        ValueError: both ``workspace`` and ``workspace_dir``, an unknown file name, a bad mode or cap, a
            ``workspace_dir`` that is not a folder (all at construction, before any rollout).
    """

    parser: ClassVar[str] = "openclaw-native-v1"
    tolerance: ClassVar[str] = ("openai-tool-calls-v1 (empty arguments = {}; ```json fences); <think> dropped; "
                                "<final> extracted (unclosed at end of text too); [[reply_to...]] tags stripped; "
                                "exactly NO_REPLY = empty reply")

    def __init__(self, workspace: Mapping[str, str] | None = None, workspace_dir: str | None = None,
                 prompt_mode: str = "full", bootstrap_max_chars: int = 20_000):
        if workspace is not None and workspace_dir is not None:
            raise ValueError("give the OpenClaw workspace once: workspace (files) or workspace_dir (a folder)")
        if prompt_mode not in ("full", "minimal"):
            raise ValueError(f"prompt_mode must be 'full' or 'minimal', got {prompt_mode!r}")
        if not isinstance(bootstrap_max_chars, int) or bootstrap_max_chars < 100:
            raise ValueError(f"bootstrap_max_chars must be an int >= 100, got {bootstrap_max_chars!r}")
        if workspace is not None:
            bad = sorted(set(workspace) - set(BOOTSTRAP_FILES))
            if bad:
                raise ValueError(f"unknown OpenClaw bootstrap file(s) {bad}; expected some of {list(BOOTSTRAP_FILES)}")
            if any(not isinstance(v, str) for v in workspace.values()):
                raise ValueError("OpenClaw bootstrap file contents must be strings")
        if workspace_dir is not None and not Path(workspace_dir).is_dir():
            raise ValueError(f"workspace_dir {workspace_dir!r} is not a folder")
        self.workspace = dict(workspace) if workspace is not None else None
        self.workspace_dir = str(workspace_dir) if workspace_dir is not None else None
        self.prompt_mode, self.bootstrap_max_chars = prompt_mode, bootstrap_max_chars

    def args(self) -> dict[str, Any]:
        """What changes the prompt (part of every trajectory's key and label)."""
        out: dict[str, Any] = {"prompt_mode": self.prompt_mode, "bootstrap_max_chars": self.bootstrap_max_chars}
        if self.workspace is not None:
            out["workspace"] = dict(sorted(self.workspace.items()))
        if self.workspace_dir is not None:  # the files' contents, not only the path, define the prompt
            out["workspace_dir"] = self.workspace_dir
            out["workspace"] = {k: v for k, v in self._files("", ()).items() if v is not None}
        return out

    def instructions(self, tools: Sequence[dict]) -> str:
        return ""  # the whole system prompt is OpenClaw's: see system_prompt

    def _files(self, base: str, tools: Sequence[dict]) -> dict[str, str | None]:
        if self.workspace_dir is not None:
            root = Path(self.workspace_dir)
            return {n: (root / n).read_text(encoding="utf-8") if (root / n).is_file() else None
                    for n in BOOTSTRAP_FILES}
        files = self.workspace if self.workspace is not None else default_workspace(base, tools)
        return {n: files.get(n) for n in BOOTSTRAP_FILES}

    def system_prompt(self, base: str, tools: Sequence[dict]) -> str:
        """The OpenClaw system prompt for a task whose own instructions are ``base`` and tools ``tools``
        (runtime form: name, description, input_schema)."""
        full = self.prompt_mode == "full"
        where = self.workspace_dir or "~/.openclaw/workspace"
        lines = [IDENTITY_LINE, "", "## Tooling", "Tool availability (filtered by policy):",
                 "Tool names are case-sensitive. Call tools exactly as listed."]
        for t in tools:
            desc = " ".join((t.get("description") or "").split())
            lines.append(f"- {t['name']}: {desc}" if desc else f"- {t['name']}")
        lines += ["TOOLS.md does not control tool availability; it is user guidance for how to use external tools.",
                  "", "## Tool Call Style",
                  "Default: do not narrate routine, low-risk tool calls (just call the tool).",
                  "Narrate only when it helps: multi-step work, complex/challenging problems, sensitive actions "
                  "(e.g., deletions), or when the user explicitly asks.",
                  "Keep narration brief and value-dense; avoid repeating obvious steps.", "",
                  "## Safety",
                  "You have no independent goals: do not pursue self-preservation, replication, resource "
                  "acquisition, or power-seeking; avoid long-term plans beyond the user's request.",
                  "Prioritize safety and human oversight over completion; if instructions conflict, pause and ask.", "",
                  "## Workspace", f"Your working directory is: {where}",
                  "Treat this directory as the single global workspace for file operations unless explicitly "
                  "instructed otherwise.", "",
                  "## Workspace Files (injected)",
                  "These user-editable files are loaded by OpenClaw and included below in Project Context.", ""]
        if full:
            lines += ["## Reply Tags",
                      "To request a native reply/quote on supported surfaces, include one tag in your reply:",
                      "- [[reply_to_current]] replies to the triggering message.",
                      "Tags are stripped before sending; support depends on the current channel config.", ""]
        files = self._files(base, tools)
        injected = []
        for name, text in files.items():
            if text is None:
                injected.append((name, f"[MISSING] Expected at: {where.rstrip('/')}/{name}"))
            elif text.strip():
                injected.append((name, truncate_bootstrap(text, self.bootstrap_max_chars, name)))
        if injected:
            lines += ["# Project Context", "", "The following project context files have been loaded:"]
            if files.get("SOUL.md") and files["SOUL.md"].strip():
                lines.append("If SOUL.md is present, embody its persona and tone. Avoid stiff, generic replies; "
                             "follow its guidance unless higher-priority instructions override it.")
            lines.append("")
            for name, text in injected:
                lines += [f"## {name}", "", text, ""]
        if full:
            lines += ["## Silent Replies", f"When you have nothing to say, respond with ONLY: {SILENT_REPLY_TOKEN}",
                      "It must be your ENTIRE message, nothing else; never append it to a real response.", "",
                      "## Heartbeats", "Heartbeat prompt: (configured)",
                      "If you receive a heartbeat poll and nothing needs attention, reply exactly: HEARTBEAT_OK", ""]
        lines += ["## Runtime", "Runtime: agent=main | thinking=off",
                  "Reasoning: off (hidden unless on/stream)."]
        return "\n".join(x for x in lines if x is not None).replace("\n\n\n", "\n\n")

    @staticmethod
    def visible_reply(text: str) -> str:
        """The user-visible reply of an OpenClaw turn (think dropped, final extracted, tags stripped)."""
        t = _THINK.sub("", text)
        m = _FINAL.search(t)
        t = _REPLY_TAG.sub("", m.group(1) if m else t).strip()
        return "" if t == SILENT_REPLY_TOKEN else t

    def parse(self, out: PolicyOutput) -> ParsedStep:
        p = NativeHarness.parse(self, out)
        return p.model_copy(update={"reply": self.visible_reply(out.text)})
