"""The rotary rule of the ORT graphs: transformers' rotate-half pattern becomes one ONNX
``RotaryEmbedding`` with the same values, and only where cos/sin provably repeat their halves."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as oh

from kvforge.compile.optimize import fuse_rotary

B, H, S, D = 2, 3, 5, 8


def _rotate_half_graph(repeated_halves: bool) -> onnx.ModelProto:
    """y = x * cos + rotate_half(x) * sin, with cos/sin = f(concat(a, a)) or f(concat(a, b)),
    unsqueezed at axis 1, as transformers exports it."""
    const = lambda name, values: oh.make_node("Constant", [], [name], value_ints=values)  # noqa: E731
    nodes = [
        const("zero", [0]), const("half", [D // 2]), const("end", [2**63 - 1]), const("ax", [3]),
        const("one", [1]), const("axis1", [1]),
        oh.make_node("Concat", ["a", "a" if repeated_halves else "b"], ["freqs"], axis=-1),
        oh.make_node("Cos", ["freqs"], ["cos3"]), oh.make_node("Sin", ["freqs"], ["sin3"]),
        oh.make_node("Unsqueeze", ["cos3", "axis1"], ["cos"]), oh.make_node("Unsqueeze", ["sin3", "axis1"], ["sin"]),
        oh.make_node("Slice", ["x", "zero", "half", "ax", "one"], ["x1"]),
        oh.make_node("Slice", ["x", "half", "end", "ax", "one"], ["x2"]),
        oh.make_node("Neg", ["x2"], ["neg"]), oh.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1),
        oh.make_node("Mul", ["x", "cos"], ["xc"]), oh.make_node("Mul", ["rot", "sin"], ["rs"]),
        oh.make_node("Add", ["xc", "rs"], ["y"]),
    ]  # fmt: skip
    inputs = [
        oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", H, "seq", D]),
        oh.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", D // 2]),
        oh.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq", D // 2]),
    ]
    graph = oh.make_graph(nodes, "rope", inputs, [oh.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 24)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.mark.parametrize("repeated_halves", [True, False])
def test_rotate_half_becomes_one_rotary_embedding_only_when_halves_repeat(repeated_halves):
    proto = _rotate_half_graph(repeated_halves)
    model = ir.from_proto(proto)
    rewrites = fuse_rotary(model)
    fused = ir.to_proto(model)
    ops = Counter(n.op_type for n in fused.graph.node)
    if repeated_halves:
        assert rewrites == 1
        assert ops["RotaryEmbedding"] == 1 and ops["Neg"] == 0
    else:
        assert rewrites == 0 and ops["RotaryEmbedding"] == 0
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((B, H, S, D), dtype=np.float32),
        "a": rng.standard_normal((B, S, D // 2), dtype=np.float32),
        "b": rng.standard_normal((B, S, D // 2), dtype=np.float32),
    }
    np.testing.assert_allclose(_run(fused, feeds), _run(proto, feeds), atol=1e-6, rtol=1e-6)
