"""Packed projections (kvforge.compile.packing): MatMuls of one activation become one MatMul on the
column-concatenated weights plus a Split, with bit-identical outputs; the parts leave the graph (one
copy of the weights); a weight another node also reads is not packed; the compiled artifact's
portable and ORT graphs both read the packed weights."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from kvforge.compile.packing import pack_shared_input_matmuls

K = 8
WIDTHS = {"w_q": 8, "w_k": 4, "w_v": 4, "w_tied": 6}


def _graph() -> onnx.ModelProto:
    """q (with a bias Add), k, v (v a graph output itself) and a fourth projection whose weight a
    Gather also reads (a tied table), all of the same x."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((K, n)).astype(np.float32), name) for name, n in WIDTHS.items()
    ]
    inits.append(numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b_q"))
    nodes = [
        oh.make_node("MatMul", ["x", "w_q"], ["q_lin"], name="q_proj"),
        oh.make_node("Add", ["q_lin", "b_q"], ["q"], name="q_bias"),
        oh.make_node("MatMul", ["x", "w_k"], ["k"], name="k_proj"),
        oh.make_node("MatMul", ["x", "w_v"], ["v"], name="v_proj"),
        oh.make_node("MatMul", ["x", "w_tied"], ["t"], name="tied_proj"),
        oh.make_node("Gather", ["w_tied", "ids"], ["row"], name="embed"),
    ]
    inputs = [
        oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", K]),
        oh.make_tensor_value_info("ids", TensorProto.INT64, [2]),
    ]
    outputs = [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("q", "k", "v", "t", "row")]
    model = oh.make_model(oh.make_graph(nodes, "proj", inputs, outputs, inits), opset_imports=[oh.make_opsetid("", 21)])
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto) -> list[np.ndarray]:
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, K)).astype(np.float32), "ids": np.array([0, 5])}
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_projections_of_one_input_become_one_matmul_with_identical_outputs():
    proto = _graph()
    model = ir.from_proto(proto)
    assert pack_shared_input_matmuls(model.graph) == 1
    packed = ir.to_proto(model)
    ops = Counter(n.op_type for n in packed.graph.node)
    assert ops["MatMul"] == 2 and ops["Split"] == 1  # q|k|v packed; the tied projection apart
    weights = {t.name: t for t in packed.graph.initializer}
    assert not {"w_q", "w_k", "w_v"} & weights.keys() and "w_tied" in weights  # the parts are gone
    [name] = [n for n in weights if n.endswith(".packed")]
    assert list(weights[name].dims) == [K, WIDTHS["w_q"] + WIDTHS["w_k"] + WIDTHS["w_v"]]
    assert [o.name for o in packed.graph.output] == ["q", "k", "v", "t", "row"]
    for got, want in zip(_run(packed), _run(proto)):
        np.testing.assert_array_equal(got, want)


def test_compiled_artifact_reads_packed_weights_in_both_graphs(llama_artifact):
    """Every layer's q/k/v and gate/up are one MatMul each in the portable and the ORT graph; no
    part of a packed weight is stored beside it (the tiny Llama has 2 layers). The ORT graph's
    attention reads the packed q/k/v itself (tests/compile/test_rotary_attention.py): one Split
    per layer there (gate/up), two in the portable graph."""
    for graph_file in ("prefill.onnx", "prefill.ort.onnx"):
        graph = onnx.load(str(llama_artifact / graph_file), load_external_data=False).graph
        ops = Counter(node.op_type for node in graph.node)
        assert ops["Split"] == (2 if graph_file == "prefill.onnx" else 1) * 2, graph_file
        assert ops["MatMul"] == 4 * 2, graph_file  # qkv, o, gate|up, down
