"""Samples are exactly the whole-conversation rendering, token for token, for every tokeniser family
(byte-level BPE, tiktoken-style, SentencePiece layouts with and without byte fallback, WordPiece with
added-token templates) under every chat template layout (ChatML/Qwen3 with thinking dropped from history,
Llama-3, Mistral, added-token markers), with tools, native and text tool calls and consecutive tool results.

The oracle is transformers itself: ``apply_chat_template(messages[:k + 1], tools=..., tokenize=True)`` for
the ids and ``return_assistant_tokens_mask=True`` (the templates mark the assistant's text with
``{% generation %}``) for which tokens are the assistant's; both are computed independently of the code
under test. Every budget cut is checked at the exact limit (a turn that ends exactly at ``max_tokens``
fits; one token less drops it) and every assistant turn is in a sample or named by an ``over_budget`` flag.
"""
from __future__ import annotations

import functools
import json

import pytest

from treadle.weft.rollouts.tokens import IGNORE, tokenize_conversation

from .chat_templates import TEMPLATES
from .tokenizer_families import FAMILIES, build

TOOLS = [{"type": "function", "function": {"name": "find_customer", "description": "Look a customer up.",
                                           "parameters": {"type": "object",
                                                          "properties": {"email": {"type": "string"}}}}}]


def _call(i, email="ada@example.com"):
    return {"id": f"c{i}", "type": "function",
            "function": {"name": "find_customer", "arguments": json.dumps({"email": email})}}


PLAIN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find customer ada@example.com"},
         {"role": "assistant", "content": "Ada Lovelace ordered a replacement."},
         {"role": "user", "content": "And Alan?"},
         {"role": "assistant", "content": "Alan Turing cancelled his order. Café ✓ 𝔘 naïve."}]
NATIVE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Do two things."},
          {"role": "assistant", "content": "", "tool_calls": [_call(0), _call(1, "alan@example.com")]},
          {"role": "tool", "tool_call_id": "c0", "content": "R0"},                   # consecutive results
          {"role": "tool", "tool_call_id": "c1", "content": "R1"},
          {"role": "assistant", "content": "Both done."}]
TEXT_CALLS = [{"role": "user", "content": "Find Ada."},
              {"role": "assistant", "content": '<tool_call>\n{"name": "find_customer", "arguments": '
                                               '{"email": "ada@example.com"}}\n</tool_call>'},
              {"role": "tool", "content": '{"id": 1}'}, {"role": "tool", "content": '{"id": 2}'},
              {"role": "assistant", "content": "The result is ready: refund issued."},
              {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Both done."}]
THINKING = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nAda"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\nAlan"}]
EDGES = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "\n\nindented  "},
         {"role": "user", "content": "y"}, {"role": "assistant", "content": " Ada"},
         {"role": "user", "content": "z"}, {"role": "assistant", "content": ""}]
CONVS = {"plain": PLAIN, "native": NATIVE, "text_calls": TEXT_CALLS, "thinking": THINKING, "edges": EDGES}
COMBOS = [(f, t) for f in FAMILIES for t in TEMPLATES]


@functools.lru_cache(maxsize=None)
def _tok(family, template):
    tpl, eos, bos = TEMPLATES[template]
    return build(family, tpl, eos, bos)


def _ids(tok, msgs, gen=False):
    return list(tok.apply_chat_template(list(msgs), tools=TOOLS, add_generation_prompt=gen)["input_ids"])


def _text(tok, msgs, gen=False):
    return tok.apply_chat_template(list(msgs), tools=TOOLS, tokenize=False, add_generation_prompt=gen)


def _assistant_runs(tok, msgs):
    """``(ids, {assistant message index: (start, end)})`` of the rendering of ``msgs`` by transformers'
    assistant mask: each run of masked tokens is one assistant message, in order."""
    out = tok.apply_chat_template(list(msgs), tools=TOOLS, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    runs, k = [], 0
    while k < len(mask):
        if mask[k]:
            e = k
            while e < len(mask) and mask[e]:
                e += 1
            runs.append((k, e))
            k = e
        else:
            k += 1
    js = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(runs) == len(js), "test template: one assistant run per assistant message"
    return ids, dict(zip(js, runs))


def _flagged(s, kind):
    return {int(f.split(":")[1]) for f in s.flags if f.startswith(kind + ":")}


def _check(tok, conv, samples, *, max_tokens=None, masked_kinds=("truncated_turn", "over_turn_budget"), whole=True):
    """Every sample is the rendering of its messages token for token; its trainable tokens are exactly the
    assistant tokens of the turns it trains; every assistant turn is in one sample or named over budget."""
    asst = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
    seen = []
    for s in samples:
        seen += list(s.turns) + sorted(_flagged(s, "over_budget") | _flagged(s, "dropped"))
        assert len(s.input_ids) == len(s.labels)
        if max_tokens is not None:
            assert len(s.input_ids) <= max_tokens
        if not s.turns:  # the record of turns left out
            assert not s.input_ids and (_flagged(s, "over_budget") or _flagged(s, "dropped"))
            continue
        end = s.turns[-1]
        ids, runs = _assistant_runs(tok, conv[:end + 1])
        assert list(s.input_ids) == ids == _ids(tok, conv[:end + 1])   # the whole rendering, token for token
        offs = tok(_text(tok, conv[:end + 1]), add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        want = [IGNORE] * len(ids)
        masked = set().union(*(_flagged(s, k) for k in masked_kinds))
        for j in s.turns:
            if j in masked:
                continue
            a, b = runs[j]
            start = len(_text(tok, conv[:j], gen=True))
            for k in range(a, b):
                # a token the rendering merges across the turn's start is context (flagged merged_boundary)
                if offs[k][0] >= start or j not in _flagged(s, "merged_boundary"):
                    want[k] = ids[k]
        assert list(s.labels) == want
        for j in _flagged(s, "merged_boundary"):  # only where the rendering really merges across the start
            a, _ = runs[j]
            assert offs[a][0] < len(_text(tok, conv[:j], gen=True))
        if max_tokens is not None and _flagged(s, "over_budget"):
            first = min(_flagged(s, "over_budget"))
            assert len(_ids(tok, conv[:first + 1])) > max_tokens  # the turn it dropped did not fit
    if whole:
        assert sorted(seen) == asst  # no assistant turn left out without a record


@pytest.mark.parametrize("family,template", COMBOS)
@pytest.mark.parametrize("conv", sorted(CONVS))
def test_samples_are_the_whole_rendering_token_for_token(family, template, conv):
    tok, msgs = _tok(family, template), CONVS[conv]
    samples = tokenize_conversation(msgs, TOOLS, tok)
    _check(tok, msgs, samples)
    flags = {f for s in samples for f in s.flags}
    if conv == "native":  # the template wrote the calls; without the model's ids that is flagged
        assert "text_rewritten:2" in flags
    if conv in ("plain", "text_calls"):  # the rendering is the message text: exact, nothing to flag
        assert not {f for f in flags if not f.startswith("merged_boundary")}
    if conv == "thinking" and template == "chatml_qwen3":  # history re-rendered without the thinking: split
        assert [s.turns for s in samples] == [(1,), (3,)] and samples[1].flags[0] == "split_at:3"
    else:
        assert len(samples) == 1


@pytest.mark.parametrize("family,template", COMBOS)
def test_masked_turns_and_rewritten_setting(family, template):
    tok = _tok(family, template)
    s = tokenize_conversation(NATIVE, TOOLS, tok, truncated=[5])
    _check(tok, NATIVE, s)
    assert "truncated_turn:5" in s[0].flags
    (m,) = tokenize_conversation(NATIVE, TOOLS, tok, rewritten="mask")
    _check(tok, NATIVE, [m], masked_kinds=("text_rewritten",))
    assert "text_rewritten:2" in m.flags and m.trainable < tokenize_conversation(NATIVE, TOOLS, tok)[0].trainable
    (d,) = tokenize_conversation(NATIVE, TOOLS, tok, rewritten="drop")  # the sample left out, its record kept
    _check(tok, NATIVE, [d])
    assert d.input_ids == () and {"text_rewritten:2", "dropped:2", "dropped:5"} <= set(d.flags)
    assert tokenize_conversation(PLAIN, TOOLS, tok, rewritten="drop")[0].input_ids  # exact samples stay
    # a turn of exactly max_turn_tokens tokens is trained, one token more is masked
    _, runs = _assistant_runs(tok, NATIVE)
    n5 = runs[5][1] - runs[5][0]
    for limit, flagged in ((n5, False), (n5 - 1, True)):
        (s,) = tokenize_conversation(NATIVE, TOOLS, tok, max_turn_tokens=limit)
        _check(tok, NATIVE, [s])
        assert ("over_turn_budget:5" in s.flags) == flagged


@pytest.mark.parametrize("family,template", COMBOS)
@pytest.mark.parametrize("conv", ["native", "text_calls", "thinking"])
def test_every_budget_cut_names_what_it_cut(family, template, conv):
    tok, msgs = _tok(family, template), CONVS[conv]
    ends = sorted({len(_ids(tok, msgs[:j + 1])) for j, m in enumerate(msgs) if m["role"] == "assistant"})
    for b in sorted({1, *ends, *(e - 1 for e in ends), *(e + 1 for e in ends)}):
        samples = tokenize_conversation(msgs, TOOLS, tok, max_tokens=b)
        _check(tok, msgs, samples, max_tokens=b)
        for e in ends:  # a sample that ends exactly at the budget keeps its last turn
            if e == b and conv != "thinking":
                assert len(samples[0].input_ids) == b


def test_a_split_before_the_budget_records_the_later_turns():
    """Two runs (thinking dropped from history); the budget holds the first run only: the second run's
    turn is named in an empty record sample, never left out silently."""
    tok = _tok("byte_level", "chatml_qwen3")
    first = len(_ids(tok, THINKING[:2]))
    s1, s2 = tokenize_conversation(THINKING, TOOLS, tok, max_tokens=first)
    assert s1.turns == (1,) and s1.flags == () and len(s1.input_ids) == first
    assert s2.input_ids == () and s2.flags == ("split_at:3", "over_budget:3")
    (s,) = tokenize_conversation(THINKING, TOOLS, tok, max_tokens=first - 1)[:1]
    assert s.input_ids == () and s.flags == ("over_budget:1",)


def test_metaspace_turn_is_trained_as_the_rendering_not_as_a_lone_piece():
    """SentencePiece layout: a turn tokenised alone starts with '▁Ada'; in the rendering it is 'A', 'da'."""
    tok = _tok("sp_metaspace", "mistral")
    alone = tok("Ada Lovelace ordered a replacement.</s>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(alone)[0] == "▁Ada"
    (s,) = tokenize_conversation(PLAIN, TOOLS, tok)
    trained = [i for i, lab in zip(s.input_ids, s.labels) if lab != IGNORE]
    assert tok.convert_ids_to_tokens(trained)[:2] == ["A", "da"] and alone[0] not in trained
    _check(tok, PLAIN, [s])


def _own(tok, conv, j):
    """The rendering's own tokens of assistant turn ``j`` (transformers' assistant mask)."""
    ids, runs = _assistant_runs(tok, conv[:j + 1])
    return ids[slice(*runs[j])]


def _split_one(tok, family, ids):
    """``ids`` with one multi-character token written as two tokens of the vocabulary (same text)."""
    vocab, special = tok.get_vocab(), set(tok.all_special_ids)
    for k, i in enumerate(ids):
        t = tok.convert_ids_to_tokens(i)
        if i in special or t.startswith("<0x"):
            continue
        pre = "##" if family == "wordpiece" and t.startswith("##") else ""
        body = t[len(pre):]
        for p in range(1, len(body)):
            a, b = pre + body[:p], ("##" if family == "wordpiece" else "") + body[p:]
            if a in vocab and b in vocab:
                return ids[:k] + [vocab[a], vocab[b]] + ids[k + 1:]
    raise AssertionError("no token to split")


@pytest.mark.parametrize("family,template", COMBOS)
def test_policy_ids_are_kept_and_checked_against_the_rendering(family, template):
    tok = _tok(family, template)
    eot = tok(TEMPLATES[template][1], add_special_tokens=False)["input_ids"]
    plain = tokenize_conversation(NATIVE, TOOLS, tok)
    # the model's ids are the rendering's: the same sample, and nothing left to flag
    own = {j: _own(tok, NATIVE, j) for j in (2, 5)}
    (s,) = tokenize_conversation(NATIVE, TOOLS, tok, policy_ids=own)
    assert (s.input_ids, s.labels) == (plain[0].input_ids, plain[0].labels) and s.flags == ()
    # ids that end before the end-of-turn token (a stop string): the template's eot is there, masked
    cut = {j: g[:-len(eot)] for j, g in own.items()}
    assert all(g[-len(eot):] == eot for g in own.values())
    (s,) = tokenize_conversation(NATIVE, TOOLS, tok, policy_ids=cut)
    assert s.input_ids == plain[0].input_ids and s.flags == ()
    assert s.trainable == plain[0].trainable - 2 * len(eot)
    # ids that spell the same text in other tokens: kept in place (flagged), the rest of the sample unchanged
    other = _split_one(tok, family, own[5])
    assert tok.decode(other) == tok.decode(own[5]) and other != own[5]
    (s,) = tokenize_conversation(NATIVE, TOOLS, tok, policy_ids={5: other})
    ids, runs = _assistant_runs(tok, NATIVE)
    a, b = runs[5]
    assert list(s.input_ids) == ids[:a] + other + ids[b:] and s.flags == ("text_rewritten:2", "ids_kept:5")
    assert [i for i, lab in zip(s.input_ids, s.labels) if lab != IGNORE] == own[2] + other


@pytest.mark.parametrize("family,template", COMBOS)
def test_ids_of_other_text_end_the_sample_and_the_next_starts_from_the_rendering(family, template):
    """The model wrote compact JSON; the template re-serialises the calls: the first sample is the model's
    prompt and its ids, the next sample the whole rendering (what the model saw next)."""
    tok = _tok(family, template)
    wrote = tok('[{"name":"find_customer","arguments":{"email":"ada@example.com"}}]' + TEMPLATES[template][1],
                add_special_tokens=False)["input_ids"]
    s1, s2 = tokenize_conversation(NATIVE, TOOLS, tok, policy_ids={2: wrote})
    prompt = _ids(tok, NATIVE[:2], gen=True)
    assert list(s1.input_ids) == prompt + wrote and s1.flags == ("ids_differ:2",) and s1.turns == (2,)
    assert list(s1.labels) == [IGNORE] * len(prompt) + wrote
    assert s2.flags == ("split_at:5",) and s2.turns == (5,)
    _check(tok, NATIVE, [s2], whole=False)
    # over budget: the turn is named, the later sample still comes
    budget = len(prompt) + len(wrote) - 1
    r1, r2 = tokenize_conversation(NATIVE, TOOLS, tok, policy_ids={2: wrote}, max_tokens=budget)
    assert r1.input_ids == () and r1.flags == ("over_budget:2",) and r1.turns == ()
    assert len(_ids(tok, NATIVE)) > budget and r2.flags == ("split_at:5", "over_budget:5") and r2.input_ids == ()


def test_sentencepiece_ids_of_a_lone_piece_are_what_the_model_wrote():
    """With SentencePiece, ids the model wrote as '▁Ada' (text ' Ada') do not spell the rendering 'Ada': the
    sample is the model's prompt and those ids, never '▁Ada' spliced into 'A', 'da' history."""
    tok = _tok("sp_metaspace", "mistral")
    g = tok("Ada Lovelace ordered a replacement.</s>", add_special_tokens=False)["input_ids"]
    s1, s2 = tokenize_conversation(PLAIN, TOOLS, tok, policy_ids={2: g})
    assert s1.flags == ("ids_differ:2",) and list(s1.input_ids) == _ids(tok, PLAIN[:2], gen=True) + g
    assert s2.flags == ("split_at:4",)
    _check(tok, PLAIN, [s2], whole=False)


def test_bad_policy_ids():
    tok = _tok("byte_level", "chatml_qwen3")
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        tokenize_conversation(PLAIN, TOOLS, tok, policy_ids={2: [len(tok) + 5]})
    with pytest.raises(ValueError, match="token id lists"):
        tokenize_conversation(PLAIN, TOOLS, tok, policy_ids={2: ["x"]})
    with pytest.raises(ValueError, match="rewritten"):
        tokenize_conversation(PLAIN, TOOLS, tok, rewritten="skip")


class _NoOffsets:
    """A tokeniser without character offsets (a slow, pure-Python one): everything else delegated."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, text, **kw):
        if kw.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._tok(text, **kw)


@pytest.mark.parametrize("family,template", [("byte_level", "chatml_qwen3"), ("sp_metaspace", "mistral"),
                                             ("sp_normalizer", "chatml_qwen3")])
def test_a_tokenizer_without_offsets_gives_the_same_exact_samples(family, template):
    tok = _tok(family, template)
    for conv in (PLAIN, NATIVE, THINKING):
        fast = tokenize_conversation(conv, TOOLS, tok)
        slow = tokenize_conversation(conv, TOOLS, _NoOffsets(tok))
        assert [s.input_ids for s in slow] == [s.input_ids for s in fast]
        for a, b in zip(slow, fast):
            if not any(f.startswith("merged_boundary") for f in b.flags):
                assert (a.labels, a.flags) == (b.labels, b.flags)
            else:  # without offsets a merged turn is context only, still flagged
                assert a.flags == b.flags and a.trainable < b.trainable
