"""Token-level samples with a Qwen3-style template with tools: loss mask, parallel calls, back-to-back
tool results, thinking stripped from history (split), truncated turns and budgets; one TRL SFT step."""
import pytest

from treadle.weft.rollouts.tokens import IGNORE, tokenize_conversation

from .qwen3_template import QWEN3_STYLE

TOOLS = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok():
    from treadle.models import build_tokenizer

    t = build_tokenizer()
    t.chat_template = QWEN3_STYLE
    t.model_max_length = 100_000
    return t


def _calls(*names):
    return [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": '{"x": %d}' % i}}
            for i, n in enumerate(names)]


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Do two things."},
    {"role": "assistant", "content": "", "tool_calls": _calls("f", "f")},          # parallel calls
    {"role": "tool", "tool_call_id": "c0", "content": "R0"},                          # back-to-back results
    {"role": "tool", "tool_call_id": "c1", "content": "R1"},
    {"role": "assistant", "content": "Both done."},
]


def _trainable_text(tok, s):
    return tok.decode([i for i, l in zip(s.input_ids, s.labels) if l != IGNORE])


def test_mask_covers_exactly_the_assistant_turns(tok):
    (s,) = tokenize_conversation(CONV, TOOLS, tok)
    assert tok.decode(s.input_ids) == tok.apply_chat_template(CONV, tools=TOOLS, tokenize=False)
    want = ('<tool_call>\n{"name": "f", "arguments": {"x": 0}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
            'Both done.<|im_end|>')
    assert _trainable_text(tok, s) == want  # no system, user, tool text; each end-of-turn token trainable
    full = tok.decode(s.input_ids)
    assert full.count("<|im_start|>user\n<tool_response>\nR0\n</tool_response>\n<tool_response>\nR1") == 1
    assert s.flags == ("text_rewritten:2",)  # the template wrote the native calls; no ids say the model did


def test_thinking_stripped_from_history_splits_the_sample(tok):
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
            {"role": "user", "content": "b"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\nB"}]
    s1, s2 = tokenize_conversation(conv, None, tok)
    assert s1.flags == ()
    assert _trainable_text(tok, s1) == "<think>\nhmm\n</think>\n\nA<|im_end|>"   # what the model saw and wrote
    assert _trainable_text(tok, s2) == "<think>\nok\n</think>\n\nB<|im_end|>"
    assert s2.flags == ("split_at:3",) and "hmm" not in tok.decode(s2.input_ids)  # re-rendered history, own segment
    conv_plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
                  {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]
    assert len(tokenize_conversation(conv_plain, None, tok)) == 1              # no rewrite: one sample
    # thinking stored in another layout than the template writes it: trained as rendered, flagged
    compact = [dict(m, content=m["content"].replace("\n", "")) for m in conv]
    s1, s2 = tokenize_conversation(compact, None, tok)
    assert s1.flags == ("text_rewritten:1",) and s2.flags == ("split_at:3", "text_rewritten:3")


def test_truncated_turn_and_budgets_are_masked_and_flagged(tok):
    (s,) = tokenize_conversation(CONV, TOOLS, tok, truncated=[5])
    assert _trainable_text(tok, s).endswith("</tool_call><|im_end|>") and "truncated_turn:5" in s.flags
    (s,) = tokenize_conversation(CONV, TOOLS, tok, max_turn_tokens=20)
    assert _trainable_text(tok, s) == "Both done.<|im_end|>" and s.flags == ("over_turn_budget:2",)
    n_first = len(tokenize_conversation(CONV[:3], TOOLS, tok)[0].input_ids)
    (s,) = tokenize_conversation(CONV, TOOLS, tok, max_tokens=n_first + 5)
    assert len(s.input_ids) == n_first and s.flags == ("text_rewritten:2", "over_budget:5")


def test_bad_input(tok):
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(CONV[:2], TOOLS, tok)
    with pytest.raises(ValueError, match="max_tokens"):
        tokenize_conversation(CONV, TOOLS, tok, max_tokens=0)


@pytest.mark.slow
def test_one_trl_sft_step_on_sampled_trajectories(tok, tmp_path):
    """The sampler's sft.jsonl goes straight into TRL's SFTTrainer (tiny untrained Qwen3, one step)."""
    pytest.importorskip("trl")
    import torch
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from treadle.models import build_tiny_model
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.tasks import from_shop
    from treadle.weft.rollouts.tokens import write_sft

    trs = sample(tmp_path / "run", from_shop(), SampleConfig(harness=Component(name="native")))
    assert write_sft(trs, tmp_path / "sft.jsonl") == 2
    ds = load_dataset("json", data_files=str(tmp_path / "sft.jsonl"), split="train")
    # the loss mask of each sampled conversation covers assistant tokens only
    for row in ds:
        for s in tokenize_conversation(row["messages"], row["tools"], tok):
            assert 0 < s.trainable < len(s.input_ids)
    torch.manual_seed(0)
    model = build_tiny_model("qwen3", vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None).train()
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, report_to=[],
                     max_length=4096, use_cpu=True, logging_steps=1, save_strategy="no", dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    before = [p.detach().clone() for p in model.parameters()]
    out = trainer.train()
    assert out.global_step == 1 and torch.isfinite(torch.tensor(out.training_loss))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _chars(tok, text):
    """Ids of ``text`` written one character at a time (not how the tokenizer splits it)."""
    return [i for ch in text for i in _ids(tok, ch)]


def test_policy_token_ids_are_kept_not_retokenised(tok):
    conv = CONV[:5] + [{"role": "assistant", "content": "assistant done."}]
    own = _chars(tok, "assistant done.") + _ids(tok, "<|im_end|>")  # 'assistant' is one token of the vocabulary
    assert tok.decode(own) == "assistant done.<|im_end|>" and own != _ids(tok, "assistant done.<|im_end|>")
    (s,) = tokenize_conversation(conv, TOOLS, tok, policy_ids={5: own})
    assert s.input_ids[-len(own) - 1:-1] == tuple(own) and s.labels[-len(own) - 1:-1] == tuple(own)
    assert tok.decode(s.input_ids) == tok.apply_chat_template(conv, tools=TOOLS, tokenize=False)
    (plain,) = tokenize_conversation(conv, TOOLS, tok)
    assert len(plain.input_ids) < len(s.input_ids)  # without the ids, the text is tokenised canonically
    # ids without the end-of-turn token (a cut or a stop string): the template's eot is appended, masked
    cut = _ids(tok, "Both done.")
    (s,) = tokenize_conversation(CONV, TOOLS, tok, policy_ids={5: cut})
    assert _trainable_text(tok, s).endswith("</tool_call><|im_end|>Both done.")
    assert tok.decode(s.input_ids).endswith("Both done.<|im_end|>\n")
    with pytest.raises(ValueError, match="not assistant messages"):
        tokenize_conversation(CONV, TOOLS, tok, policy_ids={1: cut})


def test_a_turn_the_template_re_renders_differently_splits_the_sample(tok):
    # the model wrote compact JSON; the template re-serialises the parsed native calls with spaces
    wrote = ('<tool_call>\n{"name":"f","arguments":{"x":0}}\n</tool_call>\n'
             '<tool_call>\n{"name":"f","arguments":{"x":1}}\n</tool_call><|im_end|>')
    assert len(tokenize_conversation(CONV, TOOLS, tok)) == 1
    s1, s2 = tokenize_conversation(CONV, TOOLS, tok, policy_ids={2: _ids(tok, wrote)})
    assert s1.flags == ("ids_differ:2",) and _trainable_text(tok, s1) == wrote  # what the model wrote, kept
    assert tok.decode(s1.input_ids).endswith(wrote)
    assert s2.flags == ("split_at:5",) and _trainable_text(tok, s2) == "Both done.<|im_end|>"
    assert '{"name": "f", "arguments": {"x": 0}}' in tok.decode(s2.input_ids)  # the re-rendering it saw next
    assert all(l == IGNORE for l in s2.labels[:-len(_ids(tok, "Both done.<|im_end|>")) - 1])


def test_tokenize_trajectory_uses_the_policy_ids_of_its_outputs(tok, tmp_path):
    from treadle.weft.rollouts.batch import Component, SampleConfig, sample
    from treadle.weft.rollouts.policies import ReplayPolicy
    from treadle.weft.rollouts.registry import POLICIES
    from treadle.weft.rollouts.tasks import from_shop
    from treadle.weft.rollouts.tokens import policy_turns, tokenize_trajectory

    @POLICIES.register("test-with-ids")
    class WithIds(ReplayPolicy):
        """Replay whose outputs carry token ids written char by char (unlike the tokenizer's own ids)."""

        async def act(self, messages, tools, harness, ctx):
            out = await super().act(messages, tools, harness, ctx)
            text = "assistant " + out.text  # outside the <tool_call> blocks: the reply, not the calls
            return out.model_copy(update={"text": text, "token_ids": tuple(_chars(tok, text) + _ids(tok, "<|im_end|>"))})

    (t,) = sample(tmp_path, from_shop()[1:], SampleConfig(policy=Component(name="test-with-ids")))
    ids, cut = policy_turns(t)
    assert sorted(ids) == [i for i, m in enumerate(t.messages) if m["role"] == "assistant"] and cut == []
    (s,) = tokenize_trajectory(t, tok)
    trainable = [i for i, l in zip(s.input_ids, s.labels) if l != IGNORE]
    assert trainable == [x for j in sorted(ids) for x in ids[j]]  # exactly the policy's ids, in order
    assert t.accepted and 6 not in trainable  # never the tokenizer's own 'assistant' token
