"""Row-keyed sampling: a row's sampled tokens do not depend on the other rows of its generate call (the property
that makes N data-parallel ranks sample what one process samples), the keys of identical contexts are told
apart by their occurrence, and the Gumbel-max draw samples softmax(scores / T)."""
import pytest
import torch

from treadle.grpo.row_keyed import RowGumbel, RowKeyedSampling, row_keys


def _model():
    from treadle.models.builders import build_tiny_model

    return build_tiny_model("qwen3", seed=0, vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, eos_token_id=1).double()


def test_keys_follow_the_row_not_the_batch():
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [7, 8, 9, 3]])
    mask = (ids != 0).long()
    k = row_keys(ids, mask, seed=0, step=3)
    assert k[0] != k[1]  # identical contexts: told apart by their occurrence
    # the same rows in another batch with another padding width: the same keys
    other = torch.tensor([[7, 8, 9, 3, 0], [0, 0, 0, 5, 6]])
    again = row_keys(other, (other != 0).long(), 0, 3)
    assert again == [k[2], k[0]]
    solo = row_keys(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), 0, 3)
    assert solo[0] == k[0]
    assert row_keys(ids, mask, 0, 4) != k and row_keys(ids, mask, 1, 3) != k


def test_gumbel_max_samples_the_softmax():
    torch.manual_seed(0)
    scores = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 4000
    counts = torch.zeros(4)
    for key in range(n):
        counts[RowGumbel([key], temperature=0.7)(None, scores.clone()).argmax()] += 1
    expected = torch.softmax(scores[0] / 0.7, -1)
    assert torch.allclose(counts / n, expected, atol=0.03)
    with pytest.raises(ValueError, match="temperature"):
        RowGumbel([0], temperature=0.0)


def test_a_rows_tokens_do_not_depend_on_its_batch():
    from transformers import GenerationConfig

    model = _model()
    cb = RowKeyedSampling(seed=5)
    cb._install(model)
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6, pad_token_id=0,
                          eos_token_id=1)
    rows = [[4, 5, 6], [4, 5, 6], [9, 8, 7, 6, 5]]

    def gen(batch):
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in batch])
        out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), generation_config=gc)
        return [o[width:].tolist() for o in out]

    whole = gen(rows)
    assert whole[0] != whole[1]  # two candidates of one prompt sample differently
    assert gen(rows[:2]) == whole[:2] and gen(rows[2:]) == whole[2:]
    # a non-sampling call passes through unchanged
    greedy = GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=0, eos_token_id=1)
    ids = torch.tensor([rows[2]])
    assert torch.equal(model.generate(input_ids=ids, generation_config=greedy),
                       type(model).generate(model, input_ids=ids, generation_config=greedy))
