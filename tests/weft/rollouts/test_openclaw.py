"""The OpenClaw harness: OpenClaw's system prompt with workspace bootstrap files, native tool calls, its
reply conventions, and a whole rollout on the shop tasks (tested like the other harnesses)."""
import pytest

from treadle.llm.records import ToolCall as NativeCall
from treadle.weft.runtime.callparse import ToolCall
from treadle.weft.rollouts.batch import Component, SampleConfig, sample
from treadle.weft.rollouts.harnesses import harness_label
from treadle.weft.rollouts.openclaw import OpenClawHarness, truncate_bootstrap
from treadle.weft.rollouts.records import PolicyOutput
from treadle.weft.rollouts.registry import HARNESSES
from treadle.weft.rollouts.rollout import BASE_INSTRUCTIONS, Env, system_message
from treadle.weft.rollouts.tasks import from_shop

TOOLS = ({"name": "find_customer", "description": "Find a customer\n by email.", "input_schema": {"type": "object"}},
         {"name": "get_time", "description": "", "input_schema": {"type": "object"}})


def test_system_prompt_sections_and_project_context():
    h = HARNESSES.build("openclaw")
    msg = system_message(Env(server_hash="x", snapshot=None, tools=TOOLS), h)
    text = msg["content"]
    assert text.startswith("You are a personal assistant running inside OpenClaw.\n\n## Tooling\n")
    assert "- find_customer: Find a customer by email.\n- get_time\n" in text  # one line per tool, in order
    order = ["## Tooling", "## Tool Call Style", "## Safety", "## Workspace\n", "## Workspace Files (injected)",
             "## Reply Tags", "# Project Context", "## AGENTS.md", "## TOOLS.md", "## Silent Replies",
             "## Heartbeats", "## Runtime"]
    assert [text.index(s) for s in order] == sorted(text.index(s) for s in order)
    assert BASE_INSTRUCTIONS in text.split("## AGENTS.md")[1]  # the task's instructions live in AGENTS.md
    assert "## SOUL.md" not in text and "embody its persona" not in text  # blank files are skipped
    assert "\n\n\n" not in text


def test_workspace_files_missing_marker_truncation_and_soul():
    h = OpenClawHarness(workspace={"AGENTS.md": "Be exact.", "SOUL.md": "Calm and brief.", "USER.md": "x" * 300},
                        bootstrap_max_chars=100, prompt_mode="minimal")
    text = h.system_prompt("ignored base", TOOLS)
    assert "## AGENTS.md\n\nBe exact.\n" in text and "ignored base" not in text
    assert "If SOUL.md is present, embody its persona" in text
    assert "## TOOLS.md\n\n[MISSING] Expected at: ~/.openclaw/workspace/TOOLS.md" in text
    user = text.split("## USER.md\n\n")[1].split("\n## ")[0]
    assert user.startswith("x" * 70) and "[...truncated, read USER.md for full content...]" in user
    assert "## Silent Replies" not in text and "## Reply Tags" not in text  # minimal mode
    assert truncate_bootstrap("abc", 100, "A.md") == "abc"
    assert harness_label(h)["args"]["workspace"]["SOUL.md"] == "Calm and brief."


def test_workspace_dir(tmp_path):
    (tmp_path / "AGENTS.md").write_text("From disk.")
    text = OpenClawHarness(workspace_dir=str(tmp_path)).system_prompt("base", TOOLS)
    assert "## AGENTS.md\n\nFrom disk." in text and f"[MISSING] Expected at: {tmp_path}/SOUL.md" in text
    assert f"Your working directory is: {tmp_path}" in text


@pytest.mark.parametrize("kw, match", [
    ({"workspace": {"NOTES.md": ""}}, "unknown OpenClaw bootstrap file"),
    ({"workspace": {}, "workspace_dir": "."}, "once"),
    ({"workspace_dir": "/no/such/dir"}, "not a folder"),
    ({"prompt_mode": "tiny"}, "prompt_mode"),
    ({"bootstrap_max_chars": 5}, "bootstrap_max_chars"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        OpenClawHarness(**kw)


def test_native_calls_and_reply_conventions():
    h = HARNESSES.build("openclaw")
    calls = [ToolCall(name="find_customer", arguments={"email": "ada@example.com"})]
    p = h.parse(h.render(calls))
    assert [(c.name, c.arguments) for c in p.calls] == [("find_customer", {"email": "ada@example.com"})]
    assert h.tool_messages(p.calls, ["r"])[0]["tool_call_id"] == p.calls[0].id
    bad = h.parse(h.render_malformed(calls[0]))
    assert bad.calls == () and len(bad.failures) == 1
    assert h.parse(PolicyOutput(text="<think>plan</think><final>[[reply_to_current]] Done.</final>")).reply == "Done."
    assert h.parse(PolicyOutput(text="<final>Done, unclosed")).reply == "Done, unclosed"
    assert h.parse(PolicyOutput(text="NO_REPLY")).reply == ""
    assert h.parse(PolicyOutput(text="Said NO_REPLY in a sentence.")).reply == "Said NO_REPLY in a sentence."
    mixed = h.parse(PolicyOutput(text="ok", tool_calls=(NativeCall(id="a", name="f", arguments="{bad"),)))
    assert mixed.failures[0].id == "a" and mixed.reply == "ok"


def test_rollouts_with_openclaw_harness(tmp_path):
    cfg = SampleConfig(harness=Component(name="openclaw"), methods=("prefix",), ks=(1,))
    trs = sample(tmp_path, from_shop(), cfg)
    assert len(trs) == 2 and all(t.accepted for t in trs)
    t = trs[0]
    assert t.harness["name"] == "openclaw" and t.harness["parser"] == "openclaw-native-v1"
    assert t.messages[0]["content"].startswith("You are a personal assistant running inside OpenClaw.")
    assert any(m.get("tool_calls") for m in t.messages) and any(m["role"] == "tool" for m in t.messages)
    # another workspace is another config: its keys differ (a resume never mixes them)
    other = SampleConfig(harness=Component(name="openclaw", args={"workspace": {"AGENTS.md": "x"}}),
                         methods=("prefix",), ks=(1,))
    t2 = sample(tmp_path / "other", from_shop(), other)[0]
    assert t2.key != t.key and "## AGENTS.md\n\nx\n" in t2.messages[0]["content"]
