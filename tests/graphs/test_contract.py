"""The KV contract's reference semantics: update, mask, attention, and the custom op built on them."""

from __future__ import annotations

import torch

from kvforge.graphs import contract, lowering, reference


def test_cache_shape_and_names():
    assert contract.cache_shape(3, 2, 4, 16, 8) == (3, 2, 2, 4, 16, 8)
    assert contract.past_names(2) == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert contract.present_names(1) == ["present.0.key", "present.0.value"]
    assert contract.prefill_input_names(1)[:4] == [
        "input_ids",
        "position_ids",
        "write_indices",
        "input_lengths",
    ]
    assert contract.decode_input_names(1)[:3] == ["input_ids", "position_ids", "write_indices"]


def test_update_writes_only_new_rows_at_each_rows_index():
    past = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2)
    update = -torch.ones(2, 1, 2, 2)
    present = reference.update(past, update, torch.tensor([1, 4]))
    expected = past.clone()
    expected[0, :, 1:3] = -1
    expected[1, :, 4:6] = -1
    assert torch.equal(present, expected)
    assert not torch.equal(past, present), "the reference update is functional: the input is unchanged"


def test_mask_attends_own_prefix_and_window():
    mask = reference.attention_mask(torch.tensor([0, 3]), seq_len=2, capacity=6)[:, 0]  # (B, S, S_max)
    assert mask[0].tolist() == [
        [True, False, False, False, False, False],
        [True, True, False, False, False, False],
    ]
    assert mask[1].tolist() == [[True, True, True, True, False, False], [True, True, True, True, True, False]]
    windowed = reference.attention_mask(torch.tensor([3]), seq_len=1, capacity=6, window=2)[0, 0, 0]
    assert windowed.tolist() == [False, False, True, True, False, False]


def test_attention_matches_naive_softmax_with_gqa():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = reference.attention_mask(torch.tensor([2]), seq_len=2, capacity=5)
    out = reference.attention(q, k, v, mask, scale=8**-0.5)
    for h in range(4):
        kv = h // 2  # query heads 0,1 share KV head 0; 2,3 share KV head 1
        for s, visible in enumerate((3, 4)):  # queries at cache indices 2 and 3
            w = torch.softmax(q[0, h, s] @ k[0, kv, :visible].T * 8**-0.5, dim=-1)
            torch.testing.assert_close(out[0, h, s], w @ v[0, kv, :visible])


def test_custom_op_is_update_then_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    pk, pv = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    wi = torch.tensor([0, 5])
    mask = reference.attention_mask(wi, 3, 10)
    out, k2, v2 = lowering.cached_attention(q, k, v, pk, pv, wi, mask, 0.5, 0.0, 0)
    torch.testing.assert_close(k2, reference.update(pk, k, wi))
    torch.testing.assert_close(v2, reference.update(pv, v, wi))
    torch.testing.assert_close(out, reference.attention(q, k2, v2, mask, 0.5))
