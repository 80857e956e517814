"""Tokenizer of the tiny tool policy: the math model's character tokenizer plus tool-call tokens.

Same approach as :func:`treadle.models.tiny.build_tokenizer` (character-level ``WordLevel``, ChatML
template, ``<|im_end|>`` as EOS, left padding) with a small vocabulary extension: the Hermes
harness's call markup (``<tool_call>``, ``{"name": "``, ``", "arguments": ``), the shop's tool names,
the JSON keys and status values the shop returns, ``", "`` and the ``tool`` role. Each is one token,
so a call is ~20 tokens instead of ~80 characters. Decoding concatenates, so any text round-trips.
"""
from __future__ import annotations

from treadle.models.tiny import build_tokenizer

__all__ = ["TOOL_TOKENS", "build_tool_tokenizer"]

_TOOLS = ["find_customer", "search_products", "get_order", "list_orders", "place_order", "cancel_order",
          "ship_order", "open_ticket", "close_ticket"]
_KEYS = ["id", "name", "email", "customer_id", "items", "sku", "qty", "order_id", "ticket_id", "subject",
         "resolution", "status", "total_cents", "price_cents", "stock"]
TOOL_TOKENS: tuple[str, ...] = tuple(
    ["<tool_call>", "</tool_call>", '{"name": "', '", "arguments": ', "tool", ", "] + _TOOLS
    + [f'"{k}": ' for k in _KEYS] + ['"placed"', '"shipped"', '"cancelled"', '"open"', '"closed"'])


def build_tool_tokenizer():
    """A ``PreTrainedTokenizerFast``: :func:`treadle.models.tiny.build_tokenizer`'s vocabulary (same ids)
    followed by :data:`TOOL_TOKENS` (ids from 101 on; matched longest-first anywhere in the text)."""
    return build_tokenizer(TOOL_TOKENS, model_max_length=1024)
