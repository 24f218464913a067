"""onnxscript's optimizer run after the ORT fusions, without its idle second iteration.

``onnxscript.rewriter.ort_fusions.fuse_xformers`` ends with ``onnxscript.optimizer.optimize``
(``optimize_ir``): function inlining, then up to two iterations of [constant folding, the default
rewrite rules, removal of unused nodes, functions and opset imports], stopping early when an
iteration changes nothing, then its clean-up passes. After the fusions the first iteration's only
change is usually the removal of the opset imports that the inlined fusion functions leave unused
(SmolLM-135M shape: folding and rewrite rules change nothing), and that change alone starts a
second iteration that cannot change anything either: no node reads a removed opset import (that is
why it was removed), so folding and the rewrite rules see the same nodes, with the same versions,
as in the first iteration, where they changed nothing. That idle iteration costs a full folding and
rewrite pass over every layer (SmolLM-135M: 0.4 s of the 0.9 s).

:func:`optimize_ir` is ``optimize_ir`` with its defaults (onnxscript 0.7), but runs the second
iteration only when the first changed something other than the opset imports.
:func:`without_idle_iteration` makes ``fuse_xformers`` call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx_ir as ir
import onnx_ir.passes.common as common_passes


def optimize_ir(model: ir.Model) -> ir.Model:
    """``onnxscript.optimizer.optimize_ir(model)`` (defaults: 2 iterations, early stop, inlining),
    skipping a second iteration that only the removal of unused opset imports started. In place;
    returns ``model``."""
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding

    def iteration() -> list[ir.passes.PassBase]:
        return [
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
                should_fold=lambda node: None,
            ),
            rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
        ]

    common_passes.InlinePass()(model)
    for _ in range(2):
        changed = [p(model).modified for p in iteration()]
        common_passes.RemoveUnusedOpsetsPass()(model)
        if not any(changed):
            break
    ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)
    return model


@contextlib.contextmanager
def without_idle_iteration() -> Iterator[None]:
    """Inside the block, ``ort_fusions.fuse_xformers`` ends with :func:`optimize_ir` instead of
    onnxscript's ``optimize``. onnxscript offers no parameter for it: the name its module calls is
    swapped for the block and restored after it."""
    from onnxscript.rewriter.ort_fusions import _core

    original = _core.optimize
    _core.optimize = optimize_ir
    try:
        yield
    finally:
        _core.optimize = original
