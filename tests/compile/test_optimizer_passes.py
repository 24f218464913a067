"""kvforge.compile.optimizer_passes: onnxscript's ORT fusions with the optimizer run that ends them
skipping its idle second iteration make the same graph, byte for byte, as onnxscript's own (on the
llama fixture's prefill graph, with compile's other optimizer levers on in both runs)."""

from __future__ import annotations

import onnx_ir as ir

from kvforge.compile.export import without_unmatched_rules
from kvforge.compile.optimize import without_repeated_optimizer
from kvforge.compile.optimizer_passes import without_idle_iteration


def _fused(path, skip_idle: bool) -> bytes:
    from onnxscript.rewriter import ort_fusions

    model = ir.load(path)
    with without_unmatched_rules(), without_repeated_optimizer():
        if skip_idle:
            with without_idle_iteration():
                model, _ = ort_fusions.optimize_for_ort(model)
        else:
            model, _ = ort_fusions.optimize_for_ort(model)
    return ir.to_proto(model).SerializeToString()


def test_same_graph_as_onnxscripts_optimizer(llama_artifact):
    from onnxscript.rewriter.ort_fusions import _core

    original = _core.optimize
    reference = _fused(llama_artifact / "prefill.onnx", skip_idle=False)
    ours = _fused(llama_artifact / "prefill.onnx", skip_idle=True)
    assert _core.optimize is original  # restored after the block
    assert ours == reference
    assert b"SkipSimplifiedLayerNormalization" in ours  # the fusions did run
