"""Tokenizer of the tiny tool policy: the math model's character tokenizer plus tool-call tokens.

Same approach as :func:`treadle.models.tiny.build_tokenizer` (character-level ``WordLevel``, ChatML,
``<|im_end|>`` as EOS, left padding) with a small vocabulary extension: the Hermes harness's call markup
(``<tool_call>``, ``{"name": "``, ``", "arguments": ``), the shop's tool names, the JSON keys and status
values the shop returns, ``", "`` and the ``tool`` role. Each is one token, so a call is ~20 tokens instead
of ~80 characters. Decoding concatenates, so any text round-trips.

Chat template (:data:`TOOL_CHAT_TEMPLATE`): ChatML that also renders structured tool calls
(``assistant`` messages with ``tool_calls``, as TRL's tool loop and OpenAI-style clients write them) as the
Hermes blocks the policy writes itself (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
``json.dumps`` spacing), and ``tool`` messages as a ``tool`` turn. Every turn ends with the EOS token and is
rendered independently of what follows (prefix-preserving: appending a tool turn never changes earlier
tokens). Messages whose content already holds the blocks (the SFT data) render exactly as under the plain
ChatML template. Tool schemas are rendered (a ``system`` turn, one JSON schema per line) only when the caller
asks with the template variable ``render_tools=True`` (TRL: ``GRPOConfig(chat_template_kwargs={"render_tools":
True})``): the tiny policy learned the tools from the gold calls, and a character-level schema block would
multiply its context length. :data:`RESPONSE_TEMPLATE` is the transformers response parser of that output (set
as ``tokenizer.response_template``; TRL infers one only for the templates it bundles).
"""
from __future__ import annotations

from treadle.models.tiny import CHAT_TEMPLATE, build_tokenizer

__all__ = ["TOOL_TOKENS", "TOOL_CHAT_TEMPLATE", "RESPONSE_TEMPLATE", "build_tool_tokenizer", "with_tool_calling"]

_TOOLS = ["find_customer", "search_products", "get_order", "list_orders", "place_order", "cancel_order",
          "ship_order", "open_ticket", "close_ticket"]
_KEYS = ["id", "name", "email", "customer_id", "items", "sku", "qty", "order_id", "ticket_id", "subject",
         "resolution", "status", "total_cents", "price_cents", "stock"]
TOOL_TOKENS: tuple[str, ...] = tuple(
    ["<tool_call>", "</tool_call>", '{"name": "', '", "arguments": ', "tool", ", "] + _TOOLS
    + [f'"{k}": ' for k in _KEYS] + ['"placed"', '"shipped"', '"cancelled"', '"open"', '"closed"'])

TOOL_CHAT_TEMPLATE = (
    "{% if tools and render_tools %}<|im_start|>system"
    "{% for tool in tools %}{{ '\\n' }}{{ (tool.function if tool.function is defined else tool) | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call.function if call.function is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<tool_call>\n"
    # (no literal text of the template may equal an added token other than the markup: transformers' response
    # parser treats such tokens as control tokens and defuses them in generated text, breaking the JSON)
    "{% if f.arguments is string %}"
    "{{ '{\"na' ~ 'me\":' ~ ' ' ~ (f.name | tojson) ~ ',' ~ ' \"arguments\":' ~ ' ' ~ f.arguments ~ '}' }}"
    "{% else %}{{ {'name': f.name,'arguments': f.arguments} | tojson }}{% endif %}{{ '\\n' }}</tool_call>"
    "{% endfor %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with structured tool calls and optional tool schemas (see the module docstring)."""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
"""transformers' response parser of the policy's output: Hermes ``<tool_call>`` JSON blocks -> ``tool_calls``,
the rest -> ``content`` (the Qwen3 shape without reasoning)."""


def with_tool_calling(tokenizer):
    """``tokenizer`` with :data:`TOOL_CHAT_TEMPLATE` (when its template is the tiny ChatML one, which renders the
    same text for plain messages) and :data:`RESPONSE_TEMPLATE` (when it has no response template); returned
    for chaining. Other templates are left alone (a checkpoint's own tool-calling template wins)."""
    if getattr(tokenizer, "chat_template", None) in (CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE):
        tokenizer.chat_template = TOOL_CHAT_TEMPLATE
        if getattr(tokenizer, "response_template", None) is None:
            tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def build_tool_tokenizer():
    """A ``PreTrainedTokenizerFast``: :func:`treadle.models.tiny.build_tokenizer`'s vocabulary (same ids)
    followed by :data:`TOOL_TOKENS` (ids from 101 on; matched longest-first anywhere in the text), with the
    tool-calling chat template and response parser (:func:`with_tool_calling`)."""
    return with_tool_calling(build_tokenizer(TOOL_TOKENS, model_max_length=1024))
