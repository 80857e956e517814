"""Tokenisers of each family a user may bring, trained here with ``tokenizers`` on a small corpus (no hub):
the layouts of the ``tokenizer.json`` files the public models ship, so that merges, word-boundary markers,
byte fallback and added tokens behave as they do there.

- ``byte_level``: Qwen2/Qwen3 layout: a regex split, byte-level BPE, byte-level decoder.
- ``tiktoken``: Llama-3 layout (converted from tiktoken): the cl100k regex (digits in groups of three),
  byte-level BPE with ``ignore_merges`` (a whole pre-token that is in the vocabulary is one token even where
  no merge path leads to it).
- ``sp_normalizer``: Llama-2 / Mistral-7B layout: a normalizer prepends ``▁`` and replaces spaces by it,
  no pre-tokenizer, BPE with byte fallback (``<0x..>`` tokens), a decoder that strips the leading space.
- ``sp_metaspace``: the newer SentencePiece layout: a ``Metaspace`` pre-tokenizer (``prepend_scheme="first"``,
  no split), BPE without byte fallback (unknown characters are ``<unk>``).
- ``wordpiece``: BERT layout: a BERT normalizer and pre-tokenizer (whitespace is not kept), WordPiece with
  ``##`` continuations; chat templates built from added tokens.
"""
from __future__ import annotations

import functools

FAMILIES = ("byte_level", "tiktoken", "sp_normalizer", "sp_metaspace", "wordpiece")

SPECIAL = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
           "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM]", "[USER]",
           "[ASSISTANT]", "[TOOL]", "[END]", "[CALL]"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
CL100K_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_WORDS = ("Ada Lovelace ordered a replacement; the order 12345 shipped on 2024-05-01. Alan Turing cancelled "
          "his order. Find customer ada@example.com and look up the ticket. Both done. I will call the tool. "
          "The result is ready: refund issued, status shipped. Café naïve résumé. Be brief. Do two things. "
          "You may call one or more functions to assist with the user query. Environment: ipython. "
          "assistant user system tool name arguments parameters content function description type object")
CORPUS = [_WORDS, _WORDS.lower(), '{"name": "find_customer", "arguments": {"email": "ada@example.com"}}',
          '{"name":"lookup","arguments":{"order_id":12345}}', "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
          "Thought: I will call find_customer.\nAction: find_customer\nAction Input: {\"x\": 1}",
          "hmm, let me think about it.\n\nOK: the answer is 42.", "  indented\n\n\ttabbed  text  "] * 3


def _added(tok) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED])


def _byte_level(pattern: str, ignore_merges: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if ignore_merges:  # tiktoken vocabularies hold whole words no merge path reaches
        import json

        spec = json.loads(tok.to_str())
        vocab, merges = spec["model"]["vocab"], [tuple(m) for m in spec["model"]["merges"]]
        for w in ("Ġassistant", "Ġfunctions", "Ġreplacement"):
            vocab.setdefault(w, len(vocab))
        model = models.BPE(vocab, merges, ignore_merges=True)
        new = Tokenizer(model)
        new.pre_tokenizer, new.decoder, new.post_processor = tok.pre_tokenizer, tok.decoder, tok.post_processor
        tok = new
    return tok


def _sp_vocab(byte_fallback: bool):
    """Vocabulary and merges of SentencePiece BPE: learned within words, each word led by ``▁``."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    alphabet = sorted({c for s in CORPUS for c in s} | set("[]{}<>/|_-:;,.!?\"'@#0123456789\n\t"))
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False, special_tokens=["<unk>"],
                                                        initial_alphabet=[] if byte_fallback else alphabet))
    spec = json.loads(tok.to_str())
    vocab, merges = spec["model"]["vocab"], [tuple(m) for m in spec["model"]["merges"]]
    if byte_fallback:
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return vocab, merges


def _sp_normalizer():
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab, merges = _sp_vocab(byte_fallback=True)
    new = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    new.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    new.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return new


def _sp_metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _sp_vocab(byte_fallback=False)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return tok


def _wordpiece():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=500, show_progress=False,
                                                              special_tokens=["<unk>"]))
    return tok


@functools.lru_cache(maxsize=None)
def _backend(family: str):
    build = {"byte_level": lambda: _byte_level(QWEN_SPLIT, False), "tiktoken": lambda: _byte_level(CL100K_SPLIT, True),
             "sp_normalizer": _sp_normalizer, "sp_metaspace": _sp_metaspace, "wordpiece": _wordpiece}[family]
    tok = build()
    _added(tok)
    return tok.to_str()


def build(family: str, chat_template: str, eos: str, bos: str | None = None):
    """A ``PreTrainedTokenizerFast`` of ``family`` with ``chat_template``, ``eos`` (the end-of-turn token)
    and ``bos``; every marker of the test templates is an added token."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_backend(family)), chat_template=chat_template,
                                   eos_token=eos, bos_token=bos, pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=1_000_000)
