"""The binding plan (runtime/backends/binding_plan.py): each name -> buffer, byte offset, shape and
dtype; every address 256-byte aligned, padding where a cache slice is not a multiple of 256 bytes
while the views still match the KV contract; alias mode binds each present to its past's address,
alternate mode to the other cache, swapping with the parity; the load messages."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.graphs import contract
from kvforge.runtime.backends import binding_plan as bp

L = 2


def _layout(**kw) -> bp.CacheLayout:
    args = dict(num_layers=L, max_batch=3, num_kv_heads=2, max_seq=5, head_dim=3, dtype="float16")
    return bp.CacheLayout(**{**args, **kw})


def _io(max_batch=3, max_prompt=5, vocab=11):
    return bp.io_layout(max_batch, max_prompt, vocab, "float16")


def test_aligned_layout_is_exactly_the_contract():
    # [3, 2, 64, 8] float32 = 12288 bytes = 48 * 256: no padding, the buffer is [L, 2, B, H, S, D].
    layout = _layout(num_kv_heads=2, max_seq=64, head_dim=8, dtype="float32")
    assert layout.slice_bytes == 12288 and layout.padding_bytes == 0
    assert layout.nbytes == L * 2 * 3 * 2 * 64 * 8 * 4
    assert [layout.offset(0, 0), layout.offset(0, 1), layout.offset(1, 0)] == [0, 12288, 24576]


def test_unaligned_slices_are_padded_to_256_bytes():
    layout = _layout()  # [3, 2, 5, 3] float16 = 180 bytes per slice
    assert layout.slice_bytes == 180 and layout.slot_bytes == 256 and layout.padding_bytes == 76
    assert layout.nbytes == 2 * L * 256
    assert [layout.offset(layer, kind) for layer in range(L) for kind in (0, 1)] == [0, 256, 512, 768]


def test_padded_views_match_the_contract():
    """Write through the planned byte views of one buffer, read back by the contract's layout."""
    layout = _layout()
    rng = np.random.default_rng(0)
    expected = rng.standard_normal(
        contract.cache_shape(L, layout.max_batch, layout.num_kv_heads, layout.max_seq, layout.head_dim)
    ).astype(np.float16)
    raw = np.zeros(layout.nbytes, dtype=np.uint8)
    plan = layout.slices(batch=2)  # a batch smaller than max_batch: the first rows of each slice
    for layer in range(L):
        for kind, name in enumerate((contract.past_key_name(layer), contract.past_value_name(layer))):
            s = plan[name]
            assert s.shape == (2, 2, 5, 3) and s.offset == layout.offset(layer, kind)
            view = raw[s.offset : s.offset + s.nbytes].view(np.float16).reshape(s.shape)
            view[...] = expected[layer, kind, :2]
            assert np.shares_memory(view, raw)
    for layer in range(L):
        for kind in (0, 1):
            start = layout.offset(layer, kind)
            slot = raw[start : start + layout.slice_bytes].view(np.float16).reshape(3, 2, 5, 3)
            np.testing.assert_array_equal(slot[:2], expected[layer, kind, :2])  # rows 0..1 are the batch
            np.testing.assert_array_equal(slot[2], 0)  # row 2 untouched
            assert not raw[start + layout.slice_bytes : start + layout.slot_bytes].any()  # padding untouched


def test_io_tensors_sit_at_aligned_offsets():
    io = _io()
    offsets = {name: s.offset for name, s in io.offsets.items()}
    # ids 3x5 int64 = 120 B -> 256; positions -> 512; write 24 B -> 768; lengths -> 1024; logits 66 B -> 1280
    assert offsets == {
        "input_ids": 0,
        "position_ids": 256,
        "write_indices": 512,
        "input_lengths": 768,
        "logits": 1024,
        "next_token_ids": 1280,
    }
    assert io.nbytes == 1536
    with pytest.raises(ValueError, match=r"input_ids of shape \(3, 6\) exceeds its buffer"):
        io.slice("input_ids", (3, 6))


def _plan(mode, parity=0, batch=2, seq=4):
    inputs = contract.prefill_input_names(L)
    outputs = [*contract.output_names(L), bp.NEXT_TOKEN_IDS]
    return bp.plan_bindings(
        _layout(), _io(), graph_inputs=inputs, graph_outputs=outputs, batch=batch, seq=seq, mode=mode, parity=parity
    )


def test_alias_mode_binds_each_present_to_its_past_address():
    plan = _plan(bp.ALIAS)
    assert plan.inputs["input_ids"] == bp.Slice("io", 0, (2, 4), "int64")
    assert plan.inputs["input_lengths"] == bp.Slice("io", 768, (2,), "int64")
    assert plan.outputs["logits"] == bp.Slice("io", 1024, (2, 11), "float16")
    assert plan.outputs["next_token_ids"] == bp.Slice("io", 1280, (2,), "int32")
    assert plan.inputs["past_key_values.1.value"] == bp.Slice("cache", 768, (2, 2, 5, 3), "float16")
    for past, present in zip(contract.past_names(L), contract.present_names(L)):
        assert plan.outputs[present] == plan.inputs[past]
    assert all(s.offset % 256 == 0 for s in plan.all().values())


def test_alternate_mode_swaps_the_two_caches_with_the_parity():
    even, odd = _plan(bp.ALTERNATE, 0), _plan(bp.ALTERNATE, 1)
    key, present = "past_key_values.0.value", "present.0.value"
    assert (even.inputs[key].buffer, even.outputs[present].buffer) == ("cache", "cache_b")
    assert (odd.inputs[key].buffer, odd.outputs[present].buffer) == ("cache_b", "cache")
    assert even.inputs[key].offset == even.outputs[present].offset == 256  # same slot, other buffer


def test_decode_plan_has_one_token_rows():
    plan = _plan(bp.ALIAS, batch=3, seq=1)
    assert plan.inputs["input_ids"].shape == (3, 1) and plan.inputs["past_key_values.0.key"].shape == (3, 2, 5, 3)


def test_plan_refuses_unknown_names_and_bad_batches():
    with pytest.raises(ValueError, match="no place for input 'attention_mask'"):
        bp.plan_bindings(
            _layout(), _io(), graph_inputs=["attention_mask"], graph_outputs=[], batch=1, seq=1, mode=bp.ALIAS
        )
    with pytest.raises(ValueError, match=r"cache rows \[0, 4\) are outside \[0, 3\)"):
        _plan(bp.ALIAS, batch=4)
    with pytest.raises(ValueError, match="parity must be 0"):
        _plan(bp.ALIAS, parity=1)


def test_check_plan_catches_misaligned_and_misaliased_bindings():
    plan = _plan(bp.ALIAS)
    bad = bp.BindingPlan(plan.mode, 0, {**plan.inputs, "input_ids": bp.Slice("io", 8, (2, 4), "int64")}, plan.outputs)
    with pytest.raises(ValueError, match="input_ids is bound at offset 8, not a multiple of 256"):
        bp.check_plan(bad)
    moved = bp.BindingPlan(
        plan.mode, 0, plan.inputs, {**plan.outputs, "present.0.key": plan.inputs["past_key_values.0.value"]}
    )
    with pytest.raises(ValueError, match="present.0.key must be bound to past_key_values.0.key's address"):
        bp.check_plan(moved)
    alt = _plan(bp.ALTERNATE)
    same = bp.BindingPlan(
        alt.mode, 0, alt.inputs, {**alt.outputs, "present.1.key": alt.inputs["past_key_values.1.key"]}
    )
    with pytest.raises(ValueError, match="must not be bound to the cache past_key_values.1.key reads"):
        bp.check_plan(same)


def test_cache_mode_from_the_engines_aliasing_answers():
    full = dict(zip(contract.present_names(L), contract.past_names(L)))
    assert bp.cache_mode(full, L) == bp.ALIAS
    assert bp.cache_mode({**full, "present.1.value": None}, L) == bp.ALTERNATE
    assert bp.cache_mode({**full, "present.1.value": "past_key_values.1.key"}, L) == bp.ALTERNATE


def test_load_messages_say_the_mode_and_the_memory():
    layout = _layout(num_kv_heads=8, max_seq=1024, head_dim=128, max_batch=4)  # 8 MiB per slot
    assert bp.load_message(bp.ALIAS, layout, "tensorrt") == (
        "tensorrt: each present.* output aliases its past input: one KV cache of 32.0 MiB on the device, "
        "updated in place"
    )
    assert "keeping two KV caches (2 x 32.0 MiB) and alternating them each step (no copy" in bp.load_message(
        bp.ALTERNATE, layout, "tensorrt"
    )


def test_row_ranges_start_at_their_row_offset():
    # [4, 2, 64, 8] float16: a row is 2*64*8*2 = 2048 bytes, a multiple of 256: any first row binds.
    layout = _layout(max_batch=4, num_kv_heads=2, max_seq=64, head_dim=8)
    io = bp.io_layout(4, 8, 11, "float16")
    names = dict(graph_inputs=contract.prefill_input_names(L), graph_outputs=contract.output_names(L))
    plan = bp.plan_bindings(layout, io, **names, batch=2, seq=1, mode=bp.ALIAS, first=1)
    assert plan.inputs["past_key_values.1.key"] == bp.Slice(
        "cache", layout.offset(1, 0) + 2048, (2, 2, 64, 8), "float16"
    )
    assert plan.outputs["present.1.key"] == plan.inputs["past_key_values.1.key"]
    with pytest.raises(ValueError, match=r"cache rows \[3, 5\) are outside \[0, 4\)"):
        bp.plan_bindings(layout, io, **names, batch=2, seq=1, mode=bp.ALIAS, first=3)
    # A 180-byte row (the tiny layout) cannot start a bound range: named, with what to do.
    with pytest.raises(ValueError, match="not a multiple of 256 bytes .*compile with an even --max-seq"):
        bp.plan_bindings(_layout(), _io(), **names, batch=1, seq=1, mode=bp.ALIAS, first=1)
