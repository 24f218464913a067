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
   output are ``[B, S, H * D]`` matches; a partial rotary (a ``Concat`` after the rotation) does
   not, and stays as it was. Where a per-head norm sits between the view and the transpose
   (Qwen3's, LFM2's, OLMo2's q/k norms), :class:`NormedRotary3D` takes the rest: the normed heads
   ``[B, S, H, D]`` flattened and rotated in 3-D, the two transposes gone.
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
    """Apply the passes to ``model`` in place; returns how often each fired."""
    counts = {"length_shapes": share_length_shapes(model.graph)}
    CommonSubexpressionEliminationPass()(model)
    counts["rotary_3d"] = Rotary3D.rule().apply_to_model(model)
    counts["normed_rotary_3d"] = NormedRotary3D.rule().apply_to_model(model)
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
        reason = _not_a_plain_4d_rotary(rotated)
        return result.fail(reason, rotated) if reason else result

    def rewrite(self, op, y, cos, sin, view, **_):
        return op.RotaryEmbedding(y, cos, sin, interleaved=0, num_heads=view.shape[2])


class NormedRotary3D(pattern.RewriteRuleClassBase):
    """``Reshape(Transpose(RotaryEmbedding(Transpose(x), cos, sin)), [B, S, H*D])`` for ``x``
    ``[B, S, H, D]`` (the heads after a per-head norm) -> ``RotaryEmbedding(Reshape(x, [B, S, H*D]),
    cos, sin, num_heads=H)``: each head rotated by the same cos/sin, in the layout the attention
    reads, without the two transposes (4 per layer: a decode step's q and k, at any length)."""

    def pattern(self, op, x, cos, sin, flat_shape):
        heads = op.Transpose(x, perm=_SWAP_HEADS, _outputs=["heads"])
        rotated = op.RotaryEmbedding(heads, cos, sin, _outputs=["rotated"])
        return op.Reshape(op.Transpose(rotated, perm=_SWAP_HEADS), flat_shape, _outputs=["flat"])

    def check(self, context, x, heads, rotated, flat, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        shape = heads.shape  # [B, H, S, D]
        if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
            return result.fail("the heads are not [B, H, S, D] with static H and D", heads)
        if flat.shape is None or len(flat.shape) != 3 or flat.shape[2] != shape[1] * shape[3]:
            return result.fail("the flattened result is not [B, S, H * D]", flat)
        if not _same_dims([flat.shape[0], flat.shape[1]], [shape[0], shape[2]]):
            return result.fail("the flattened result's batch and length are not the heads'", flat)
        reason = _not_a_plain_4d_rotary(rotated)
        return result.fail(reason, rotated) if reason else result

    def rewrite(self, op, x, cos, sin, flat_shape, heads, **_):
        return op.RotaryEmbedding(op.Reshape(x, flat_shape), cos, sin, interleaved=0, num_heads=heads.shape[1])


def _not_a_plain_4d_rotary(rotated: ir.Value) -> str | None:
    """Why the rotary making ``rotated`` cannot be rewritten to the 3-D form with the same cos/sin
    (None: it can): both rules' condition."""
    node = rotated.producer()
    attrs = node.attributes
    if attrs.get_int("interleaved", 0) or attrs.get_int("rotary_embedding_dim", 0) or "num_heads" in attrs:
        return "not a full, non-interleaved 4-D rotary"
    if len([v for v in node.inputs if v is not None]) != 3:
        return "a rotary with position_ids of its own"
    return None


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


def fuse_rotary_into_attention(model: ir.Model, max_positions: int) -> int:
    """``GroupQueryAttention(RotaryEmbedding(q), RotaryEmbedding(k), v)`` where ``q``, ``k``, ``v``
    are the three outputs of one ``Split`` of a packed projection ``x`` (``compile/packing.py``)
    becomes ``GroupQueryAttention(x, do_rotary=1)`` with cos/sin caches ``[max_positions, D / 2]``
    and the graph's ``position_ids``: the attention rotates q and k itself, and the Split and the
    two rotaries per layer go. Returns how many attentions were rewritten.

    Exact where it fires: the caches are the graph's own cos/sin computation (whatever rope variant
    the model has) evaluated by ONNX Runtime at positions ``0 .. max_positions - 1``, so every
    entry is the value the graph computed at that position; it fires only when that computation
    reads ``position_ids`` alone and gives each position the same values wherever it sits and
    whatever else the call holds (checked on the positions shuffled across two rows, the first
    and the last alone, the first three: a rope that depends on the call's longest position, as
    longrope and dynamic NTK do, fails it and keeps its rotaries), for a
    full (``rotary_embedding_dim`` 0), non-interleaved rotary of q and k with the same cos/sin.
    GroupQueryAttention is not given ``position_ids``: it rotates each token at the position it
    derives from its lengths inputs (``seqlens_k[b] + 1 - S + s``, or ``s`` for a first prompt),
    which is ``write_indices[b] + s`` (graphs/lowering.py), the position the runtime feeds
    (``position_ids = write_indices + arange(S)``, the graph contract); read from an input instead,
    the positions made an int4 decode step ~5% slower (benchmarks/FINDINGS.md, "Levers against each other").
    """
    graph = model.graph
    position_ids = next((v for v in graph.inputs if v.name == "position_ids"), None)
    if position_ids is None:
        return 0
    tables: dict[tuple[int, int], tuple[ir.Value, ir.Value] | None] = {}  # one pair per cos/sin computation
    fused = 0
    for node in list(graph):
        match = _rotary_attention_match(node)
        if match is None:
            continue
        packed, cos, sin = match
        key = (id(cos), id(sin))
        if key not in tables:
            suffix = f"_{len(tables)}" if tables else ""
            dtype = packed.dtype or node.outputs[0].dtype
            tables[key] = _position_tables(model, cos, sin, position_ids, max_positions, dtype, suffix)
        if tables[key] is None:
            continue
        cos_cache, sin_cache = tables[key]
        _replace_attention(graph, node, packed, cos_cache, sin_cache)
        fused += 1
    if fused:
        RemoveUnusedNodesPass()(model)
    return fused


def _rotary_attention_match(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    """(packed projection, cos, sin) when ``node`` is a GroupQueryAttention fed by the rotaries of
    one Split's q and k and by its v, and nothing else reads the Split's outputs; else None."""
    if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
        return None
    # inputs past total_sequence_length: only a head_sink (input 11, attention sinks) is carried over
    if node.attributes.get_int("do_rotary", 0) or any(x is not None for x in node.inputs[7:11]):
        return None
    q, k, v = node.inputs[:3]
    if q is None or k is None or v is None:
        return None
    rotaries = [q.producer(), k.producer()]
    if any(r is None or r.op_type != "RotaryEmbedding" or r.domain not in ("", "ai.onnx") for r in rotaries):
        return None
    rq, rk = rotaries
    for r in rotaries:
        attrs = r.attributes
        if attrs.get_int("interleaved", 0) or attrs.get_int("rotary_embedding_dim", 0) or "num_heads" not in attrs:
            return None
        if len([x for x in r.inputs if x is not None]) != 3:  # a position_ids input of its own: not ours
            return None
    if rq.inputs[1] is not rk.inputs[1] or rq.inputs[2] is not rk.inputs[2]:
        return None
    split = rq.inputs[0].producer()
    if split is None or split.op_type != "Split" or len(split.outputs) != 3:
        return None
    if list(split.outputs) != [rq.inputs[0], rk.inputs[0], v]:
        return None
    if [len(list(out.uses())) for out in split.outputs] != [1, 1, 1] or len(list(q.uses())) != 1:
        return None
    if len(list(k.uses())) != 1:
        return None
    # rotary_embedding_dim 0: the rotation spans each whole head (cos is half a head wide)
    return split.inputs[0], rq.inputs[1], rq.inputs[2]


def _position_tables(
    model: ir.Model,
    cos: ir.Value,
    sin: ir.Value,
    position_ids: ir.Value,
    max_positions: int,
    dtype: ir.DataType | None,
    suffix: str = "",
) -> tuple[ir.Value, ir.Value] | None:
    """The graph's ``cos``/``sin`` (``[B, S, D / 2]``, computed from ``position_ids``) at positions
    ``0 .. max_positions - 1`` as initializers ``[max_positions, D / 2]``; None when they read any
    other input or are not a function of each position alone. ``dtype``: the attention's (and
    so the tables') element type."""
    import numpy as np
    import onnxruntime as ort
    from onnx import helper

    nodes = _producers([cos, sin])
    if nodes is None or dtype is None:
        return None
    graph_inputs = {v for n in nodes for v in n.inputs if v is not None and v.producer() is None}
    if any(v is not position_ids and v.const_value is None for v in graph_inputs):
        return None
    proto_nodes = [ir.serde.serialize_node(n) for n in model.graph if n in nodes]  # graph order
    inits = [ir.serde.serialize_tensor(v.const_value) for v in graph_inputs if v is not position_ids]
    for init, value in zip(inits, [v for v in graph_inputs if v is not position_ids]):
        init.name = value.name
    outputs = [helper.make_tensor_value_info(v.name, int(dtype), None) for v in (cos, sin)]
    ids = helper.make_tensor_value_info(position_ids.name, 7, ["batch", "seq"])
    opsets = [helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    proto = helper.make_model(helper.make_graph(proto_nodes, "positions", [ids], outputs, inits), opset_imports=opsets)
    proto.ir_version = model.ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        tables = session.run(None, {position_ids.name: np.arange(max_positions, dtype=np.int64)[None]})
        # The same positions elsewhere in a batch, and a few alone: a rope that depends on the
        # longest position of the call (longrope, dynamic NTK) gives other values there.
        order = np.random.default_rng(0).permutation(max_positions)
        probes = [
            order.reshape(2 if max_positions % 2 == 0 else 1, -1),
            np.array([[0]]),
            np.array([[max_positions - 1]]),
        ]
        probes.append(np.arange(min(3, max_positions))[None])
        probed = [(probe, session.run(None, {position_ids.name: probe.astype(np.int64)})) for probe in probes]
    except Exception:  # a computation ORT cannot run alone: keep the rotaries
        return None
    if any(t.ndim != 3 or t.shape[:2] != (1, max_positions) for t in tables):
        return None
    for probe, results in probed:
        for table, got in zip(tables, results):
            if not np.array_equal(got.reshape(probe.size, -1), table[0][probe.reshape(-1)]):
                return None
    values = []
    for name, table in zip(("cos", "sin"), tables):
        table = table[0]
        cache_name = f"/model/rotary_emb/{name}_cache{suffix}"
        value = ir.Value(name=cache_name, const_value=ir.tensor(table, name=cache_name))
        value.shape, value.type = ir.Shape(list(table.shape)), ir.TensorType(dtype)
        model.graph.register_initializer(value)
        values.append(value)
    return values[0], values[1]


def _producers(values: list[ir.Value]) -> set[ir.Node] | None:
    """Every node ``values`` depend on (None if one has a subgraph)."""
    seen: set[ir.Node] = set()
    stack = [v.producer() for v in values if v.producer() is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            return None
        seen.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return seen


def _replace_attention(
    graph: ir.Graph, node: ir.Node, packed: ir.Value, cos_cache: ir.Value, sin_cache: ir.Value
) -> None:
    # positions from the lengths; a head_sink (attention sinks) stays input 11
    inputs = [packed, None, None, *node.inputs[3:7], cos_cache, sin_cache, *node.inputs[9:]]
    attributes = [a for name, a in node.attributes.items() if name not in ("do_rotary", "rotary_interleaved")]
    attributes += [ir.AttrInt64("do_rotary", 1), ir.AttrInt64("rotary_interleaved", 0)]
    fused = ir.Node(
        "com.microsoft",
        "GroupQueryAttention",
        inputs,
        attributes=attributes,
        num_outputs=len(node.outputs),
        name=node.name,
    )
    graph.insert_before(node, fused)
    for old, new in zip(node.outputs, fused.outputs):
        new.shape, new.type = old.shape, old.type
        old.replace_all_uses_with(new, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    for old, new in zip(node.outputs, fused.outputs):
        new.name = old.name
