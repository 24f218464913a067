"""Attention sinks (``s_aux``: GPT-OSS, Granite-SWA, MiMo-V2-Flash's sliding layers, Flint): one
extra logit per head joins every query's softmax and attends no value.

The reference (:func:`kvforge.graphs.reference.attention` with ``sinks``) equals transformers' own
eager attention of GPT-OSS (a sink column concatenated to the logits, softmax, column dropped) and
of Granite-SWA (the output scaled by ``sigmoid(logsumexp - sink)``). One layer of each lowering,
exported alone and run on ONNX Runtime, equals GPT-OSS's attention on a ragged batch with GQA and a
sliding window, for a prefill (several tokens per row, as the lowering is given them) and a decode
step: ``onnx`` spells the attention in Concat/Softmax/Slice (no ``Attention`` node: it has no
sinks), ``exact`` the same in its own layout, ``gqa`` hands the sinks to ``GroupQueryAttention``'s
``head_sink`` input.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import onnx
import pytest
import torch

from kvforge.graphs import lowering, reference
from tests.helpers import assert_close

BATCH, HEADS, KV_HEADS, CAPACITY, DIM = 2, 4, 2, 12, 8
SCALE = DIM**-0.5


def _gpt_oss(query, present_key, present_value, mask, sinks):
    """transformers' GPT-OSS eager attention on the full caches: ``[B, H_q, S, D]``."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
    out, _ = eager_attention_forward(module, query, present_key, present_value, additive, scaling=SCALE)
    return out.transpose(1, 2)


def _inputs(seq: int, write_indices: list[int], seed: int = 0):
    torch.manual_seed(seed)
    query = 3 * torch.randn(BATCH, HEADS, seq, DIM)
    key, value = (torch.randn(BATCH, KV_HEADS, seq, DIM) for _ in range(2))
    past_key, past_value = (torch.randn(BATCH, KV_HEADS, CAPACITY, DIM) for _ in range(2))
    sinks = 2 * torch.randn(HEADS)  # sinks of either sign, some larger than most scores
    return query, key, value, past_key, past_value, torch.tensor(write_indices), sinks


@pytest.mark.parametrize("window", [None, 4])
def test_reference_equals_transformers_gpt_oss_and_granite_swa(window):
    from transformers.models.granite_swa.modeling_granite_swa import eager_attention_forward as granite_swa

    query, key, value, past_key, past_value, write_indices, sinks = _inputs(3, [0, 6])
    present_key = reference.update(past_key, key, write_indices)
    present_value = reference.update(past_value, value, write_indices)
    mask = reference.attention_mask(write_indices, 3, CAPACITY, window)
    ours = reference.attention(query, present_key, present_value, mask, SCALE, sinks=sinks)
    assert_close(ours, _gpt_oss(query, present_key, present_value, mask, sinks), 1e-6, 1e-5, "vs GPT-OSS")

    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, sinks=sinks, training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    theirs, _ = granite_swa(module, query, present_key, present_value, additive, scaling=SCALE)
    assert_close(ours, theirs.transpose(1, 2), 1e-6, 1e-5, "vs Granite-SWA")
    # the sinks matter: without them the result differs
    plain = reference.attention(query, present_key, present_value, mask, SCALE)
    assert (plain - ours).abs().max() > 1e-2


class _OneLayer(torch.nn.Module):
    """One ``kvforge::cached_attention`` call with sinks (a parameter, as a family's module holds
    them), on the cache-aware mask, to export alone."""

    def __init__(self, sinks: torch.Tensor, window: int) -> None:
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.window = window

    def forward(self, query, key, value, past_key, past_value, write_indices):
        mask = reference.attention_mask(write_indices, query.shape[2], past_key.shape[2], self.window or None)
        args = (query, key, value, past_key, past_value, write_indices, mask)
        return lowering.cached_attention(*args, SCALE, 0.0, self.window, self.sinks)


def _export(module: torch.nn.Module, args: tuple, lowering_name: str) -> onnx.ModelProto:
    seq = torch.export.Dim("seq", min=1, max=CAPACITY)
    shapes = ({2: seq}, {2: seq}, {2: seq}, None, None, None)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=24,
            dynamic_shapes=shapes,
            custom_translation_table=lowering.translation_table(lowering_name),
            optimize=True,
            verbose=False,
        )
    return program.model_proto


@pytest.mark.parametrize("lowering_name", ["onnx", "exact", "gqa"])
def test_each_lowering_equals_transformers_gpt_oss_attention(lowering_name):
    import onnxruntime as ort

    window = 4
    query, key, value, past_key, past_value, write_indices, sinks = _inputs(3, [0, 0])
    model = _export(_OneLayer(sinks, window), (query, key, value, past_key, past_value, write_indices), lowering_name)
    ops = [n.op_type for n in model.graph.node]
    if lowering_name == "gqa":
        [gqa] = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa.input) == 12 and gqa.input[11], "the sinks go to GroupQueryAttention's head_sink input"
    else:
        assert "Attention" not in ops and {"Concat", "Softmax", "Slice", "TensorScatter"} <= set(ops)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    # GroupQueryAttention continues a cached sequence with several tokens only at batch 1 (the
    # runtime's gqa rule): a ragged prompt from 0, then a decode step of both rows at 5 and 9.
    cases = [(3, [0, 0]), (1, [5, 9])]
    if lowering_name != "gqa":
        cases.append((3, [2, 7]))  # several tokens continuing both rows, one past the window
    for seq, start in cases:
        query, key, value, past_key, past_value, write_indices, _ = _inputs(seq, start, seed=seq + start[1])
        args = (query, key, value, past_key, past_value, write_indices)
        output, present_key, present_value = session.run(None, dict(zip(names, (a.numpy() for a in args))))
        expected_key = reference.update(past_key, key, write_indices)
        expected_value = reference.update(past_value, value, write_indices)
        if lowering_name != "gqa":
            assert np.array_equal(present_key, expected_key.numpy())
            assert np.array_equal(present_value, expected_value.numpy())
        mask = reference.attention_mask(write_indices, seq, CAPACITY, window)
        expected = _gpt_oss(query, expected_key, expected_value, mask, sinks)
        assert_close(output, expected, 1e-5, 1e-5, f"{lowering_name}: {seq} tokens at {start}")


@pytest.mark.parametrize("kv_heads", [KV_HEADS, HEADS])  # grouped, and no grouping (the doubled query rows)
def test_exact_lowering_with_sinks_gives_a_call_of_s_tokens_what_s_one_token_calls_give(kv_heads):
    """The ``exact`` lowering's promise (speculative verify = plain decoding) holds with sinks: each
    token of a 3-token call continuing two rows of different lengths equals, bit for bit, its
    one-token call on the cache the earlier tokens left."""
    import onnxruntime as ort

    torch.manual_seed(1)
    query = 3 * torch.randn(BATCH, HEADS, 3, DIM)
    key, value = (torch.randn(BATCH, kv_heads, 3, DIM) for _ in range(2))
    past_key, past_value = (torch.randn(BATCH, kv_heads, CAPACITY, DIM) for _ in range(2))
    write_indices = torch.tensor([2, 7])
    args = (query, key, value, past_key, past_value, write_indices)
    model = _export(_OneLayer(2 * torch.randn(HEADS), 0), args, "exact")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    whole, _, _ = session.run(None, dict(zip(names, (a.numpy() for a in args))))
    caches = (past_key.numpy(), past_value.numpy())
    for s in range(3):
        step = (query[:, :, s : s + 1], key[:, :, s : s + 1], value[:, :, s : s + 1])
        feeds = [a.numpy() for a in step] + [*caches, (write_indices + s).numpy()]
        out, *caches = session.run(None, dict(zip(names, feeds)))
        assert np.array_equal(out[:, :, 0], whole[:, :, s]), (
            f"token {s}: max diff {np.abs(out[:, :, 0] - whole[:, :, s]).max()}"
        )
