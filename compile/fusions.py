"""Rules that remove the glue around attention in the ORT graphs (run by :mod:`kvforge.compile.optimize`).

Input: an ``onnx_ir.Model`` after onnxscript's ORT fusions and the rotate-half rule
(:func:`kvforge.compile.optimize.fuse_rotary`). Output: the same model, edited in place, that
computes the same values with fewer nodes. transformers computes attention in ``[B, H, S, D]``
(``q_proj(x).view(B, S, H, D).transpose(1, 2)``, RoPE, attention, ``transpose(1, 2).reshape``);
``GroupQueryAttention`` reads and writes ``[B, S, H * D]``, so the exported graph of every layer
carries reshape/transpose pairs that only undo each other, and computes the attention lengths
from the shape of its own query. Three passes, each exact:

1. :func:`share_length_shapes` (lengths once per graph): a ``Shape`` that reads a symbolic
   dimension of an activation (the query's ``seq``) reads it from the graph input that carries
   the same dimension instead (``input_ids``); common-subexpression elimination then merges the
   now identical per-layer ``seqlens_k`` / ``total_sequence_length`` computations into one. Two
   dims with the same symbolic name are equal: the exporter names them from one symbol of
   torch's shape environment.
2. :class:`Rotary3D`: ``Reshape(Transpose(RotaryEmbedding(Transpose(Reshape(y)))))`` — the
   ``[B, S, H * D]`` projection viewed as heads, rotated, and flattened back — becomes the 3-D
   form of ``RotaryEmbedding`` (``num_heads`` attribute) on ``y`` itself: the same rotation of
   each head with the model's own cos/sin. Only a full, non-interleaved rotary whose input and
   output are ``[B, S, H * D]`` matches; a partial rotary (a ``Concat`` after the rotation) or a
   norm between the view and the transpose (Qwen3's q/k norms) does not, and stays as it was.
3. :func:`remove_noop_reshapes`: a ``Reshape`` (or chain of them) whose output has exactly the
   shape of its source (``v``'s ``[B, S, H * D]`` -> ``[B, S, H, D]`` -> ``[B, S, H * D]``, and the
   attention output's way back to ``o_proj``) is replaced by that source.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass
from onnxscript.rewriter import pattern

_SWAP_HEADS = [0, 2, 1, 3]  # [B, S, H, D] <-> [B, H, S, D]


def fuse_attention_glue(model: ir.Model) -> dict[str, int]:
    """Apply the three passes to ``model`` in place; returns how often each fired."""
    counts = {"length_shapes": share_length_shapes(model.graph)}
    CommonSubexpressionEliminationPass()(model)
    counts["rotary_3d"] = Rotary3D.rule().apply_to_model(model)
    _name_rotaries(model.graph)
    counts["noop_reshapes"] = remove_noop_reshapes(model.graph)
    RemoveUnusedNodesPass()(model)
    return counts


def share_length_shapes(graph: ir.Graph) -> int:
    """Point every ``Shape`` of one symbolic dimension at the graph input that has that dimension;
    returns how many were redirected."""
    sources: dict[str, tuple[ir.Value, int]] = {}
    for value in graph.inputs:
        for axis, dim in enumerate(value.shape or ()):
            if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                sources.setdefault(dim.value, (value, axis))
    redirected = 0
    for node in graph:
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            continue
        x = node.inputs[0]
        if x is None or x.shape is None or x in graph.inputs:
            continue
        rank = len(x.shape)
        start = _normalized(node.attributes.get_int("start", 0), rank)
        end = _normalized(node.attributes.get_int("end", rank), rank)
        if end - start != 1:
            continue
        dim = x.shape[start]
        if not isinstance(dim, ir.SymbolicDim) or dim.value not in sources:
            continue
        source, axis = sources[dim.value]
        node.replace_input_with(0, source)
        node.attributes["start"] = ir.AttrInt64("start", axis)
        node.attributes["end"] = ir.AttrInt64("end", axis + 1)
        redirected += 1
    return redirected


class Rotary3D(pattern.RewriteRuleClassBase):
    """``Reshape(Transpose(RotaryEmbedding(Transpose(Reshape(y, [B, S, H, D])), cos, sin)), [B, S, H*D])``
    -> ``RotaryEmbedding(y, cos, sin, num_heads=H)`` for ``y`` ``[B, S, H * D]``."""

    def pattern(self, op, y, view_shape, cos, sin, flat_shape):
        heads = op.Transpose(op.Reshape(y, view_shape, _outputs=["view"]), perm=_SWAP_HEADS)
        rotated = op.RotaryEmbedding(heads, cos, sin, _outputs=["rotated"])
        return op.Reshape(op.Transpose(rotated, perm=_SWAP_HEADS), flat_shape, _outputs=["flat"])

    def check(self, context, y, view, rotated, flat, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if y.shape is None or len(y.shape) != 3 or not isinstance(y.shape[2], int):
            return result.fail("y is not [B, S, H * D] with a static last dim", y)
        if view.shape is None or len(view.shape) != 4 or not all(isinstance(d, int) for d in view.shape[2:]):
            return result.fail("the view is not [B, S, H, D] with static H and D", view)
        heads, head_dim = view.shape[2], view.shape[3]
        if heads * head_dim != y.shape[2] or not _same_dims(view.shape[:2], y.shape[:2]):
            return result.fail("the view does not split y's last dim into heads", view)
        if flat.shape is None or not _same_dims(flat.shape, y.shape):
            return result.fail("the flattened result is not y's shape", flat)
        attrs = rotated.producer().attributes
        if attrs.get_int("interleaved", 0) or attrs.get_int("rotary_embedding_dim", 0) or "num_heads" in attrs:
            return result.fail("not a full, non-interleaved 4-D rotary", rotated)
        return result

    def rewrite(self, op, y, cos, sin, view, **_):
        return op.RotaryEmbedding(y, cos, sin, interleaved=0, num_heads=view.shape[2])


def _name_rotaries(graph: ir.Graph) -> None:
    """Name each 3-D rotary after the attention it feeds (``/model/layers.0/self_attn/rotary_q``),
    so the rewritten graph stays traceable to transformers' modules."""
    for node in graph:
        if node.op_type != "GroupQueryAttention" or not node.name or "/" not in node.name:
            continue
        scope = node.name.rsplit("/", 1)[0]
        for index, tag in ((0, "q"), (1, "k")):
            value = node.inputs[index] if len(node.inputs) > index else None
            rotary = value.producer() if value is not None else None
            if rotary is not None and rotary.op_type == "RotaryEmbedding" and "num_heads" in rotary.attributes:
                rotary.name = f"{scope}/rotary_{tag}"


def remove_noop_reshapes(graph: ir.Graph) -> int:
    """Bypass every ``Reshape`` (or chain of ``Reshape``\\ s) whose output shape equals its source's,
    symbolic dims included; returns how many were bypassed."""
    _infer_attention_output_shapes(graph)
    outputs = set(graph.outputs)
    bypassed = 0
    for node in graph:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or node.outputs[0] in outputs:
            continue
        target = node.outputs[0].shape
        if target is None:
            continue
        source = node.inputs[0]
        while source is not None:
            if source.shape is not None and _same_dims(source.shape, target):
                node.outputs[0].replace_all_uses_with(source)
                bypassed += 1
                break
            producer = source.producer()
            is_reshape = producer is not None and producer.op_type == "Reshape" and producer.domain in ("", "ai.onnx")
            source = producer.inputs[0] if is_reshape else None
    return bypassed


def _infer_attention_output_shapes(graph: ir.Graph) -> None:
    """``GroupQueryAttention`` with a separate key input returns ``[B, S, H * D]``, its query's
    shape; onnx has no shape inference for ORT's contrib ops, so fill it in."""
    for node in graph:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        query, key, output = node.inputs[0], node.inputs[1], node.outputs[0]
        if output.shape is None and key is not None and query is not None and query.shape is not None:
            output.shape = query.shape
            output.type = output.type or query.type  # a shape without a type is not serialized


def _same_dims(a, b) -> bool:
    """True when two shapes are provably equal: same rank, each dim the same int or the same
    named symbolic dim."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif not (
            isinstance(x, ir.SymbolicDim)
            and isinstance(y, ir.SymbolicDim)
            and x.value is not None
            and x.value == y.value
        ):
            return False
    return True


def _normalized(axis: int, rank: int) -> int:
    return max(0, min(rank, axis + rank if axis < 0 else axis))
