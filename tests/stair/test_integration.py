"""STAIR on tiny HF models: attach/detach, bank capture, prefill-only injection, sessions, bad input."""
import math

import pytest
import torch

from treadle.models import build_tiny_model
from treadle.reference.stair import stair_readout_reference
from treadle.stair import (AlreadyAttachedError, Bank, BankMismatchError, ContextOverflowError, StairSession,
                           UnsupportedModelError, attach)

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_5", "qwen3_next")
# controlled layers per tiny architecture (4 layers; the hybrid models' only softmax layer is 3)
LAYERS = {"qwen3": (1, 3), "qwen2": (0, 2), "llama": (1, 2), "qwen3_5": (3,), "qwen3_next": (3,)}


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(arch, tok, **kw):
    return build_tiny_model(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **kw)


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _session_with_bank(model, tok, ctrl, rows=1):
    s = StairSession(model, tok, ctrl, batch_size=rows)
    s.forward(["What is 3+4?"] * rows, ["7"] * rows)
    s.forward(["What is 12*3-5?"] * rows, ["31"] * rows)
    return s


# --------------------------------------------------------------------------------------------- attach / detach
@pytest.mark.parametrize("arch", ARCHS)
def test_attach_detach_bit_identical_and_empty_bank(arch, tok):
    model = _model(arch, tok)
    ids = torch.randint(0, len(tok), (2, 13))
    ref = model(ids).logits
    impl, hooks = model.config._attn_implementation, _hooks(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ctrl = attach(model, layers=LAYERS[arch], backend="cpp")
    assert ctrl.num_trainable == len(LAYERS[arch]) * model.config.num_attention_heads * ctrl.head_dim
    assert torch.equal(model(ids).logits, ref)                 # attached, no bank
    ctrl.set_bank(ctrl.new_bank(2))
    assert torch.equal(model(ids).logits, ref)                 # attached, empty bank
    ctrl.detach()
    assert torch.equal(model(ids).logits, ref)
    assert model.config._attn_implementation == impl and _hooks(model) == hooks
    assert set(model.state_dict()) == set(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(hasattr(m, "_treadle_stair") for m in model.modules())


def test_eager_attention_implementation(tok):
    model = _model("qwen3", tok)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, len(tok), (1, 9))
    ref = model(ids).logits
    ctrl = attach(model, layers=(1, 3), backend="cpp")
    assert model.config._attn_implementation == "treadle_stair_eager"
    assert torch.equal(model(ids).logits, ref)
    sess = _session_with_bank(model, tok, ctrl)
    assert sess.generate("What is 1+1?", max_new_tokens=3).token_ids[0]
    ctrl.detach()
    assert model.config._attn_implementation == "eager" and torch.equal(model(ids).logits, ref)


def test_default_layers_on_a_deep_model(tok):
    model = _model("qwen3", tok, num_hidden_layers=20, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=32)
    ctrl = attach(model, backend="cpp")
    assert ctrl.layers == (3, 11, 19) and ctrl.num_trainable == 3 * 2 * 16
    ctrl.detach()


# --------------------------------------------------------------------------------------------- read-out maths
def _rope(x, pos, cfg, head_dim):
    """Independent RoPE (rotate-half, partial) for the check below."""
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rd = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    ang = pos.to(torch.float64)[..., None] * inv                       # (B, T, rd/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    xr, xp = x[..., :rd].double(), x[..., rd:].double()
    half = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
    return torch.cat([xr * cos + half * sin, xp], -1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "llama"])
def test_injection_equals_reference_readout_before_gate_and_o_proj(arch, tok):
    """o_proj input (STAIR) - o_proj input (native) == gate * stair_readout_reference(rope(q, M+p), rope(k, j), v)."""
    torch.manual_seed(1)
    model = _model(arch, tok)
    li = LAYERS[arch][-1]
    ctrl = attach(model, layers=(li,), eps=0.1, backend="cpp")
    sess = _session_with_bank(model, tok, ctrl)
    attn = model.model.layers[li].self_attn
    got = {}
    h1 = attn.o_proj.register_forward_hook(lambda m, a, o: got.__setitem__("o_in", a[0]))
    h2 = ctrl.info.q_src[li].register_forward_hook(lambda m, a, o: got.__setitem__("q", o))
    gate = {}
    if ctrl.info.gated:
        h3 = attn.q_proj.register_forward_hook(lambda m, a, o: gate.__setitem__("g", o))
    ids = torch.randint(10, 60, (1, 9))
    P = sess.next_pos[0]
    kw = dict(input_ids=ids, attention_mask=torch.ones(1, sess.mask.shape[1] + 9, dtype=torch.long),
              position_ids=torch.arange(P, P + 9)[None], use_cache=True)
    import copy

    ctrl.set_bank(sess.bank)
    ctrl.enabled = False
    model(cache=copy.deepcopy(sess.cache), **kw)
    native = got["o_in"]
    ctrl.enabled = True
    model(cache=copy.deepcopy(sess.cache), **kw)
    stair = got["o_in"]
    k, v, lengths = sess.bank.read(li)
    M = int(lengths[0])
    q = got["q"].reshape(1, 9, -1, ctrl.head_dim).transpose(1, 2)
    qr = _rope(q, torch.arange(P, P + 9)[None] + M, model.config, ctrl.head_dim)
    kr = _rope(k, torch.arange(M)[None], model.config, ctrl.head_dim)
    dr = stair_readout_reference(qr, kr, v.double(), ctrl.normals[0].detach().double(), eps=0.1,
                                 scale=attn.scaling).transpose(1, 2).reshape(1, 9, -1)
    if ctrl.info.gated:
        g = gate["g"].view(1, 9, -1, ctrl.head_dim * 2)[..., ctrl.head_dim:].reshape(1, 9, -1)
        dr = dr * torch.sigmoid(g.double())
        h3.remove()
    h1.remove()
    h2.remove()
    assert dr.abs().max() > 1e-4  # the check can fail
    torch.testing.assert_close((stair - native).double(), dr, atol=2e-5, rtol=1e-4)
    ctrl.detach()


def test_changes_only_downstream_of_controlled_layer(tok):
    model = _model("qwen3", tok)
    ctrl = attach(model, layers=(2,), backend="cpp")
    sess = _session_with_bank(model, tok, ctrl)
    ctrl.set_bank(sess.bank)
    import copy

    P = sess.next_pos[0]
    kw = dict(input_ids=torch.randint(10, 60, (1, 7)), attention_mask=torch.ones(1, sess.mask.shape[1] + 7,
              dtype=torch.long), position_ids=torch.arange(P, P + 7)[None], use_cache=True, output_hidden_states=True)
    ctrl.enabled = False
    a = model(cache=copy.deepcopy(sess.cache), **kw).hidden_states
    ctrl.enabled = True
    b = model(cache=copy.deepcopy(sess.cache), **kw).hidden_states
    for i in range(3):  # inputs of layers 0, 1, 2 (and the embeddings)
        assert torch.equal(a[i], b[i])
    assert not torch.allclose(a[3], b[3])  # output of the controlled layer 2
    ctrl.detach()


def test_decode_steps_call_no_readout(tok):
    model = _model("qwen3", tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    ctrl = attach(model, layers=(1, 3), backend="cpp")
    sess = _session_with_bank(model, tok, ctrl)
    ctrl.set_bank(sess.bank)
    ctrl.stats.update(readouts=0, decode_skips=0)
    ids = torch.randint(10, 60, (1, 6))
    model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=None)
    assert ctrl.stats["readouts"] == 2            # the prefill, once per controlled layer
    assert ctrl.stats["decode_skips"] == 2 * 4     # four decode steps, no read-out
    # the same inside a session turn
    ctrl.stats.update(readouts=0, decode_skips=0)
    r = sess.generate("What is 1+1?", max_new_tokens=4)
    assert ctrl.stats["readouts"] == 2 and ctrl.stats["decode_skips"] == 2 * len(r.token_ids[0])
    ctrl.detach()


# --------------------------------------------------------------------------------------------- the bank
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_bank_keys_rotated_equal_model_cache(arch, tok):
    model = _model(arch, tok)
    li = LAYERS[arch][0]
    ctrl = attach(model, layers=(li,), backend="cpp")
    sess = StairSession(model, tok, ctrl)
    prompt_len = len(sess._prompt_ids(0, "What is 3+4?"))
    r = sess.generate("What is 3+4?", max_new_tokens=6)
    n_body = sum(sess._span(r.token_ids[0]))
    assert sess.bank_tokens == [n_body] and n_body > 0
    k, v, _ = sess.bank.read(li)
    pos = torch.arange(prompt_len, prompt_len + n_body)
    cos, sin = ctrl.info.rotary(k, pos[None])
    k_rot = ctrl.info.apply_rotary(k, k, cos, sin)[0]
    layer = sess.cache.layers[li]
    torch.testing.assert_close(k_rot, layer.keys[:, :, prompt_len:prompt_len + n_body], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(v, layer.values[:, :, prompt_len:prompt_len + n_body], atol=0, rtol=0)
    assert sess.bank_bytes == 2 * n_body * ctrl.info.num_kv_heads * ctrl.head_dim * 4
    ctrl.detach()


def test_ragged_rows_equal_single_sessions(tok):
    model = _model("qwen3", tok)
    ctrl = attach(model, layers=(1, 3), backend="cpp")
    users = [["What is 3+4?", "Hi"], ["What is 12*3-5?", "What is 2+2?"], ["x", "What is 99-1?"]]
    both = StairSession(model, tok, ctrl, batch_size=2)
    outs = [both.generate(u, max_new_tokens=5).token_ids for u in users]
    for row in range(2):
        one = StairSession(model, tok, ctrl, batch_size=1)
        for t, u in enumerate(users):
            assert one.generate(u[row], max_new_tokens=5).token_ids[0] == outs[t][row]
        assert one.bank_tokens[0] == both.bank_tokens[row]
    ctrl.detach()


def test_bank_budget_keeps_last_tokens(tok):
    bank = Bank((0,), 2, 1, 4, 4)
    k = torch.arange(2 * 5 * 4, dtype=torch.float32).view(2, 5, 1, 4)
    span = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 0]], dtype=torch.bool)
    bank.append({0: (k, k + 1000)}, span)
    kk, vv, lengths = bank.read(0, budget=3)
    assert lengths.tolist() == [3, 2]
    assert torch.equal(kk[0, 0], k[0, 2:, 0])
    assert torch.equal(kk[1, 0, :2], k[1, [1, 3], 0]) and torch.equal(kk[1, 0, 2], torch.zeros(4))
    ks, vs, _ = bank.read(0, shuffle_seed=3)
    assert torch.equal(ks, bank.read(0)[0]) and not torch.equal(vs, bank.read(0)[1])
    assert bank.nbytes == 2 * 7 * 4 * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_each_architecture_runs_a_stair_session(arch, tok):
    model = _model(arch, tok)
    ctrl = attach(model, layers=LAYERS[arch], backend="cpp")
    stair = StairSession(model, tok, ctrl)
    native = StairSession(model, tok, ctrl, stair=False)
    for s in (stair, native):
        s.forward("What is 3+4?", "3+4 is 7")
    a = stair.forward("What is 5+6?", "11")["logits"]
    b = native.forward("What is 5+6?", "11")["logits"]
    assert torch.isfinite(a).all() and not torch.allclose(a, b)
    r = stair.generate("What is 1+2?", max_new_tokens=3)
    assert len(r.token_ids[0]) >= 1 and stair.bank_tokens[0] > 2
    ctrl.detach()


def _compiled_vs_eager(tok, backend):
    """Compiled (``backend``) vs eager logits of an attached model reading a non-empty bank; the
    second call must not recompile (a guard on a changing Python int would)."""
    torch._dynamo.reset()
    model = _model("qwen3", tok)
    ctrl = attach(model, layers=(1,), backend="cpp")
    sess = _session_with_bank(model, tok, ctrl)
    ctrl.set_bank(sess.bank)
    ids = torch.randint(10, 60, (1, 8))
    eager = model(ids).logits
    ctrl.enabled = False
    native = model(ids).logits
    ctrl.enabled = True
    assert sess.bank_tokens[0] > 0 and (eager - native).abs().max() > 1e-3  # STAIR changes the logits
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(compiled(ids).logits, eager, atol=1e-5, rtol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(ids).logits, eager, atol=1e-5, rtol=1e-5)
    ctrl.detach()
    torch._dynamo.reset()


def test_torch_compile_of_attached_model(tok):
    _compiled_vs_eager(tok, "aot_eager")


@pytest.mark.slow
def test_torch_compile_inductor_of_attached_model(tok):
    """The default backend (inductor, C++ codegen on CPU): ~12 s with a warm inductor cache, 35-45 s
    cold on 2 busy cores."""
    _compiled_vs_eager(tok, "inductor")


# --------------------------------------------------------------------------------------------- bad input
def _unchanged(model, ids, ref, impl):
    assert model.config._attn_implementation == impl and _hooks(model) == 0
    assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("kwargs, err, words", [
    (dict(layers=(4,)), UnsupportedModelError, "out of range"),
    (dict(layers=(-1,)), UnsupportedModelError, "out of range"),
    (dict(layers=(1, 1)), UnsupportedModelError, "distinct"),
    (dict(layers=()), UnsupportedModelError, "at least one"),
    (dict(layers=(1.0,)), TypeError, "ints"),
    (dict(layers=(1,), eps=1.0), ValueError, "eps"),
    (dict(layers=(1,), bank="everything"), ValueError, "bank"),
    (dict(layers=(1,), mode="sum"), ValueError, "mode"),
    (dict(layers=(1,), budget=0), ValueError, "budget"),
])
def test_bad_attach_arguments_alter_nothing(kwargs, err, words, tok):
    model = _model("qwen3", tok)
    ids = torch.randint(0, 60, (1, 5))
    ref = model(ids).logits
    with pytest.raises(err, match=words):
        attach(model, **kwargs)
    _unchanged(model, ids, ref, "sdpa")


def test_linear_attention_layer_and_unsupported_model_refused(tok):
    model = _model("qwen3_5", tok)
    ids = torch.randint(0, 60, (1, 5))
    ref = model(ids).logits
    with pytest.raises(UnsupportedModelError, match=r"linear_attention.*\[3\]"):
        attach(model, layers=(0, 3))
    _unchanged(model, ids, ref, "sdpa")
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match="Qwen3.*Llama"):
        attach(gpt2, layers=(0,))
    with pytest.raises(TypeError):
        attach("not a model", layers=(0,))


def test_double_attach_bank_from_other_model_and_context_overflow(tok):
    model = _model("qwen3", tok, max_position_embeddings=64)
    ctrl = attach(model, layers=(1,), backend="cpp")
    with pytest.raises(AlreadyAttachedError):
        attach(model, layers=(1,))
    other = _model("llama", tok)
    octrl = attach(other, layers=(1,), backend="cpp")
    with pytest.raises(BankMismatchError, match="another model"):
        ctrl.set_bank(octrl.new_bank(1))
    two = attach(_model("qwen3", tok, max_position_embeddings=64), layers=(1, 2), backend="cpp")
    with pytest.raises(BankMismatchError, match="layers"):
        ctrl.set_bank(two.new_bank(1))
    sess = StairSession(model, tok, ctrl)
    sess.forward("What is 3+4?", "7")
    before = (sess.next_pos[:], sess.mask.clone(), sess.bank_tokens, sess.cache.get_seq_length())
    with pytest.raises(ContextOverflowError, match="context"):
        sess.generate("What is " + "1+" * 30 + "1?", max_new_tokens=8)
    assert (sess.next_pos, sess.bank_tokens, sess.cache.get_seq_length()) == (before[0], before[2], before[3])
    assert torch.equal(sess.mask, before[1])
    for c in (ctrl, octrl, two):
        c.detach()
    with torch.no_grad():
        assert math.isfinite(float(model(torch.randint(0, 60, (1, 4))).logits.sum()))


def test_bank_spans_assistant_answer_reasoning(tok):
    model = _model("qwen3", tok)
    ctrl = attach(model, layers=(1,), backend="cpp")
    sess = StairSession(model, tok, ctrl)
    sess._think = (50, 51)  # pretend <think> / </think> are tokens 50 / 51
    ids = [10, 50, 11, 12, 51, 13, 14, tok.eos_token_id]
    expect = {"assistant": [1, 0, 1, 1, 0, 1, 1, 0], "reasoning": [0, 0, 1, 1, 0, 0, 0, 0],
              "answer": [0, 0, 0, 0, 0, 1, 1, 0]}
    for span, want in expect.items():
        ctrl.bank_span = span
        assert sess._span(ids) == [bool(x) for x in want], span
    ctrl.detach()
