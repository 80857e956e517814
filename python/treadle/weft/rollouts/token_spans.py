"""Where each assistant turn lies in a chat-template rendering, in characters and in tokens.

A conversation is rendered with the model's chat template once per prefix: ``before_j`` (messages before
assistant turn ``j`` plus the generation prompt: exactly the prompt the model was given for that turn) and
``after_j`` (messages up to and including turn ``j``). The turn's characters are ``after_j[len(before_j):]``:
its own part (what the model writes, up to and including the end-of-turn string) and a tail the template
adds after it (``"\\n"`` in ChatML). Token positions come from tokenising the whole rendering once, with
character offsets, and are checked: a position counts only when the tokenisation of the text up to it is a
prefix of the whole (computed from the last added token before it, which splits the text for every
tokeniser, or over the whole prefix when that fails). A token the rendering merges across a turn's start
or end fails the check and is flagged. No piece is ever tokenised on its own and concatenated: tokenisers that prepend a
word-boundary marker (SentencePiece ``▁``) or merge across pieces would give tokens the model never saw.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One assistant turn, as character positions in ``text``: the rendering of the last turn of its run
    (every rendering of the run is a prefix of it)."""

    j: int  # index of the assistant message
    text: str  # the run's whole rendering (one string shared by the run's turns)
    start: int  # end of the rendering of messages[:j] with the generation prompt (the prompt of this turn)
    end: int  # end of the rendering of messages[:j + 1]
    own_end: int  # end of the turn's own text, the end-of-turn string included (the template's tail follows)
    has_eot: bool  # the own text ends with the end-of-turn string
    rewritten: bool  # the own text is not the message's text (+ end-of-turn): the template wrote it
    first: bool  # the first turn of its run

    @property
    def prompt(self) -> str:
        return self.text[:self.start]


def message_text(m: dict) -> str:
    """The text of a message's ``content`` (a string, or the ``text`` of its parts)."""
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def render_turns(messages: Sequence[dict], tools: Sequence[dict] | None, tokenizer: Any, idx: Sequence[int],
                 eot: str) -> list[Turn]:
    """:class:`Turn` of each assistant message index in ``idx``, grouped in runs whose renderings continue
    each other: a new run starts where the template renders earlier history differently once later
    messages exist (Qwen3 drops the thinking of turns before the last user message), so a run is exactly the
    text the model saw when it wrote its turns. Only each run's last rendering is kept (memory O(text)).

    Raises:
        ValueError: the template renders a turn that does not continue its own generation prompt.
    """
    tl = list(tools) if tools else None

    def render(msgs: Sequence[dict], gen: bool) -> str:
        out = tokenizer.apply_chat_template(list(msgs), tools=tl, tokenize=False, add_generation_prompt=gen)
        if not isinstance(out, str):
            raise ValueError(f"chat template rendering gave {type(out).__name__}, expected text")
        return out

    turns: list[Turn] = []
    run: list[tuple] = []
    last = ""
    for j in idx:
        before, after = render(messages[:j], True), render(messages[: j + 1], False)
        if not after.startswith(before):
            raise ValueError(f"chat template: message {j} does not continue the generation prompt")
        if run and not before.startswith(last):
            turns += [Turn(*x[:1], last, *x[1:], n == 0) for n, x in enumerate(run)]
            run = []
        span = after[len(before):]
        cut = span.rfind(eot)
        own = span[: cut + len(eot)] if cut >= 0 else span
        written = own[: -len(eot)] if cut >= 0 else own
        run.append((j, len(before), len(after), len(before) + len(own), cut >= 0,
                    written != message_text(messages[j])))
        last = after
    return turns + [Turn(*x[:1], last, *x[1:], n == 0) for n, x in enumerate(run)]


class Encoder:
    """Tokenisation as ``apply_chat_template(tokenize=True)`` does it (``add_special_tokens=False``)."""

    def __init__(self, tokenizer: Any, eot: str) -> None:
        self.tok, self.eot = tokenizer, eot
        self.eot_ids = self(eot)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        # added tokens matched in the raw text (not normalised) split it into pieces the tokeniser handles one by
        # one: the tokenisation of a prefix that ends after such a token is the prefix of the whole one
        self.anchors = frozenset(i for i, t in added.items() if getattr(t, "normalized", True) is False)
        self.eot_added = eot in {str(getattr(t, "content", t)) for t in added.values()}

    def __call__(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def rendering(self, text: str) -> Rendering:
        return Rendering(self, text)


class Rendering:
    """One rendering tokenised once (with character offsets where the tokeniser gives them) and the token
    index of a character position, checked: ``at(c)`` is ``k`` only when ``ids[:k]`` is the tokenisation of
    ``text[:c]`` (what the model is given when its prompt ends at ``c``)."""

    def __init__(self, enc: Encoder, text: str) -> None:
        self.enc, self.text = enc, text
        try:
            out = enc.tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            self.ids, self.offs = list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]
        except (NotImplementedError, ValueError, TypeError, KeyError):  # a slow tokeniser has no offsets
            self.ids, self.offs = enc(text), None
        if self.offs is not None and len(self.offs) != len(self.ids):
            self.offs = None
        self.starts = [o[0] for o in self.offs] if self.offs is not None else None
        self.anchors = [i for i, x in enumerate(self.ids) if x in enc.anchors]

    def at(self, c: int) -> int | None:
        """Token index of character position ``c``, or None when no prefix of the ids tokenises ``text[:c]``
        (a token of the rendering spans ``c``, or the prefix alone tokenises differently)."""
        if c >= len(self.text):
            return len(self.ids)
        if self.starts is not None:  # located by offsets, checked from the last anchor before it
            k = bisect.bisect_left(self.starts, c)
            n = bisect.bisect_left(self.anchors, k) - 1
            if n >= 0 and self.enc(self.text[self.offs[self.anchors[n]][0]:c]) == self.ids[self.anchors[n]:k]:
                return k
        pre = self.enc(self.text[:c])  # the whole prefix: the authority when the local check fails
        return len(pre) if self.ids[:len(pre)] == pre else None

    def own_end(self, t: Turn, k_a: int, k_t: int) -> int | None:
        """Token index where turn ``t``'s own tokens end (``k_a``/``k_t``: its start and the end of its tail),
        or None when no token boundary is there."""
        if t.own_end == t.end:
            return k_t
        n, ids = len(self.enc.eot_ids), self.ids
        if t.has_eot and n and self.enc.eot_added:  # the last end-of-turn token inside the turn
            for k in range(k_t - n, k_a - 1, -1):
                if ids[k:k + n] == self.enc.eot_ids:
                    return k + n
        return self.at(t.own_end)

    def eot_start(self, t: Turn, k_a: int, k_b: int) -> int | None:
        """Token index where the end-of-turn tokens of the own range ``[k_a, k_b)`` start (None: none there)."""
        n, eot = len(self.enc.eot_ids), self.enc.eot_ids
        if t.has_eot and n and k_b - n >= k_a and self.ids[k_b - n:k_b] == eot:
            return k_b - n
        return None

    def own_by_offsets(self, t: Turn, lo: int, hi: int, end_known: bool) -> tuple[int, int]:
        """``[k_a, k_b)``: the tokens of ``ids[lo:hi]`` whose characters lie in turn ``t``'s own text, by the
        offsets (a token spanning the turn's start or end is not the turn's; an end-of-turn token that also
        takes the whitespace after it is). Empty, at ``hi`` when the turn's end is known (``end_known``) else
        at ``lo``, when the tokeniser gives no offsets."""
        a, b = t.start, t.own_end
        eot_at = b - len(self.enc.eot) if t.has_eot else b
        offs = self.offs
        if offs is None:
            k = hi if end_known else lo
            return k, k
        inside = [i for i in range(lo, hi) if a <= offs[i][0] < b and (offs[i][1] <= b or offs[i][0] >= eot_at)]
        if not inside:
            k = next((i for i in range(lo, hi) if offs[i][0] >= b), hi)
            return k, k
        return inside[0], inside[-1] + 1


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
