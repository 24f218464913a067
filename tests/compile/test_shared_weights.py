"""A weight several layers share (Zamba2's one attention block, run at each hybrid layer): the
exporter reads it through a ``Transpose`` per use, which onnxscript's constant folding leaves, so
its products stayed float MatMuls under ``--quantize`` (a random Zamba2-1.2B outline's int4 step
spent 87 of 159 ms in them). :func:`kvforge.compile.export.transpose_weights_lazily` folds every
use into one transposed initializer, and :func:`kvforge.compile.quantize.quantize` quantizes it
once for all the MatMuls that read it: the same bytes and outputs as a copy quantized per use."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, numpy_helper
from onnx import helper as oh

from kvforge.compile import compile_model
from kvforge.compile.export import transpose_weights_lazily
from kvforge.compile.quantize import quantize
from tests import families

IN, OUT = 64, 96


def _graph(shared: bool, transposed: bool) -> ir.Model:
    """y = x @ W.T + relu(x) @ W.T with W [OUT, IN] (``transposed``: read through a Transpose per use,
    as the exporter reads a Linear's weight; else W is stored [IN, OUT]); ``shared``: both products
    read one initializer, else each its own copy."""
    rng = np.random.default_rng(0)
    weight = (0.1 * rng.standard_normal((OUT, IN))).astype(np.float32)
    stored = weight if transposed else np.ascontiguousarray(weight.T)
    names = ["w", "w"] if shared else ["w0", "w1"]
    inits = [numpy_helper.from_array(stored, name) for name in dict.fromkeys(names)]
    nodes = [oh.make_node("Relu", ["x"], ["r"], name="relu")]
    for i, (source, name) in enumerate(zip(("x", "r"), names)):
        if transposed:
            nodes.append(oh.make_node("Transpose", [name], [f"t{i}"], name=f"transpose{i}", perm=[1, 0]))
            name = f"t{i}"
        nodes.append(oh.make_node("MatMul", [source, name], [f"y{i}"], name=f"matmul{i}"))
    nodes.append(oh.make_node("Add", ["y0", "y1"], ["y"], name="add"))
    graph = oh.make_graph(
        nodes,
        "shared",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", IN])],
        [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT])],
        inits,
    )
    return ir.from_proto(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]))


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


X = np.random.default_rng(1).standard_normal((5, IN)).astype(np.float32)


def test_a_weight_read_through_several_transposes_becomes_one_transposed_initializer():
    model = _graph(shared=True, transposed=True)
    expected = _run(model, X)
    replaced = transpose_weights_lazily(model)
    assert [n.op_type for n in model.graph] == ["Relu", "MatMul", "MatMul", "Add"]
    [(name, source)] = replaced.items()
    assert source == "w" and list(model.graph.initializers) == [name]
    first, second = (n for n in model.graph if n.op_type == "MatMul")
    assert first.inputs[1] is second.inputs[1] and first.inputs[1].const_value.shape == (IN, OUT)
    np.testing.assert_array_equal(_run(model, X), expected)


def test_a_weight_other_nodes_read_untransposed_is_left_alone():
    model = _graph(shared=True, transposed=True)
    extra = ir.node("Identity", inputs=[model.graph.initializers["w"]], name="reader")
    model.graph.append(extra)
    assert transpose_weights_lazily(model) == {}
    assert sum(n.op_type == "Transpose" for n in model.graph) == 2


def test_a_shared_weight_is_quantized_once_for_every_matmul_that_reads_it():
    shared = quantize({"g": _graph(shared=True, transposed=False)}, "int4", 32)["g"]
    copies = quantize({"g": _graph(shared=False, transposed=False)}, "int4", 32)["g"]
    first, second = (n for n in shared.graph if n.op_type == "MatMulNBits")
    assert [v for v in first.inputs[1:]] == [v for v in second.inputs[1:]]  # the same initializers
    assert "w" not in shared.graph.initializers  # the float weight is gone
    assert sum(n.op_type == "MatMulNBits" for n in copies.graph) == 2
    for a, b in zip(second.inputs[1:], next(n for n in copies.graph if n.name.startswith("matmul1")).inputs[1:]):
        np.testing.assert_array_equal(a.const_value.numpy(), b.const_value.numpy())  # the bytes of its own copy
    np.testing.assert_array_equal(_run(shared, X), _run(copies, X))


def test_a_zamba2_int4_artifact_quantizes_its_shared_attention_block(tmp_path):
    [(_, architecture, config_class, overrides)] = [c for c in families.CASES if c[0] == "zamba2"]
    model_dir = families.build(tmp_path / "model", architecture, config_class, overrides)
    compile_model(
        model_dir, tmp_path / "out", max_batch=1, max_seq=32, quantize="int4", optimize=False, score_graph=False,
        progress=None,
    )  # fmt: skip
    graph = onnx.load(str(tmp_path / "out" / "decode.onnx"), load_external_data=False).graph
    float_products = [n.name for n in graph.node if n.op_type in ("MatMul", "Gemm")]
    quantized = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert float_products == []  # the LoRA adapters too (rank 8: K and N multiples of the block)
    # 3 hybrid layers run 2 blocks of tied weights (layers 1 and 4 share the first): its 6 projections
    # (q, k, v, o, gate|up, down) each read by 2 MatMulNBits over one set of initializers
    readers: dict[str, list[str]] = {}
    for node in quantized:
        readers.setdefault(node.input[1], []).append(node.name)
    shared = {weight: names for weight, names in readers.items() if len(names) > 1}
    assert len(shared) == 6 and all(len(names) == 2 for names in shared.values()), shared
