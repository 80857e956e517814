"""Sessions on hybrid linear-attention models (Qwen3.5 / Qwen3-Next) with ragged rows.

The recurrent (Gated DeltaNet) layers cannot skip padding, so a session runs rows of different
segment lengths as separate forwards (one per length) and puts back the recurrent states of rows
fed only pads; each row must get exactly what a session of its own gets: logits, generated tokens,
bank contents and gradients, with STAIR on and off.
"""
import pytest
import torch

from treadle.models import build_tiny_model
from treadle.stair import BankMismatchError, StairSession, attach
from treadle.stair.session import has_recurrent_layers

# three rows of different lengths in every turn; rows 0 and 2 have equal prompts in turn 2
TURNS = [("forward", ["What is 3+4?", "Hi", "What is 12*3-5?"], ["3+4 is 7", "Hello there, how are you", "31"]),
         ("generate", ["What is 1+1?", "ok", "What is 99-1?"], None),
         ("forward", ["Why?", "What is 2+2?", "Why?"], ["because", "4", "no idea at all"]),
         ("generate", ["And 5*5?", "x", "Tell me more about it"], None)]


pytestmark = pytest.mark.usefixtures("one_thread")



def _attention_len(cache) -> int:
    """Positions held by the cache's softmax-attention layers (a hybrid cache's layer 0 may be a linear-attention
    layer, whose own ``get_seq_length`` counts something else in recent transformers)."""
    idx = next(i for i, layer in enumerate(cache.layers)
               if hasattr(layer, "keys") and not type(layer).__name__.startswith("Linear"))
    return cache.get_seq_length(idx)

def _model(tok, arch="qwen3_5", **kw):
    # a wider init than the default makes greedy decoding of the random model non-degenerate
    return build_tiny_model(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id, initializer_range=0.2, **kw)


def _play(sess, rows, eos=None):
    """Run TURNS on ``sess`` for the given rows; returns per turn a list of per-row results
    (the row's logits of a teacher-forced turn, or its generated ids)."""
    if eos is not None:
        sess.eos = eos
    out = []
    for kind, users, answers in TURNS:
        u = [users[r] for r in rows]
        if kind == "forward":
            res = sess.forward(u, [answers[r] for r in rows], native_too=True)
            lengths = [int((res["labels"][i] != -100).sum()) for i in range(len(rows))]
            out.append([(res["logits"][i], res["native_logits"][i], lengths[i]) for i in range(len(rows))])
        else:
            out.append(sess.generate(u, max_new_tokens=6).token_ids)
    return out


def _same_logits(batched, single):
    """The single-row logits equal the batched row's right-aligned part; the padding is zero."""
    n = single.shape[0]
    torch.testing.assert_close(batched[-n:], single, atol=1e-9, rtol=1e-9)  # float64: reordering only


@pytest.mark.parametrize("arch, stair", [("qwen3_5", True), ("qwen3_5", False), ("qwen3_next", True)])
def test_ragged_rows_equal_single_sessions(arch, stair, tok):
    model = _model(tok, arch, dtype=torch.float64)  # float64, so that a real error stands far above rounding
    if arch == "qwen3_next":
        model.set_experts_implementation("eager")  # the default grouped_mm MoE has no float64 kernel
    assert has_recurrent_layers(model)
    ctrl = attach(model, layers=(3,), eps=0.05, backend="cpp")
    with torch.no_grad():
        ctrl.normals.mul_(4.0)  # a strong read-out, so that a wrong bank row would show
    # make rows stop decoding at different steps: pretend a token the model emits early is EOS
    first = StairSession(model, tok, ctrl, batch_size=3, stair=stair)
    first.forward(TURNS[0][1], TURNS[0][2])
    eos = first.generate(TURNS[1][1], max_new_tokens=6).token_ids[1][2]  # row 1's third token
    both = StairSession(model, tok, ctrl, batch_size=3, stair=stair)
    got = _play(both, [0, 1, 2], eos=eos)
    gen_lengths = {len(t) for t in got[1]}
    assert len(gen_lengths) > 1  # rows finished decoding at different steps
    for r in range(3):
        one = StairSession(model, tok, ctrl, batch_size=1, stair=stair)
        ref = _play(one, [r], eos=eos)
        for t, (kind, _, _) in enumerate(TURNS):
            if kind == "generate":
                assert got[t][r] == ref[t][0], (t, r)
            else:
                (lb, nb, cb), (l1, n1, c1) = got[t][r], ref[t][0]
                assert cb == c1
                _same_logits(lb, l1)
                _same_logits(nb, n1)
                assert not lb[:-l1.shape[0]].any()
        assert one.bank_tokens[0] == both.bank_tokens[r] > 0
        kb, vb, _ = both.bank.read(3)
        k1, v1, _ = one.bank.read(3)
        n = one.bank_tokens[0]
        torch.testing.assert_close(kb[r, :, :n], k1[0], atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(vb[r, :, :n], v1[0], atol=1e-9, rtol=1e-9)
        assert one.next_pos[0] == both.next_pos[r]
        assert both.mask[r].sum() == one.mask[0].sum() == one.next_pos[0]
    assert _attention_len(both.cache) == both.mask.shape[1] and (both.mask == 0).any()  # one cache, holes
    ctrl.detach()


def test_padding_a_recurrent_model_would_be_wrong(tok):
    """The checks above can fail: one padded forward (the softmax-model path) gives other logits
    on a hybrid model once a cache exists (transformers then drops the linear layers' padding mask)."""
    model = _model(tok)
    ctrl = attach(model, layers=(3,), backend="cpp")
    out = []
    for force_padded in (True, False):
        sess = StairSession(model, tok, ctrl, batch_size=2)
        sess.recurrent = not force_padded
        for _, users, answers in (TURNS[0], TURNS[2]):
            res = sess.forward(users[:2], answers[:2])
        out.append(res["logits"])
    n = min(int((out[1][r].abs().sum(-1) > 0).sum()) for r in range(2))
    assert (out[0][:, -n:] - out[1][:, -n:]).abs().max() > 1e-2
    ctrl.detach()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_model_forwards_per_turn(arch, tok):
    """Softmax models: one forward per prefill; hybrid models: one per distinct prompt length. Decode
    steps are one batched forward each, also after rows finish (their recurrent states restored)."""
    model = _model(tok, arch)
    ctrl = attach(model, layers=(3,), backend="cpp")
    sess = StairSession(model, tok, ctrl, batch_size=3)
    users = ["What is 3+4?", "Hi", "What is 12*3-5?"]
    lengths = {len(sess._prompt_ids(b, u)) for b, u in enumerate(users)}
    assert len(lengths) == 3
    sess.eos = -1  # never stop early: exactly max_new_tokens decode forwards
    per_length = 3 if has_recurrent_layers(model) else 1
    sess.generate(users, max_new_tokens=4)
    assert sess.model_calls == per_length + 4
    assert _attention_len(sess.cache) == sess.mask.shape[1] and (sess.mask == 0).any()
    sess.forward(users, ["7", "hello", "31"], native_too=True)  # native + STAIR passes
    assert sess.model_calls == per_length + 4 + 2 * per_length
    ctrl.detach()


def test_teacher_forced_gradients_equal_single_rows(tok):
    """Training on ragged hybrid rows: the normals' gradient of the summed loss is the sum of the
    rows' gradients. Six layers (linear x3, full, linear x2), so the controlled layer 3 feeds
    recurrent layers whose states must be detached between turns."""
    from treadle.stair.training import stair_loss

    model = _model(tok, num_hidden_layers=6)
    for p in model.parameters():
        p.requires_grad_(False)
    ctrl = attach(model, layers=(3,), eps=0.05, backend="cpp")
    turns = [t for t in TURNS if t[0] == "forward"] + [TURNS[0]]

    def grad_of(rows):
        ctrl.normals.grad = None
        sess = StairSession(model, tok, ctrl, batch_size=len(rows))
        total = 0.0
        for i, (_, users, answers) in enumerate(turns):
            out = sess.forward([users[r] for r in rows], [answers[r] for r in rows], grad=i > 0, native_too=True)
            if i > 0:
                loss, parts = stair_loss(out["logits"], out["native_logits"], out["labels"])
                (loss * parts["tokens"]).backward()  # token sums, so rows add up
                total += float(loss.detach()) * parts["tokens"]
        return ctrl.normals.grad.clone(), total

    g_all, l_all = grad_of([0, 1, 2])
    singles = [grad_of([r]) for r in range(3)]
    assert g_all.abs().sum() > 0
    torch.testing.assert_close(g_all, sum(g for g, _ in singles), atol=1e-5, rtol=1e-4)
    assert l_all == pytest.approx(sum(x for _, x in singles), rel=1e-5)
    ctrl.detach()


def test_repeat_on_a_hybrid_model(tok):
    """``repeat`` (k samples per row, as the evaluation does) works for linear-attention caches and
    each copy continues its row exactly."""
    model = _model(tok)
    ctrl = attach(model, layers=(3,), backend="cpp")
    for users in (["What is 3+4?", "Hi"], ["What is 3+4?", "What is 5+6?"]):  # ragged / equal lengths
        base = StairSession(model, tok, ctrl, batch_size=2)
        base.forward(users, ["7", "hello"])
        rep = base.repeat(2)
        res = rep.generate(["What is 1+1?"] * 4, max_new_tokens=4).token_ids
        for r in range(2):
            one = StairSession(model, tok, ctrl, batch_size=1)
            one.forward(users[r], ["7", "hello"][r])
            want = one.generate("What is 1+1?", max_new_tokens=4).token_ids[0]
            assert res[2 * r] == res[2 * r + 1] == want
    ctrl.detach()


def test_evaluation_runs_on_a_hybrid_model(tok):
    from treadle.stair.evaluation import EvalConfig, evaluate

    model = _model(tok)
    cfg = EvalConfig(sessions=2, turns=2, levels=[1, 2], k=2, max_new_tokens=3,
                     conditions=("vanilla", "native", "random"))
    res = evaluate(model, tok, cfg, layers=(3,), backend="cpp", progress=False)
    assert set(res["conditions"]) == {"vanilla", "native", "random"}
    assert model.config._attn_implementation == "sdpa"


def test_bank_rows_select_rows_and_bad_input(tok):
    model = _model(tok, "qwen3")
    ctrl = attach(model, layers=(1,), backend="cpp")
    sess = StairSession(model, tok, ctrl, batch_size=2)
    sess.forward(["What is 3+4?", "Hi"], ["7", "hello there"])
    one = StairSession(model, tok, ctrl, batch_size=1)
    one.forward("Hi", "hello there")
    ids = torch.randint(10, 60, (1, 5))
    ctrl.set_bank(one.bank)
    want = model(ids).logits
    ctrl.set_bank(sess.bank)
    ctrl.bank_rows = [1]
    got = model(ids).logits
    ctrl.bank_rows = [0]
    other = model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(other, want)
    for rows in ([2], [0, 1], [-1]):
        ctrl.bank_rows = rows
        with pytest.raises(BankMismatchError, match="bank_rows"):
            model(ids)
    ctrl.bank_rows = None
    with pytest.raises(BankMismatchError, match="2 rows"):
        model(ids)
    ctrl.detach()
