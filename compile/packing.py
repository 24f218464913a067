"""Stage pass: exported graphs -> graphs whose projections of one input are one packed MatMul.

Input and output: the ``onnx_ir.Model`` graphs from :mod:`kvforge.compile.export`, edited in place
before :mod:`kvforge.compile.quantize` and :mod:`kvforge.compile.weights` see them. Every group of
``MatMul`` nodes that read the same activation with constant 2-D weights of the same dtype and
input width (a layer's q, k, v projections; its gate and up projections) becomes one ``MatMul``
against the weights concatenated along the output axis, followed by a ``Split`` that gives each
former consumer exactly the columns its projection produced (biases, applied by a following
``Add``, stay where they were). ``MatMul(x, [Wq | Wk | Wv])`` split by columns equals
``MatMul(x, Wq)``, ``MatMul(x, Wk)``, ``MatMul(x, Wv)`` (each output column is one dot product
over the same ``x`` row), so values are unchanged; a decode step runs one larger matrix-vector
product instead of three small ones.

One copy of the weights (DESIGN.md): the packed tensor replaces its parts in the graph, and the
parts are dropped from the graph's initializers when nothing else reads them, so only the packed
tensor reaches ``weights.data``. A weight that another node also reads (a tied table) is left
unpacked, since packing it would store its bytes twice. The packing is deterministic, so the
prefill, decode and score graphs pack to identical tensors and the shared weights file stores each
once. The portable graphs carry the same MatMul + Split (standard ONNX: TensorRT builds it).
A packed tensor is lazy: its parts are concatenated only when the weights file takes it, one at a
time, so packing adds one tensor to compile's peak memory, not a copy of every projection.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx_ir as ir


def pack_projections(models: dict[str, ir.Model]) -> dict[str, int]:
    """Pack every graph of ``models`` in place; returns {graph name: groups packed}."""
    return {name: pack_shared_input_matmuls(model.graph) for name, model in models.items()}


def pack_shared_input_matmuls(graph: ir.Graph) -> int:
    """Pack each group of >= 2 MatMuls of one activation into a MatMul + Split; returns the groups."""
    groups: dict[ir.Value, list[ir.Node]] = defaultdict(list)
    for node in graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and _packable_weight(node, graph):
            groups[node.inputs[0]].append(node)
    packed = 0
    for x, nodes in groups.items():
        weights = [node.inputs[1] for node in nodes]
        if len(nodes) < 2 or len({(w.dtype, w.shape[0]) for w in weights}) != 1:
            continue
        _pack(graph, x, nodes)
        packed += 1
    return packed


def _packable_weight(node: ir.Node, graph: ir.Graph) -> bool:
    """A constant ``[K, N]`` initializer that this MatMul alone reads."""
    weight = node.inputs[1]
    return (
        weight is not None
        and weight.const_value is not None
        and weight.name in graph.initializers
        and weight.shape is not None
        and len(weight.shape) == 2
        and all(isinstance(d, int) for d in weight.shape)
        and len(list(weight.uses())) == 1
        and weight not in graph.outputs
    )


def _pack(graph: ir.Graph, x: ir.Value, nodes: list[ir.Node]) -> None:
    """Replace ``nodes`` (MatMuls of ``x``) by one MatMul on the column-concatenated weights and a
    Split; the parts' initializers are removed."""
    weights = [node.inputs[1] for node in nodes]
    widths = [w.shape[1] for w in weights]
    parts = [w.const_value for w in weights]
    packed_name = f"{weights[0].name}.packed"
    shape = ir.Shape([weights[0].shape[0], sum(widths)])  # (K, sum N)

    def concatenate() -> ir.Tensor:  # run when the weights file takes it: never all packed at once
        return ir.Tensor(np.concatenate([part.numpy() for part in parts], axis=1), name=packed_name)

    first = nodes[0]
    name = f"{first.name}/packed" if first.name else f"{weights[0].name}/packed"
    lazy = ir.LazyTensor(concatenate, dtype=weights[0].dtype, shape=shape, name=packed_name)
    packed_weight = ir.Value(name=packed_name, const_value=lazy)
    packed_weight.shape, packed_weight.type = shape, ir.TensorType(weights[0].dtype)
    graph.register_initializer(packed_weight)
    sizes = ir.Value(
        name=f"{name}/sizes", const_value=ir.tensor(np.array(widths, dtype=np.int64), name=f"{name}/sizes")
    )
    sizes.shape, sizes.type = ir.Shape([len(widths)]), ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(sizes)
    matmul = ir.Node("", "MatMul", [x, packed_weight], name=name)
    out = matmul.outputs[0]
    out.name, out.type = f"{name}/output", ir.TensorType(weights[0].dtype)
    if first.outputs[0].shape is not None:
        out.shape = ir.Shape([*first.outputs[0].shape[:-1], sum(widths)])
    split = ir.Node(
        "", "Split", [out, sizes], attributes=[ir.AttrInt64("axis", -1)], num_outputs=len(nodes), name=f"{name}/split"
    )
    graph.insert_before(first, [matmul, split])
    for node, part in zip(nodes, split.outputs):
        old = node.outputs[0]
        part.shape, part.type = old.shape, old.type or ir.TensorType(weights[0].dtype)
        old.replace_all_uses_with(part, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        part.name = old.name  # the graph keeps the projection's value name
    for weight in weights:
        if not list(weight.uses()):
            graph.initializers.pop(weight.name)
