"""The ``onnx`` lowering's attention, as TensorRT will parse it.

A soft-capped layer (Gemma-2) is spelled in standard ops (MatMul, Tanh, Where, Softmax): the
compiled Gemma-2 graphs hold no ``Attention`` node (so none with the ``softcap`` attribute that
TensorRT's ONNX parser rejects), one Tanh soft-cap per layer, and pass ``inspect``'s TensorRT lint;
a model without a soft-cap keeps the fused ``Attention`` op. One layer of the lowering, exported
alone and run on ONNX Runtime, equals transformers' Gemma-2 eager attention (GQA, a ragged batch, a
sliding window) in float32 within 1e-5 and in float16 within 2e-3 (transformers' dtype handling:
scores and cap in float16, softmax in float32).
"""

from __future__ import annotations

import re
import types
import warnings

import numpy as np
import onnx
import pytest
import torch

from kvforge.graphs import lowering, reference
from tests.helpers import assert_close

GRAPHS = ("prefill.onnx", "decode.onnx")


def _nodes(path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def test_gemma2_softcap_is_spelled_in_ops_tensorrt_parses(gemma2_onnx_artifact):
    from kvforge.tools.inspect_artifact import inspect

    for graph in GRAPHS:
        nodes = _nodes(gemma2_onnx_artifact / graph)
        ops = [n.op_type for n in nodes]
        assert "Attention" not in ops, f"{graph}: {ops.count('Attention')} Attention nodes"
        assert not [n.name for n in nodes if any(a.name == "softcap" for a in n.attribute)]
        # Node names as the lowering gives them, without the "_<n>" that makes later layers' unique.
        names = {re.sub(r"_\d+$", "", n.name): n.op_type for n in nodes if "/attention/" in n.name}
        for layer in range(2):
            scope = f"/model/layers.{layer}/self_attn/attention"
            assert names.get(f"{scope}/softcap/tanh") == "Tanh", f"{graph}: no Tanh soft-cap in layer {layer}"
            assert names.get(f"{scope}/mask") == "Where" and names.get(f"{scope}/softmax") == "Softmax"
            assert names.get(f"{scope}/qk") == names.get(f"{scope}/pv") == "MatMul"
        assert ops.count("TensorScatter") == 4  # the in-place cache update is unchanged: K and V per layer
    report = inspect(gemma2_onnx_artifact)["tensorrt"]
    assert report["compatible"] and report["unsupported_ops"] == []
    assert all(not c["violations"] for c in report["graphs"].values())


def test_no_softcap_keeps_the_fused_attention_op(llama_onnx_artifact):
    for graph in GRAPHS:
        nodes = _nodes(llama_onnx_artifact / graph)
        ops = [n.op_type for n in nodes]
        assert ops.count("Attention") == 2 and "Tanh" not in ops  # one Attention per layer (2 layers)
        assert not [n.name for n in nodes if "/attention/" in n.name]


class _OneLayer(torch.nn.Module):
    """One ``kvforge::cached_attention`` call on the cache-aware mask, to export alone."""

    def __init__(self, scale: float, softcap: float, window: int) -> None:
        super().__init__()
        self.scale, self.softcap, self.window = scale, softcap, window

    def forward(self, query, key, value, past_key, past_value, write_indices):
        mask = reference.attention_mask(write_indices, query.shape[2], past_key.shape[2], self.window or None)
        args = (query, key, value, past_key, past_value, write_indices, mask)
        return lowering.cached_attention(*args, self.scale, self.softcap, self.window)


def _export(module: torch.nn.Module, args: tuple) -> onnx.ModelProto:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=24,
            custom_translation_table=lowering.translation_table("onnx"),
            optimize=True,
            verbose=False,
        )
    return program.model_proto


def _transformers_gemma2(query, present_key, present_value, mask, scale, softcap):
    """transformers' own Gemma-2 eager attention on the full caches, in the inputs' dtype: ``[B, H_q, S, D]``."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    groups = query.shape[1] // present_key.shape[1]
    module = types.SimpleNamespace(num_key_value_groups=groups, head_dim=query.shape[-1], training=False)
    additive = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
    out, _ = eager_attention_forward(
        module, query, present_key, present_value, additive, scaling=scale, softcap=softcap
    )
    return out.transpose(1, 2)  # (B, H_q, S, D)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_softcapped_layer_equals_transformers_gemma2_attention(dtype, tol):
    import onnxruntime as ort

    torch.manual_seed(0)
    batch, heads, kv_heads, seq, capacity, dim = 2, 4, 2, 3, 12, 8
    scale, softcap, window = dim**-0.5, 2.0, 4  # a small cap, so that tanh bends the scores
    query = (3 * torch.randn(batch, heads, seq, dim)).to(dtype)
    key, value = (torch.randn(batch, kv_heads, seq, dim).to(dtype) for _ in range(2))
    past_key, past_value = (torch.randn(batch, kv_heads, capacity, dim).to(dtype) for _ in range(2))
    write_indices = torch.tensor([0, 6])  # a ragged batch: row 1 has 6 cached tokens, past the window
    args = (query, key, value, past_key, past_value, write_indices)

    model = _export(_OneLayer(scale, softcap, window), args)
    ops = {n.op_type for n in model.graph.node}
    assert "Attention" not in ops and {"Tanh", "Where", "Softmax", "TensorScatter"} <= ops
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = dict(zip([i.name for i in session.get_inputs()], (a.numpy() for a in args)))
    output, present_key, present_value = session.run(None, feeds)

    expected_key = reference.update(past_key, key, write_indices)
    expected_value = reference.update(past_value, value, write_indices)
    assert np.array_equal(present_key, expected_key.numpy()) and np.array_equal(present_value, expected_value.numpy())
    mask = reference.attention_mask(write_indices, seq, capacity, window)
    expected = _transformers_gemma2(query, expected_key, expected_value, mask, scale, softcap)
    assert output.dtype == expected.numpy().dtype
    assert_close(output, expected, tol, tol, f"{dtype} soft-capped attention")


def test_softcap_zero_exports_the_attention_op():
    torch.manual_seed(0)
    args = (
        torch.randn(1, 4, 2, 8),
        torch.randn(1, 2, 2, 8),
        torch.randn(1, 2, 2, 8),
        torch.zeros(1, 2, 6, 8),
        torch.zeros(1, 2, 6, 8),
        torch.tensor([1]),
    )
    ops = [n.op_type for n in _export(_OneLayer(8**-0.5, 0.0, 0), args).graph.node]
    assert ops.count("Attention") == 1 and "Tanh" not in ops
