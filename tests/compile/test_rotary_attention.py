"""Rotary inside attention (kvforge.compile.fusions.fuse_rotary_into_attention): in a Llama artifact's
ORT graphs every GroupQueryAttention reads the packed q/k/v projection and rotates q and k itself
(``do_rotary=1``, cos/sin tables of ``max_seq`` positions; each token's position derived from the
lengths inputs, no ``position_ids``), with no RotaryEmbedding or q/k/v Split left; a chunked prefill
(not the first prompt: positions from the write index) and the decode steps after it give
transformers' logits and greedy tokens, and so does a ragged batch of two rows; the cos/sin
tables are the graph's own values at each position, and a rope whose values depend on the longest
position of the call (longrope, dynamic NTK) is refused (it keeps its rotaries)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto
from onnx import helper as oh

from kvforge.compile.fusions import _position_tables
from kvforge.runtime import Engine

MAX_SEQ, HEAD_DIM, LAYERS = 96, 16, 2  # tests/conftest.py's llama_artifact: hidden 64, 4 heads


@pytest.mark.parametrize("graph", ["prefill.ort.onnx", "decode.ort.onnx"])
def test_attention_reads_the_packed_projection_and_rotates_itself(llama_artifact, graph):
    proto = onnx.load(str(llama_artifact / graph), load_external_data=False).graph
    ops = Counter(n.op_type for n in proto.node)
    assert ops["RotaryEmbedding"] == 0 and ops["GroupQueryAttention"] == LAYERS
    assert ops["Split"] == LAYERS  # gate/up only
    shapes = {i.name: list(i.dims) for i in proto.initializer}
    producers = {out: n for n in proto.node for out in n.output}
    for node in (n for n in proto.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0
        query, key, value = node.input[:3]
        assert producers[query].op_type == "MatMul" and key == "" and value == ""
        assert shapes[node.input[7]] == shapes[node.input[8]] == [MAX_SEQ, HEAD_DIM // 2]
        assert len(node.input) == 9  # no position_ids: GroupQueryAttention derives them from seqlens_k


def test_chunked_prefill_and_decode_match_transformers(llama_artifact, llama_reference):
    prompt = [5, 17, 42, 99, 3, 8, 250, 11, 64]
    with Engine.load(llama_artifact, threads=1) as engine:
        logits = [engine.prefill([prompt[:4]]).copy()]
        logits.append(engine.prefill([prompt[4:]], start=[4]).copy())  # positions 4..8: from seqlens_k
        tokens = [int(np.argmax(logits[-1][0]))]
        for _ in range(6):
            logits.append(engine.decode([tokens[-1]]).copy())
            tokens.append(int(np.argmax(logits[-1][0])))
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        want = llama_reference(ids).logits[0].numpy()
    at = [3, 8, *range(9, 9 + 6)]  # the last token of each chunk, then each decode step's input
    for got, row in zip(logits, at):
        np.testing.assert_allclose(got[0], want[row], atol=1e-4, rtol=1e-4)
    assert tokens == [int(t) for t in np.argmax(want[8:], axis=-1)]


def test_a_ragged_batch_rotates_each_row_at_its_own_positions(llama_artifact, llama_reference):
    """Two rows of different lengths (the short one right-padded in the prefill): each row's
    logits at its last token and over 5 decode steps, where the rows sit at different positions."""
    from tests.helpers import hf_greedy

    prompts = [[5, 17, 42, 99, 3, 8, 250], [7, 21]]
    with Engine.load(llama_artifact, threads=1) as engine:
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=6)]
    assert got == [hf_greedy(llama_reference, p, 6) for p in prompts]


def _rope_model(depends_on_longest: bool) -> tuple[ir.Model, ir.Value, ir.Value, ir.Value]:
    """cos/sin ``[B, S, 4]`` of ``position_ids`` (angle = position * inv_freq); with
    ``depends_on_longest`` the angle also grows with the call's largest position."""
    inv_freq = oh.make_tensor("inv_freq", TensorProto.FLOAT, [4], [1.0, 0.1, 0.01, 0.001])
    nodes = [
        oh.make_node("Cast", ["position_ids"], ["p"], to=TensorProto.FLOAT),
        oh.make_node("Unsqueeze", ["p", "axes"], ["p3"]),
        oh.make_node("Mul", ["p3", "inv_freq"], ["angle0"]),
    ]
    if depends_on_longest:
        nodes += [
            oh.make_node("ReduceMax", ["p"], ["longest"], keepdims=0),
            oh.make_node("Add", ["angle0", "longest"], ["angle"]),
        ]
    else:
        nodes.append(oh.make_node("Identity", ["angle0"], ["angle"]))
    nodes += [oh.make_node("Cos", ["angle"], ["cos"]), oh.make_node("Sin", ["angle"], ["sin"])]
    axes = oh.make_tensor("axes", TensorProto.INT64, [1], [-1])
    graph = oh.make_graph(
        nodes,
        "rope",
        [oh.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])],
        [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("cos", "sin")],
        [inv_freq, axes],
    )
    model = ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]))
    values = {v.name: v for node in model.graph for v in node.outputs}
    return model, values["cos"], values["sin"], model.graph.inputs[0]


def test_tables_are_the_graphs_values_at_each_position():
    model, cos, sin, ids = _rope_model(depends_on_longest=False)
    tables = _position_tables(model, cos, sin, ids, 12, ir.DataType.FLOAT)
    assert tables is not None
    angle = np.arange(12, dtype=np.float32)[:, None] * np.array([1.0, 0.1, 0.01, 0.001], dtype=np.float32)
    np.testing.assert_allclose(tables[0].const_value.numpy(), np.cos(angle), atol=1e-6)
    np.testing.assert_allclose(tables[1].const_value.numpy(), np.sin(angle), atol=1e-6)
    assert tables[0].shape == [12, 4]


def test_a_rope_of_the_longest_position_is_refused():
    model, cos, sin, ids = _rope_model(depends_on_longest=True)
    assert _position_tables(model, cos, sin, ids, 12, ir.DataType.FLOAT) is None
