"""Weight-only quantization: exported graphs -> graphs whose MatMul weights are int4 or int8.

Input: the ``onnx_ir.Model`` graphs from :mod:`kvforge.compile.export`. Output: the same graphs
with every MatMul against a constant weight replaced by ONNX Runtime's ``MatMulNBits``, made by
ONNX Runtime's own ``MatMulNBitsQuantizer`` (blocked, symmetric, ``accuracy_level=4``: int8
activations inside the kernel, ORT's fast CPU path). Activations, norms, the KV cache and the
embedding table stay in the model's dtype:

* the **lm_head** is a MatMul like the others and is quantized: on a small model it is the
  largest matrix read per decode step (SmolLM-135M: 28M of 135M parameters);
* the **embedding table** is not: a decode step reads one row of it, so quantizing it saves
  memory but no time, and a tied lm_head is a separate (transposed) tensor in the graph anyway.

ORT's quantizer runs on one MatMul at a time (a model of that node alone, spliced back), so only
one float weight is in memory at a time; it quantizes each node on its own, so the bytes are the
ones a run over the whole graph gives. The quantizer is deterministic, so the same weight
quantizes to the same bytes in every graph and the shared weights file still stores it once.
``MatMulNBits`` is an ORT contrib op: quantized artifacts run on ONNX Runtime, not TensorRT.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

QUANTIZE_BITS = {"int4": 4, "int8": 8}
DEFAULT_BLOCK_SIZE = 32


def quantize(
    models: dict[str, ir.Model],
    scheme: str,
    block_size: int = DEFAULT_BLOCK_SIZE,
    exclude: list[str] | None = None,
    *,
    symmetric: bool = True,
    lm_head: bool = True,
) -> dict[str, ir.Model]:
    """Quantize the MatMul weights of every graph to ``scheme`` ("int4" or "int8"), except the
    nodes named in ``exclude`` (a GGUF Q4_1 projection's block-minimum MatMul: already exact):
    symmetric blocks (``symmetric=False``: a zero point per block, ORT's asymmetric MatMulNBits),
    the lm_head included (``lm_head=False``: it stays a Gemm in the model's dtype). In place:
    returns the same models, each MatMul node replaced as it is quantized."""
    if scheme not in QUANTIZE_BITS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZE_BITS)}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block_size}")
    MatMulNBitsQuantizer = _import_quantizer()
    settings = dict(bits=QUANTIZE_BITS[scheme], block_size=block_size, is_symmetric=symmetric, accuracy_level=4)
    skipped = set(exclude or [])
    for model in models.values():
        if lm_head:
            _lm_head_as_matmul(model)
        for node in list(model.graph):
            if node.name not in skipped and _constant_matmul(node):
                _quantize_node(model, node, MatMulNBitsQuantizer, settings)
    return dict(models)


def _constant_matmul(node: ir.Node) -> bool:
    weight = node.inputs[1] if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
    return weight is not None and weight.const_value is not None and len(weight.const_value.shape) == 2


def _quantize_node(model: ir.Model, node: ir.Node, quantizer_class, settings: dict) -> None:
    """ORT's quantizer on a model of this one MatMul, spliced back in place of the node: one
    float weight in memory at a time (a lazy weight is read here, its quantized bytes kept), never
    the whole float model serialized. The same bytes as the quantizer run on the whole graph: it
    quantizes each MatMul on its own."""
    x, weight = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    x_in = ir.Value(name=x.name, type=x.type, shape=x.shape)
    w_init = ir.Value(name=weight.name, type=weight.type, shape=weight.shape, const_value=weight.const_value)
    single = ir.Node("", "MatMul", [x_in, w_init], name=node.name, num_outputs=1)
    y_out = single.outputs[0]
    y_out.name, y_out.type, y_out.shape = y.name, y.type, y.shape
    graph = ir.Graph([x_in], [y_out], nodes=[single], initializers=[w_init], opset_imports=model.opset_imports)
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=model.ir_version))
    del graph, single, w_init
    quantizer = quantizer_class(proto, **settings)
    quantizer.process()
    quantized = ir.serde.deserialize_model(quantizer.model.model)
    del proto, quantizer
    [new] = list(quantized.graph)
    if new.op_type == "MatMul":
        return  # the quantizer left it (a shape it does not quantize)
    inputs = []
    for value in new.inputs:
        if value is None:
            inputs.append(None)
        elif value.name == x.name:
            inputs.append(x)
        else:
            # a copy of its own: the deserialized tensor would keep the quantizer's whole proto alive
            data = ir.Tensor(np.array(value.const_value.numpy()), dtype=value.const_value.dtype, name=value.name)
            own = ir.Value(name=value.name, type=value.type, shape=value.shape, const_value=data)
            model.graph.register_initializer(own)
            inputs.append(own)
    for domain, version in quantized.opset_imports.items():
        model.opset_imports.setdefault(domain, version)
    attributes = [ir.Attr(a.name, a.type, a.value) for a in new.attributes.values()]
    replacement = ir.Node(new.domain, new.op_type, inputs, attributes, name=new.name, num_outputs=1)
    replacement.outputs[0].name, replacement.outputs[0].type = y.name + "_q", y.type
    replacement.outputs[0].shape = y.shape
    model.graph.insert_before(node, replacement)
    y.replace_all_uses_with(replacement.outputs[0], replace_graph_outputs=True)
    model.graph.remove(node, safe=True)
    replacement.outputs[0].name = y.name
    if not weight.uses() and not weight.is_graph_output():
        model.graph.initializers.pop(weight.name, None)


def _import_quantizer():
    """ORT's quantizer module calls ``logging.basicConfig(level=INFO)`` on import, which would make
    every library log at INFO in the user's process; undo exactly that."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for handler in root.handlers[len(handlers) :]:
        root.removeHandler(handler)
    root.setLevel(level)
    return MatMulNBitsQuantizer


def _lm_head_as_matmul(model: ir.Model) -> None:
    """Rewrite ``Gemm(x, W, transB=1)`` with a constant ``W [V, H]`` (how kvforge exports the
    lm_head, to avoid a transposed copy) into ``MatMul(x, W^T)``, which ORT's quantizer turns into
    ``MatMulNBits``. The fp32 ``W`` stays only where another node (a tied embedding) reads it."""
    import numpy as np

    for node in list(model.graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        weight = node.inputs[1]
        if attrs.get("transB", 0) != 1 or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            continue
        if weight is None or weight.const_value is None:
            continue
        source, name = weight.const_value, f"{weight.name}.T"
        lazy = ir.LazyTensor(
            lambda source=source, name=name: ir.Tensor(np.ascontiguousarray(source.numpy().T), name=name),
            dtype=source.dtype,
            shape=ir.Shape([source.shape[1], source.shape[0]]),
            name=name,
        )
        transposed = ir.Value(name=name, shape=lazy.shape, type=weight.type, const_value=lazy)
        model.graph.register_initializer(transposed)
        matmul = ir.node("MatMul", inputs=[node.inputs[0], transposed], name=f"{node.name}/as_matmul")
        model.graph.insert_before(node, matmul)
        node.outputs[0].replace_all_uses_with(matmul.outputs[0], replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
