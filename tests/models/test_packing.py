"""Packed training batches and the last MLP computed only at the loss positions: the same loss and
gradients as the right-padded batch (float64), each conversation attending only to itself, clear
errors for bad input, and the training recipe that uses them."""
import pytest
import torch

from treadle.data.arithmetic import ProblemGenerator
from treadle.models import TinyTrainConfig, build_tokenizer, train_tiny
from treadle.models.packing import last_mlp_on_loss_positions, loss_positions, packed_sft_batch
from treadle.models.tiny import build_model, sft_batch


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def problems():
    gen = ProblemGenerator(3)
    return gen.mixture(13, {1: 1.0, 2: 1.0, 4: 1.0}, split="train") + gen.batch(6, 2, split="train")


def _model(tok, seed=0):
    cfg = TinyTrainConfig.quick(seed=seed, hidden_size=24, num_heads=2, num_kv_heads=1, intermediate_size=40)
    return build_model(cfg, tok).double().train()


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packing_keeps_every_conversation_whole(tok, problems):
    ids, lab, pos = packed_sft_batch(tok, problems, 48)
    ref_ids, _, ref_lab = sft_batch(tok, problems)
    lengths = (ref_ids != tok.pad_token_id).sum(1).tolist()
    assert ids.shape[1] == max(lengths) > 48  # level 6 is longer than 48: rows widen to it
    assert ids.shape[0] < len(problems)  # several conversations share a row
    found = []
    for r in range(ids.shape[0]):
        starts = (pos[r] == 0).nonzero().flatten().tolist() + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            assert pos[r, a:b].tolist() == list(range(b - a))
            if ids[r, a] != tok.pad_token_id:
                found.append((ids[r, a:b].tolist(), lab[r, a:b].tolist()))
            else:  # the padding that ends a row: pads only, no labels
                assert (ids[r, a:b] == tok.pad_token_id).all() and (lab[r, a:b] == -100).all() and b == ids.shape[1]
    want = [(ref_ids[i, :n].tolist(), ref_lab[i, :n].tolist()) for i, n in enumerate(lengths)]
    assert sorted(found) == sorted(want)


def test_packed_loss_and_gradients_equal_the_padded_batch(tok, problems):
    model = _model(tok)
    ids, _, lab = sft_batch(tok, problems)
    ref = model(input_ids=ids, labels=lab, use_cache=False).loss
    g_ref = _grads(model, ref)
    for width in (1, 40, 96):
        p_ids, p_lab, p_pos = packed_sft_batch(tok, problems, width)
        loss = model(input_ids=p_ids, labels=p_lab, position_ids=p_pos, use_cache=False).loss
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        g = _grads(model, loss)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], rtol=1e-10, atol=1e-12, msg=n)


def test_a_packed_conversation_sees_only_itself(tok, problems):
    model = _model(tok).eval()
    p_ids, p_lab, p_pos = packed_sft_batch(tok, problems, 96)
    row = int(((p_pos == 0) & (p_ids != tok.pad_token_id)).sum(1).argmax())  # a row holding several
    starts = ((p_pos[row] == 0) & (p_ids[row] != tok.pad_token_id)).nonzero().flatten().tolist()
    assert len(starts) >= 2
    with torch.no_grad():
        packed = model(input_ids=p_ids[row:row + 1], position_ids=p_pos[row:row + 1], use_cache=False).logits[0]
        a = starts[1]
        n = int((p_pos[row, a:] == torch.arange(p_ids.shape[1] - a)).long().cumprod(0).sum())
        alone = model(input_ids=p_ids[row:row + 1, a:a + n], use_cache=False).logits[0]
    torch.testing.assert_close(packed[a:a + n], alone, rtol=1e-10, atol=1e-10)


def test_loss_positions_are_the_shifted_labels():
    lab = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, -100, -100, 8]])
    assert loss_positions(lab).tolist() == [[False, True, True, False, False], [True, False, False, True, False]]


def test_last_mlp_on_loss_positions_is_exact_and_restored(tok, problems):
    model = _model(tok, seed=1)
    ids, lab, pos = packed_sft_batch(tok, problems, 64)
    mlp = model.model.layers[-1].mlp
    ref = model(input_ids=ids, labels=lab, position_ids=pos, use_cache=False)
    g_ref = _grads(model, ref.loss)
    seen = []
    hook = mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with last_mlp_on_loss_positions(model, lab):
        out = model(input_ids=ids, labels=lab, position_ids=pos, use_cache=False)
    hook.remove()
    # the MLP saw only the loss positions (a flat batch of them), not every token
    assert seen == [torch.Size([int(loss_positions(lab).sum()), model.config.intermediate_size])]
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    keep = loss_positions(lab)
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out.logits[~keep], ref.logits[~keep])  # the discarded logits did change
    g = _grads(model, out.loss)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-10, atol=1e-12, msg=n)
    assert "forward" not in vars(mlp)  # the module's own forward is back
    with pytest.raises(RuntimeError, match="boom"), last_mlp_on_loss_positions(model, lab):
        raise RuntimeError("boom")
    assert "forward" not in vars(mlp)


def test_bad_input_is_refused(tok, problems):
    with pytest.raises(ValueError, match="non-empty"):
        packed_sft_batch(tok, [], 64)
    for width in (0, -3, 2.5):
        with pytest.raises(ValueError, match="width must be an int >= 1"):
            packed_sft_batch(tok, problems, width)
    with pytest.raises(TypeError, match="model.layers"):
        with last_mlp_on_loss_positions(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="pack_width"):
        TinyTrainConfig(pack_width=-1)


def test_both_layouts_train_the_same_model(tmp_path):
    """pack_width > 0 (packed, the default) and 0 (right-padded) give the same first losses (float32
    rounding apart) and both save a loadable checkpoint."""
    from transformers import AutoModelForCausalLM

    assert TinyTrainConfig().pack_width > 0
    runs = [train_tiny(TinyTrainConfig.quick(steps=2, eval_per_level=1, pack_width=w), tmp_path / f"w{w}", progress=False)
            for w in (96, 0)]
    assert runs[0].final_loss == pytest.approx(runs[1].final_loss, rel=1e-4)
    for r in runs:
        assert type(AutoModelForCausalLM.from_pretrained(r.path)).__name__ == "Qwen3ForCausalLM"
