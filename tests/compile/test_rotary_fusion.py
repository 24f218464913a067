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


def _rotate_half_graph(repeated_halves: bool, inputs_rotated: tuple[str, ...] = ("x",)) -> onnx.ModelProto:
    """y = x * cos + rotate_half(x) * sin, with cos/sin = f(concat(a, a)) or f(concat(a, b)),
    unsqueezed at axis 1, as transformers exports it. With ``inputs_rotated=("x", "z")`` a second
    input is rotated by the same cos/sin (as q and k are in every layer) into ``w``."""
    const = lambda name, values: oh.make_node("Constant", [], [name], value_ints=values)  # noqa: E731
    nodes = [
        const("zero", [0]), const("half", [D // 2]), const("end", [2**63 - 1]), const("ax", [3]),
        const("one", [1]), const("axis1", [1]),
        oh.make_node("Concat", ["a", "a" if repeated_halves else "b"], ["freqs"], axis=-1),
        oh.make_node("Cos", ["freqs"], ["cos3"]), oh.make_node("Sin", ["freqs"], ["sin3"]),
        oh.make_node("Unsqueeze", ["cos3", "axis1"], ["cos"]), oh.make_node("Unsqueeze", ["sin3", "axis1"], ["sin"]),
    ]  # fmt: skip
    for x, y in zip(inputs_rotated, ("y", "w")):
        nodes += [
            oh.make_node("Slice", [x, "zero", "half", "ax", "one"], [f"{x}1"]),
            oh.make_node("Slice", [x, "half", "end", "ax", "one"], [f"{x}2"]),
            oh.make_node("Neg", [f"{x}2"], [f"{x}neg"]),
            oh.make_node("Concat", [f"{x}neg", f"{x}1"], [f"{x}rot"], axis=-1),
            oh.make_node("Mul", [x, "cos"], [f"{x}c"]), oh.make_node("Mul", [f"{x}rot", "sin"], [f"{x}s"]),
            oh.make_node("Add", [f"{x}c", f"{x}s"], [y]),
        ]  # fmt: skip
    inputs = [
        *(oh.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", H, "seq", D]) for x in inputs_rotated),
        oh.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "seq", D // 2]),
        oh.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", "seq", D // 2]),
    ]
    outputs = [oh.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in ("y", "w")[: len(inputs_rotated)]]
    graph = oh.make_graph(nodes, "rope", inputs, outputs)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 24)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model)


def _run(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return _run_all(model, feeds)[0]


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


def test_q_and_k_sharing_one_cos_sin_are_both_rewritten():
    """In an exported layer q and k read the same unsqueezed cos/sin: that shared value is a leaf of
    the pattern, so both rotaries are rewritten."""
    proto = _rotate_half_graph(True, inputs_rotated=("x", "z"))
    model = ir.from_proto(proto)
    assert fuse_rotary(model) == 2
    fused = ir.to_proto(model)
    assert Counter(n.op_type for n in fused.graph.node)["RotaryEmbedding"] == 2
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal((B, H, S, D), dtype=np.float32) for name in ("x", "z")}
    feeds |= {name: rng.standard_normal((B, S, D // 2), dtype=np.float32) for name in ("a", "b")}
    for got, want in zip(_run_all(fused, feeds), _run_all(proto, feeds)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


def _run_all(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
