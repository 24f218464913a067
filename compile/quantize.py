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

The quantizer is deterministic, so the same weight quantizes to the same bytes in every graph and
the shared weights file still stores it once. ``MatMulNBits`` is an ORT contrib op: quantized
artifacts run on ONNX Runtime, not TensorRT.
"""

from __future__ import annotations

import logging

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
    the lm_head included (``lm_head=False``: it stays a Gemm in the model's dtype)."""
    if scheme not in QUANTIZE_BITS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(QUANTIZE_BITS)}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block_size}")
    MatMulNBitsQuantizer = _import_quantizer()
    out = {}
    for name, model in models.items():
        if lm_head:
            _lm_head_as_matmul(model)
        quantizer = MatMulNBitsQuantizer(
            ir.serde.serialize_model(model),
            bits=QUANTIZE_BITS[scheme],
            block_size=block_size,
            is_symmetric=symmetric,
            accuracy_level=4,
            nodes_to_exclude=list(exclude or []),
        )
        quantizer.process()
        out[name] = ir.serde.deserialize_model(quantizer.model.model)
    return out


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
        transposed = ir.Value(
            name=f"{weight.name}.T",
            const_value=ir.Tensor(np.ascontiguousarray(weight.const_value.numpy().T), name=f"{weight.name}.T"),
        )
        model.graph.register_initializer(transposed)
        matmul = ir.node("MatMul", inputs=[node.inputs[0], transposed], name=f"{node.name}/as_matmul")
        model.graph.insert_before(node, matmul)
        node.outputs[0].replace_all_uses_with(matmul.outputs[0], replace_graph_outputs=True)
        model.graph.remove(node, safe=True)
