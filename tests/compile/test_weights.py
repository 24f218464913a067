"""The shared weights file (kvforge.compile.weights.SharedWeights): a tensor is stored once however
many graphs and names hold it; two tensors that agree on every sampled byte but differ elsewhere are
both stored (the sample only picks candidates, the bytes decide); and the running sha256 the
manifest records is the sha256 of the file's bytes, alignment padding included."""

from __future__ import annotations

import hashlib

import numpy as np
import onnx_ir as ir

from kvforge.compile.weights import ALIGNMENT, SharedWeights


def _graph(tensors: dict[str, np.ndarray]) -> ir.Model:
    """A graph that adds its initializers to its input, one Add each."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([100_000]))
    graph = ir.Graph([x], [], nodes=[], opset_imports={"": 24}, name="g")
    for name, array in tensors.items():
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        value.type, value.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape(array.shape)
        graph.register_initializer(value)
        node = ir.node("Add", [x, value])
        graph.append(node)
        graph.outputs.append(node.outputs[0])
        node.outputs[0].name = f"{name}_out"
    return ir.Model(graph, ir_version=10)


def test_each_tensor_once_the_bytes_decide_and_the_digest_is_the_files(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(100_000).astype(np.float32)  # 400,000 bytes
    # Differs from `weight` in one float outside every sampled piece: the first and last 4 KiB,
    # and 64 pieces of 64 bytes every (400000 - 64) // 64 = 6249 bytes (byte 62590 is in none).
    almost = weight.copy()
    almost[62590 // 4] += 1.0
    weights = SharedWeights(tmp_path)
    weights.add({"a": _graph({"w": weight, "w_again": weight.copy()}), "b": _graph({"w_b": weight, "almost": almost})})

    report = weights.report()
    assert report.tensors == 2  # weight (held 3 times, under 3 names) and almost
    assert report.references == 4
    data = (tmp_path / "weights.data").read_bytes()
    second = -(-weight.nbytes // ALIGNMENT) * ALIGNMENT  # the next aligned offset
    assert len(data) == second + almost.nbytes
    assert data[: weight.nbytes] == weight.tobytes()
    assert data[weight.nbytes : second] == bytes(second - weight.nbytes)
    assert data[second:] == almost.tobytes()
    assert weights.sha256() == hashlib.sha256(data).hexdigest()
