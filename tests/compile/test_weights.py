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


def test_initializers_of_subgraphs_move_into_the_weights_file_too(tmp_path):
    """A constant that ORT's offline optimizer folded inside a ``Scan`` or ``If`` body is that body's
    own initializer; it moves into weights.data like the top graph's (a Mamba-130m-sized artifact
    of the ``onnx`` lowering once pointed its Scan body at a file deleted after the optimizer), and
    the saved graph runs with the same numbers."""
    import onnxruntime as ort

    table = np.arange(512, dtype=np.float32)  # 2 KiB: over the 1 KiB threshold
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([512]))
    flag = ir.Value(name="flag", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    inner = ir.Value(name="table", const_value=ir.tensor(table, name="table"))
    inner.type, inner.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([512])
    add = ir.node("Add", [x, inner])
    add.outputs[0].name = "sum"
    then = ir.Graph([], [add.outputs[0]], nodes=[add], initializers=[inner], name="then")
    neg = ir.node("Neg", [x])
    neg.outputs[0].name = "neg"
    orelse = ir.Graph([], [neg.outputs[0]], nodes=[neg], name="else")
    branch = ir.node("If", [flag], {"then_branch": then, "else_branch": orelse})
    branch.outputs[0].name = "y"
    branch.outputs[0].type, branch.outputs[0].shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([512])
    graph = ir.Graph([x, flag], [branch.outputs[0]], nodes=[branch], opset_imports={"": 24}, name="g")
    weights = SharedWeights(tmp_path)
    weights.add({"m": ir.Model(graph, ir_version=10)})
    assert isinstance(inner.const_value, ir.ExternalTensor) and weights.references == 1
    assert (tmp_path / "weights.data").stat().st_size >= table.nbytes
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    ones = np.ones(512, dtype=np.float32)
    [y] = session.run(None, {"x": ones, "flag": np.array(True)})
    np.testing.assert_array_equal(y, ones + table)
