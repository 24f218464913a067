"""Stage: portable graphs -> ONNX Runtime-optimized graphs (``<name>.ort.onnx``), saved offline.

Input: ``<name>.onnx`` in the artifact directory (reading ``weights.data``). Output:
``<name>.ort.onnx`` beside it, whose tensors go into the same ``weights.data`` (only tensors the
passes created are added; the weights themselves are shared with the portable graph).

Three passes:

1. onnxscript's ORT fusions (``onnxscript.rewriter.ort_fusions``): RMSNorm ->
   ``SimplifiedLayerNormalization``, residual add + RMSNorm -> ``SkipSimplifiedLayerNormalization``.
   (Its rotary fusion needs the cos/sin computed by one exact pattern from ``position_ids``, which
   transformers' rotary modules do not export as.)
2. Our rotary rule (:class:`RotateHalfRotary`): transformers' ``x * cos + rotate_half(x) * sin``
   (two Slices, Neg, Concat, two Muls, Add, for q and for k in every layer) -> one standard ONNX
   ``RotaryEmbedding`` (opset 23) fed with the first half of the cos/sin the model itself computed.
   It holds for every rope variant (scaled, llama3, longrope, partial), since the angles are the
   model's own, and it is applied only where cos/sin provably repeat their two halves.
3. ONNX Runtime's own graph optimizer at ``ORT_ENABLE_EXTENDED`` (constant folding, SiLU ->
   ``QuickGelu``, MatMul + Add/Scale folding, ...), serialized with ``optimized_model_filepath``.
   EXTENDED, not ALL: ALL adds hardware-specific layout transforms that must not be saved.

Then one edit of our own for a tensor that a ``Gather`` reads as well as a MatMul or Gemm (the
embedding table of a model with a tied lm_head). ORT repacks the constant B input of a MatMul/Gemm
at load into its kernels' layout and releases the original once every reader has repacked it; the
``Gather`` still reads the table, so packing it where both read one initializer would hold it twice
(SmolLM-135M: 113 MiB of 513). Two choices:

* by default (``pack_tied_lm_head``, :func:`alias_tied_gemm_weights`) the Gemm reads initializers
  of its own that point at the table's rows in ``weights.data`` (:meth:`SharedWeights.row_view`:
  the same bytes, stored once): ORT packs those and unmaps them. The ``Gather`` still reads the
  table, which the runtime hands ORT as memory holding only the rows looked up
  (:mod:`kvforge.runtime.embedding_rows`; left to ORT's mapping of the file, the kernel maps the
  page cache's 2 MiB folios, so a few hundred lookups made most of the table resident beside the
  packed copy). The Gemm is split by rows into parts of at most ``TIED_GEMM_PART_BYTES`` (joined by
  a ``Concat``), because a part's original pages stay resident while ORT packs it: one part, not
  the whole table, adds to the peak of loading;
* with ``pack_tied_lm_head=False`` (:func:`read_gemm_weights_in_place`) the lm_head reads the table
  through an ``Identity``, unpacked: no packed copy, but the ``Gemm`` (``transB=1``) repacks the
  table inside every call (SmolLM-135M shape, batch 4: a step ×1.18 the packed one).

The portable graphs stay as exported (standard ONNX with the ``onnx`` lowering: what TensorRT
builds from). The runtime's ORT backend loads the ``.ort.onnx`` graphs without re-optimizing.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir
from onnxscript.rewriter import pattern

from kvforge.compile.export import without_unmatched_rules
from kvforge.compile.fusions import fuse_attention_glue, fuse_rotary_into_attention
from kvforge.compile.optimizer_passes import without_idle_iteration
from kvforge.compile.weights import SharedWeights

ORT_SUFFIX = ".ort"
OPTIMIZED_FOR = "CPUExecutionProvider"
TIED_GEMM_PART_BYTES = 32 * 2**20  # the most of a tied table that is resident twice while ORT packs it
PAGE = 4096  # a part starts on a page of weights.data, so ORT can map it


def optimize_graphs(
    out_dir: Path,
    names: list[str],
    weights: SharedWeights,
    times: dict[str, float] | None = None,
    max_positions: int | None = None,
    pack_tied_lm_head: bool = False,
) -> dict[str, str]:
    """Write ``<name>.ort.onnx`` for each graph; returns {graph name: optimized file name}. With
    ``times``, adds the seconds of each step to it (summed over the graphs).

    Compile runs it on the general graph alone and derives the contract's ``.ort.onnx`` graphs
    from the result (:mod:`kvforge.compile.derive`): one pass of each optimizer, not one per graph.
    The ORT session that optimizes reads ``weights.data`` memory-mapped and does not prepack.
    ``max_positions`` (the artifact's ``max_seq``) lets attention rotate q and k itself
    (:func:`kvforge.compile.fusions.fuse_rotary_into_attention`, cos/sin tables of that many
    positions); None leaves the rotaries as they are. ``pack_tied_lm_head``: a tied lm_head reads
    row views of the table that ORT packs (:func:`alias_tied_gemm_weights`) instead of the table in
    place (:func:`read_gemm_weights_in_place`)."""
    import onnxruntime as ort
    from onnxscript.rewriter import ort_fusions

    times = {} if times is None else times
    clock = [time.perf_counter()]

    def lap(step: str) -> None:
        now = time.perf_counter()
        times[step] = times.get(step, 0.0) + now - clock[0]
        clock[0] = now

    work = out_dir / ".optimize"
    work.mkdir()
    files = {}
    try:
        for name in names:
            model = ir.load(out_dir / f"{name}.onnx")
            with without_unmatched_rules(), without_repeated_optimizer(), without_idle_iteration():
                model, _ = ort_fusions.optimize_for_ort(model)
            cast_norm_scales(model.graph)  # float32 norm weights in a float16 model (GPT-OSS)
            fuse_rotary(model)
            fuse_attention_glue(model)  # compile/fusions.py: no reshape/transpose glue, lengths once
            if max_positions is not None:
                fuse_rotary_into_attention(model, max_positions)  # packed q/k/v into GQA, do_rotary
            # Saved beside weights.data, so the untouched weights stay references into it.
            fused = out_dir / f".{name}.fused.onnx"
            ir.save(model, fused)
            lap("onnxscript fusions")
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            options.optimized_model_filepath = str(work / f"{name}.onnx")
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{name}.data")
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            # Only the optimized graph is wanted, not a session to run: packing the MatMul weights
            # for this machine's kernels would copy most of the weights and take seconds.
            options.add_session_config_entry("session.disable_prepacking", "1")
            ort.InferenceSession(str(fused), options, providers=[OPTIMIZED_FOR])
            fused.unlink()
            lap("ORT offline optimizer")
            optimized = ir.load(work / f"{name}.onnx")
            weights.externalize(optimized)  # re-homes its tensors into weights.data
            if pack_tied_lm_head:
                alias_tied_gemm_weights(optimized.graph, weights)
            read_gemm_weights_in_place(optimized.graph)  # tied tables left: read in place, unpacked
            weights.save(optimized, name + ORT_SUFFIX)
            files[name] = f"{name}{ORT_SUFFIX}.onnx"
            lap("weights re-homed")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for leftover in out_dir.glob(".*.fused.onnx"):
            leftover.unlink()
    return files


@contextlib.contextmanager
def without_repeated_optimizer() -> Iterator[None]:
    """Inside the block, ``ort_fusions.optimize_for_ort`` starts with onnx shape inference and its
    shape rules, without the two runs of onnxscript's optimizer (``optimize_ir``) that its
    ``_pre_optimize`` adds: compile's general graph has just come out of that same optimizer
    (:func:`kvforge.compile.export.optimize_exported`; packing and the weights file add nothing it
    folds), and each run costs a full pass over the graph (SmolLM-135M: 2 x 0.8 s, no node changed).
    The fusions and the optimizer run that follows them are onnxscript's own. onnxscript offers no
    parameter for it: its module function is swapped for the block and restored after it."""
    import onnx_ir.passes.common as common_passes
    from onnxscript.rewriter.ort_fusions import _core, shape_optimization

    def shape_passes_only(model: ir.Model) -> ir.Model:
        common_passes.ShapeInferencePass()(model)
        shape_optimization.rules.apply_to_model(model)
        return model

    original = _core._pre_optimize
    _core._pre_optimize = shape_passes_only
    try:
        yield
    finally:
        _core._pre_optimize = original


def alias_tied_gemm_weights(graph: ir.Graph, weights: SharedWeights, part_bytes: int = TIED_GEMM_PART_BYTES) -> int:
    """Give each ``Gemm(x, T, transB=1)`` whose ``T`` [V, H] a ``Gather`` also reads initializers of
    its own: row views of ``T`` in ``weights.data`` of at most ``part_bytes`` each (whole pages where
    the row size allows), one ``Gemm`` per part, joined along the last axis by a ``Concat`` that
    takes the old Gemm's output (one part: the Gemm just reads its view). Values are unchanged: each
    output column is the same dot product. ``graph``'s initializers must already be in ``weights``
    (:meth:`SharedWeights.externalize`). Returns how many Gemms were given views."""
    aliased = 0
    for value in list(graph.initializers.values()):
        uses = list(value.uses())
        tensor = value.const_value
        if not any(node.op_type == "Gather" and index == 0 for node, index in uses):
            continue
        if not isinstance(tensor, ir.ExternalTensor) or tensor.shape is None or len(tensor.shape) != 2:
            continue
        for node, index in uses:
            if index == 1 and _is_plain_transposed_gemm(node):
                _alias_gemm(graph, node, value, weights, part_bytes)
                aliased += 1
    return aliased


def _is_plain_transposed_gemm(node: ir.Node) -> bool:
    """``Gemm(A, B)`` = ``A @ B.T``: no C, no transA, unit alpha."""
    attrs = node.attributes
    return (
        node.op_type == "Gemm"
        and node.domain in ("", "ai.onnx")
        and len([v for v in node.inputs if v is not None]) == 2
        and attrs.get_int("transB", 0) == 1
        and attrs.get_int("transA", 0) == 0
        and attrs.get_float("alpha", 1.0) == 1.0
    )


def _row_parts(rows: int, row_bytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """Split ``rows`` into even ranges of about ``part_bytes`` (at least one row each), each a whole
    number of ``PAGE``-aligned units of rows, so every part starts on a page of the file."""
    step = PAGE // math.gcd(row_bytes, PAGE)  # rows per page-aligned unit
    per_part = max(step, part_bytes // row_bytes // step * step)
    count = math.ceil(rows / per_part)
    size = math.ceil(math.ceil(rows / count) / step) * step
    return [(start, min(start + size, rows)) for start in range(0, rows, size)]


def _alias_gemm(graph: ir.Graph, gemm: ir.Node, table: ir.Value, weights: SharedWeights, part_bytes: int) -> None:
    tensor = table.const_value
    rows, cols = tensor.shape
    parts = _row_parts(rows, cols * int(tensor.dtype.itemsize), part_bytes)
    x, out = gemm.inputs[0], gemm.outputs[0]
    views = []
    for start, stop in parts:
        name = f"{table.name}/rows_{start}_{stop}"
        view = ir.Value(name=name, const_value=weights.row_view(tensor, start, stop, name))
        view.shape, view.type = ir.Shape([stop - start, cols]), ir.TensorType(tensor.dtype)
        graph.register_initializer(view)
        views.append(view)
    if len(views) == 1:
        gemm.replace_input_with(1, views[0])
        return
    nodes = []
    for (start, stop), view in zip(parts, views):
        part = ir.Node(
            "", "Gemm", [x, view], attributes=list(gemm.attributes.values()), name=f"{gemm.name}/rows_{start}_{stop}"
        )
        part.outputs[0].name = f"{out.name}/rows_{start}_{stop}"
        part.outputs[0].type = out.type
        if out.shape is not None:
            part.outputs[0].shape = ir.Shape([*out.shape[:-1], stop - start])
        nodes.append(part)
    concat = ir.Node(
        "", "Concat", [p.outputs[0] for p in nodes], attributes=[ir.AttrInt64("axis", -1)], name=f"{gemm.name}/concat"
    )
    graph.insert_before(gemm, [*nodes, concat])
    joined = concat.outputs[0]
    joined.shape, joined.type = out.shape, out.type
    out.replace_all_uses_with(joined, replace_graph_outputs=True)
    graph.remove(gemm, safe=True)
    joined.name = out.name


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


class RotateHalfRotary(pattern.RewriteRuleClassBase):
    """``x * cos + concat(-x[..., h:], x[..., :h]) * sin`` -> ``RotaryEmbedding(x, cos[..., :h],
    sin[..., :h])``, for ``x`` ``[B, H, S, D]`` with ``h = D / 2`` and ``cos``/``sin`` the
    ``[B, 1, S, D]`` unsqueeze of a ``[B, S, D]`` tensor whose halves are equal by construction."""

    def pattern(self, op, x, cos, sin, start1, end1, start2, end2, axes, steps):
        x1 = op.Slice(x, start1, end1, axes, steps)
        x2 = op.Slice(x, start2, end2, axes, steps)
        rotated = op.Concat(op.Neg(x2), x1, axis=-1)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, start1, end1, start2, end2, axes, steps, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int) or x.shape[3] % 2:
            return result.fail("x is not [B, H, S, D] with a static, even D", x)
        half = x.shape[3] // 2
        ints = {name: _ints(v) for name, v in dict(s1=start1, e1=end1, s2=start2, e2=end2, ax=axes, st=steps).items()}
        if ints["ax"] not in ([3], [-1]) or ints["st"] != [1] or ints["s1"] != [0] or ints["e1"] != [half]:
            return result.fail("the first slice is not x[..., :D/2]")
        if ints["s2"] != [half] or ints["e2"] is None or ints["e2"][0] < 2 * half:
            return result.fail("the second slice is not x[..., D/2:]")
        for angle in (cos, sin):  # a leaf of the pattern: the q and k rotaries of a layer share it
            inner = _unsqueezed_3d(angle)
            if inner is None or not _halves_repeat(inner):
                return result.fail("cos/sin are not an unsqueezed [B, S, D] with repeated halves", angle)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        starts, ends, last = (op.Constant(value_ints=[v]) for v in (0, x.shape[3] // 2, -1))
        cos_half, sin_half = (op.Slice(_unsqueezed_3d(angle), starts, ends, last) for angle in (cos, sin))
        return op.RotaryEmbedding(x, cos_half, sin_half, interleaved=0)


_NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def cast_norm_scales(graph: ir.Graph) -> int:
    """Cast the scale of every fused RMS norm whose input has another dtype to the input's dtype;
    returns how many. A family that keeps its norm weights in float32 in a float16 model (GPT-OSS's
    ``_keep_in_fp32_modules``: ``(weight * x.float()).to(float16)``) is fused by onnxscript into a
    norm whose input is float16 and whose scale is float32, which ONNX Runtime refuses to load (one
    type for input, skip and scale). With the scale cast, the norm computes in float32 inside and
    returns the float16 the graph had after its cast (the weights rounded to float16: what
    transformers' parity check then measures)."""
    cast = 0
    for node in list(graph):
        if node.op_type not in _NORMS or len(node.inputs) < 2:
            continue
        x = node.inputs[0]
        scale_index = 2 if node.op_type.startswith("Skip") else 1
        scale = node.inputs[scale_index] if len(node.inputs) > scale_index else None
        if x is None or scale is None or x.dtype is None or scale.dtype in (None, x.dtype):
            continue
        to = ir.node("Cast", [scale], attributes={"to": x.dtype}, name=f"{node.name}/scale_cast")
        to.outputs[0].dtype, to.outputs[0].shape = x.dtype, scale.shape
        graph.insert_before(node, to)
        node.replace_input_with(scale_index, to.outputs[0])
        node.outputs[0].dtype = x.dtype
        cast += 1
    return cast


def fuse_rotary(model: ir.Model) -> int:
    """Apply :class:`RotateHalfRotary` everywhere it matches; returns the number of rewrites."""
    return RotateHalfRotary.rule().apply_to_model(model)


def _ints(value: ir.Value) -> list[int] | None:
    const = value.const_value if value is not None else None
    return None if const is None else [int(v) for v in const.numpy().reshape(-1)]


def _unsqueezed_3d(value: ir.Value) -> ir.Value | None:
    """``v`` when ``value`` is ``Unsqueeze(v, [1])`` of a 3-D ``v`` (transformers' ``cos.unsqueeze(1)``)."""
    node = value.producer()
    if node is None or node.op_type != "Unsqueeze" or _ints(node.inputs[1]) != [1]:
        return None
    inner = node.inputs[0]
    return inner if inner.shape is not None and len(inner.shape) == 3 else None


def _halves_repeat(value: ir.Value) -> bool:
    """True when ``value`` is ``f(concat(a, a))`` for elementwise ``f`` (Cos/Sin, a scale, casts):
    its last axis is two equal halves, as transformers' ``emb = cat((freqs, freqs), -1)`` makes it."""
    node = value.producer()
    while node is not None and node.op_type in ("Cos", "Sin", "Cast", "Mul"):
        if node.op_type == "Mul":  # cos * attention_scaling: one side must be a scalar constant
            scalar = [v for v in node.inputs if v.const_value is not None and v.const_value.numpy().size == 1]
            if not scalar:
                return False
            node = next(v for v in node.inputs if v is not scalar[0]).producer()
            continue
        node = node.inputs[0].producer()
    return (
        node is not None
        and node.op_type == "Concat"
        and len(node.inputs) == 2
        and node.inputs[0] is node.inputs[1]
        and node.attributes["axis"].as_int() in (-1, 2)
    )
