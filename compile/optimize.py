"""Stage: portable graphs -> ONNX Runtime-optimized graphs (``<name>.ort.onnx``), saved offline.

Input: ``<name>.onnx`` in the artifact directory (reading ``weights.data``). Output:
``<name>.ort.onnx`` beside it, whose tensors go into the same ``weights.data`` (only tensors the
passes created are added; the weights themselves are shared with the portable graph).

Two passes, both from the ONNX Runtime ecosystem rather than hand-written:

1. onnxscript's ORT fusions (``onnxscript.rewriter.ort_fusions``): RMSNorm ->
   ``SimplifiedLayerNormalization``, residual add + RMSNorm -> ``SkipSimplifiedLayerNormalization``,
   rotary embeddings -> ``RotaryEmbedding`` where the pattern matches.
2. ONNX Runtime's own graph optimizer at ``ORT_ENABLE_EXTENDED`` (constant folding, SiLU ->
   ``QuickGelu``, MatMul + Add/Scale folding, ...), serialized with ``optimized_model_filepath``.
   EXTENDED, not ALL: ALL adds hardware-specific layout transforms that must not be saved.

Then one edit of our own (:func:`read_gemm_weights_in_place`): a tensor that a ``Gather`` reads
as well as a MatMul or Gemm (the embedding table of a model with a tied lm_head) reaches the
MatMul through an ``Identity``. ORT repacks the constant B input of a MatMul/Gemm at load, and a
table the ``Gather`` still needs would then be held twice (SmolLM-135M: 113 MiB of 513); behind the
``Identity`` the lm_head reads the table in place. The runtime loads these graphs with ORT's
optimizer off, so the ``Identity`` stays. Measured on the SmolLM-135M shape: the same decode speed.

The portable graphs stay as exported (standard ONNX with the ``onnx`` lowering: what TensorRT
builds from). The runtime's ORT backend loads the ``.ort.onnx`` graphs without re-optimizing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx_ir as ir

from kvforge.compile.weights import SharedWeights

ORT_SUFFIX = ".ort"
OPTIMIZED_FOR = "CPUExecutionProvider"


def optimize_graphs(out_dir: Path, names: list[str], weights: SharedWeights) -> dict[str, str]:
    """Write ``<name>.ort.onnx`` for each graph; returns {graph name: optimized file name}."""
    import onnxruntime as ort
    from onnxscript.rewriter import ort_fusions

    work = out_dir / ".optimize"
    work.mkdir()
    files = {}
    try:
        for name in names:
            model = ir.load(out_dir / f"{name}.onnx")
            model, _ = ort_fusions.optimize_for_ort(model)
            # Saved beside weights.data, so the untouched weights stay references into it.
            fused = out_dir / f".{name}.fused.onnx"
            ir.save(model, fused)
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            options.optimized_model_filepath = str(work / f"{name}.onnx")
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{name}.data")
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            ort.InferenceSession(str(fused), options, providers=[OPTIMIZED_FOR])
            fused.unlink()
            optimized = ir.load(work / f"{name}.onnx")
            read_gemm_weights_in_place(optimized.graph)
            weights.add({name + ORT_SUFFIX: optimized})  # re-homes its tensors into weights.data
            files[name] = f"{name}{ORT_SUFFIX}.onnx"
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for leftover in out_dir.glob(".*.fused.onnx"):
            leftover.unlink()
    return files


def read_gemm_weights_in_place(graph: ir.Graph) -> int:
    """Route each initializer that a ``Gather`` and a MatMul/Gemm both read to the MatMul/Gemm
    through an ``Identity``, so ORT does not repack a copy of it; returns how many were routed."""
    routed = 0
    for value in list(graph.initializers.values()):
        uses = list(value.uses())
        if not any(node.op_type == "Gather" and index == 0 for node, index in uses):
            continue
        gemms = [(node, index) for node, index in uses if node.op_type in ("MatMul", "Gemm") and index == 1]
        if not gemms:
            continue
        identity = ir.Node("", "Identity", [value], name=f"{value.name}/read_in_place")
        identity.outputs[0].name = f"{value.name}/in_place"
        graph.insert_before(next(iter(graph)), identity)  # its input is a constant: first is fine
        for node, index in gemms:
            node.replace_input_with(index, identity.outputs[0])
        routed += 1
    return routed
