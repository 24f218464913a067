"""The ONNX lowering of the state layers' ops (:mod:`kvforge.graphs.gated_delta`'s
``kvforge::gated_delta_rule`` and ``kvforge::kda_rule``, :mod:`kvforge.graphs.state`'s
``kvforge::depthwise_conv``; :mod:`kvforge.graphs.mamba2`'s ``kvforge::mamba2_scan``, which only
the ``gqa`` lowering records, goes to ONNX Runtime's kernel alone: :func:`ort_mamba2_scan`) in
standard opset-24 ops; export-time only. Two steps:

* **the translation** (:func:`translation_table`, for ``torch.onnx.export(custom_translation_table=...)``)
  records each call as one node of :data:`DOMAIN` (``GatedDeltaRule``, ``KdaRule``: ``(query, key,
  value, g, beta, state) -> (output, final state)``; ``DepthwiseConv``: ``(x, weight, bias?) -> y``);
* **the expansion** (:func:`expand`, on the exported ``onnx_ir`` model, before any optimizer)
  replaces each such node by an ``If`` on the length: two subgraphs that read the node's inputs
  from the enclosing graph. The graph is traced once for every length (decode runs through it, or
  through the ``decode`` graph derived from it by fixing ``S = 1``), so the choice is made at run
  time; ORT's ``If`` costs nothing measurable (benchmarks/FINDINGS.md).

**Chunked** (:func:`kvforge.graphs.gated_delta.chunked_rule`, op for op): the sequence padded to
``N`` chunks of ``C = min(S, CHUNK)`` tokens (``Min``/``Pad``/``Reshape`` on the run-time length);
within the chunks, all at once, ``CumSum``, ``Exp``, ``Where`` masks and MatMuls, ``(I + A)⁻¹`` in
``LEVELS`` unrolled levels of block forward substitution; across chunks one ``Scan`` that carries
the state ``[B, H, Dk, Dv]`` (the only loop: ``N`` iterations).

**One token**: what the chunked form computes when ``C = N = 1``, without the chunk machinery
(~100 small ops a layer): every within-chunk matrix is ``1 x 1`` (``T = I``, the decays between
positions ``exp(0) = 1``), so the step is the Scan body on the token itself, 14 ops, with the
output read from the new state (:func:`one_token_rule` says why): equal to the chunked form
within float32 rounding (tested).

**ONNX Runtime's fast path** (the ``gqa`` lowering, ``expand(fast=True)``): each rule is one
``com.microsoft.LinearAttention`` (:func:`ort_linear_attention`) for every length, no ``If``: ORT
1.32's kernel runs the rule faster than the ops above at one token and at 512 (benchmarks/FINDINGS.md).
Mamba2's scan is the same op's ``gated`` rule (:func:`ort_mamba2_scan`).

**The short convolution**: a ``Conv`` with ``group = C`` over the window (past state and chunk);
for one token, whose window is the kernel's width, ``K`` products and a sum per channel
(:func:`one_window_conv`): ORT's ``Conv`` runs a depthwise convolution one channel at a time.

Every op here but ``LinearAttention`` is one TensorRT's ONNX parser takes (``Scan`` and ``If``
included); the ``onnx`` lowering, TensorRT's, never uses the fast path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
import onnx_ir as ir

from kvforge.graphs.gated_delta import CHUNK, KDA_CHUNK, KDA_LEVELS, LEVELS, LOG_DECAY_FLOOR

DOMAIN = "kvforge.state"  # the nodes the translation records and expand() lowers; never saved
_INPUTS = ("query", "key", "value", "g", "beta", "state", "continues")  # the last optional
_MAMBA2_INPUTS = ("x", "dt", "a", "b", "c", "d", "state", "continues")  # the last optional


class _Builder(ir.tape.Tape):
    """``b.Add(x, y)``, ``b.Scan(..., body=graph, _outputs=2)``: a node of that type (of domain
    ``_domain``, default ONNX's) on the tape, keyword arguments as attributes; its output, or its
    ``_outputs`` outputs."""

    def __getattr__(self, op_type: str) -> Callable:
        def node(*inputs, _outputs: int = 1, _domain: str = "", **attributes):
            if _outputs == 1:
                return self.op(op_type, inputs, attributes, domain=_domain)
            return self.op_multi_out(op_type, inputs, attributes, num_outputs=_outputs, domain=_domain)

        return node


def _ints(op, *v):
    return op.Constant(value_ints=list(v))


def _scalar(op, x: float):
    return op.Constant(value_float=x)


def _decay(op, log_decay):
    """``gated_delta.decay``: ``Exp(Max(x, LOG_DECAY_FLOOR))``, never a denormal."""
    return op.Exp(op.Max(log_decay, _scalar(op, LOG_DECAY_FLOOR)))


def _float(name: str) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(ir.DataType.FLOAT))


def _pass_state(op, state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, name: str):
    """The state passing from chunk to chunk (``gated_delta._pass_state``): one ``Scan`` over axis 2
    of the per-chunk tensors ``(B, H, N, C, *)``, ``chunk_decay (B, H, N, 1 or Dk, 1)`` -> ``(final
    state, outputs (B, H, N, C, Dv))``."""
    body = _Builder()
    s, nv, kcd, qd, att, kd, cd = (_float(f"{name}/{x}") for x in ("s", "nv", "kcd", "qd", "att", "kd", "cd"))
    s_new, out = _chunk_step(body, s, nv, kcd, qd, att, kd, cd)
    graph = ir.Graph([s, nv, kcd, qd, att, kd, cd], [s_new, out], nodes=body.nodes, name=name)
    return op.Scan(
        state,
        new_values,
        k_cumdecay,
        q_decayed,
        intra,
        k_decayed,
        chunk_decay,
        body=graph,
        num_scan_inputs=6,
        scan_input_axes=[2] * 6,
        scan_output_axes=[2],
        _outputs=2,
    )


def _chunk_step(op, s, nv, kcd, qd, att, kd, cd):
    """One chunk (the Scan body): the state ``s (B, H, Dk, Dv)`` and the chunk's ``(B, H, C, *)``
    slices -> ``(new state, outputs (B, H, C, Dv))``."""
    v_new = op.Sub(nv, op.MatMul(kcd, s))  # (B, H, C, Dv): the values less what the state recalls
    out = op.Add(op.MatMul(qd, s), op.MatMul(att, v_new))
    s_new = op.Add(op.Mul(s, cd), op.MatMul(op.Transpose(kd, perm=[0, 1, 3, 2]), v_new))
    return s_new, out


def _chunks(op, key, size: int):
    """The run-time chunking of a sequence of ``S = key.shape[2]`` tokens: ``(seq [1], chunk [1],
    chunked)`` where ``chunk = min(S, size)`` and ``chunked(x)`` pads ``x (B, H, S, *)`` with zeros
    to ``N = ceil(S / chunk)`` chunks and reshapes it to ``(B, H, N, chunk, *)``."""
    seq = op.Shape(key, start=2, end=3)  # [1]: S
    chunk = op.Min(seq, _ints(op, size))  # [1]: C
    chunks = op.Div(op.Add(seq, op.Sub(chunk, _ints(op, 1))), chunk)  # [1]: N = ceil(S / C)
    pads = op.Concat(_ints(op, 0), op.Sub(op.Mul(chunks, chunk), seq), axis=0)  # axis 2: (begin, end)

    def chunked(x, trailing: bool = True):  # (B, H, S, *) -> (B, H, N, C, *), zero padded
        x = op.Pad(x, pads, _scalar(op, 0.0), _ints(op, 2))
        shape = [_ints(op, 0, 0), chunks, chunk, *([_ints(op, -1)] if trailing else [])]
        return op.Reshape(x, op.Concat(*shape, axis=0))

    return seq, chunk, chunked


def _masked_decay(op, mask, log_decay):
    """``exp(log_decay)`` floored where ``mask`` holds, 0 elsewhere."""
    return op.Where(mask, _decay(op, log_decay), _scalar(op, 0.0))


def _positions(op, chunk):
    """``(rows (C, 1), cols (1, C))``: a chunk's position indices, to build its masks."""
    idx = op.Range(op.Constant(value_int=0), op.Squeeze(chunk, _ints(op, 0)), op.Constant(value_int=1))  # (C,)
    return op.Unsqueeze(idx, _ints(op, 1)), op.Unsqueeze(idx, _ints(op, 0))


def _unit_lower_inverse(op, strict, rows, cols, levels: int):
    """``T = (I + strict)^-1`` (gated_delta.unit_lower_inverse) in ``levels`` unrolled levels: a
    level whose blocks are as large as the chunk finds nothing to merge and leaves T as it is."""
    zero = _scalar(op, 0.0)
    t = None
    for level in range(levels):
        block = 1 << level
        same = op.Equal(op.Div(rows, _ints(op, 2 * block)), op.Div(cols, _ints(op, 2 * block)))
        apart = op.Not(op.Equal(op.Div(rows, _ints(op, block)), op.Div(cols, _ints(op, block))))
        off = op.Where(op.And(same, apart), strict, zero)  # (B, H, N, C, C)
        if t is None:  # T = I: I - I·off·I
            t = op.Sub(op.Cast(op.Equal(rows, cols), to=ir.DataType.FLOAT), off)
        else:
            t = op.Sub(t, op.MatMul(op.MatMul(t, off), t))
    return t


def _finish(op, final_and_outputs, seq, dv):
    final, outputs = final_and_outputs
    output = op.Reshape(outputs, _ints(op, 0, 0, -1, dv))  # (B, H, N*C, Dv)
    return op.Slice(output, _ints(op, 0), seq, _ints(op, 2)), final  # (B, H, S, Dv)


def chunked_rule(op, query, key, value, g, beta, state, dv: int, name: str):
    """The chunked gated delta rule: query/key ``[B, H, S, Dk]``, value ``[B, H, S, Dv]``, g/beta
    ``[B, H, S]``, state ``[B, H, Dk, Dv]``, all float32 -> ``(output [B, H, S, Dv], final state)``."""
    seq, chunk, chunked = _chunks(op, key, CHUNK)
    zero = _scalar(op, 0.0)
    q, k, v = chunked(query), chunked(key), chunked(value)  # (B, H, N, C, D)
    g, beta = chunked(g, False), chunked(beta, False)  # (B, H, N, C)
    cum = op.CumSum(g, _ints(op, -1))  # (B, H, N, C): log decay from the chunk's start
    rows, cols = _positions(op, chunk)  # (C, 1), (1, C)
    diff = op.Sub(op.Unsqueeze(cum, _ints(op, -1)), op.Unsqueeze(cum, _ints(op, -2)))  # (B, H, N, C, C)
    pairwise = _masked_decay(op, op.GreaterOrEqual(rows, cols), diff)
    beta = op.Unsqueeze(beta, _ints(op, -1))  # (B, H, N, C, 1)
    k_beta = op.Mul(k, beta)
    k_t = op.Transpose(k, perm=[0, 1, 2, 4, 3])  # (B, H, N, Dk, C)
    strict = op.Where(op.Greater(rows, cols), op.Mul(op.MatMul(k_beta, k_t), pairwise), zero)
    t = _unit_lower_inverse(op, strict, rows, cols, LEVELS)

    exp_cum = op.Unsqueeze(_decay(op, cum), _ints(op, -1))  # (B, H, N, C, 1)
    new_values = op.MatMul(t, op.Mul(v, beta))  # (B, H, N, C, Dv)
    k_cumdecay = op.MatMul(t, op.Mul(k_beta, exp_cum))  # (B, H, N, C, Dk)
    intra = op.Mul(op.MatMul(q, k_t), pairwise)  # (B, H, N, C, C)
    q_decayed = op.Mul(q, exp_cum)
    last = op.Slice(cum, _ints(op, -1), _ints(op, 2**62), _ints(op, -1))  # (B, H, N, 1): the chunk's log decay
    k_decayed = op.Mul(k, op.Unsqueeze(_decay(op, op.Sub(last, cum)), _ints(op, -1)))
    chunk_decay = op.Unsqueeze(_decay(op, last), _ints(op, -1))  # (B, H, N, 1, 1)
    passed = _pass_state(op, state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, f"{name}/chunk")
    return _finish(op, passed, seq, dv)


def chunked_kda_rule(op, query, key, value, g, beta, state, dv: int, name: str):
    """:func:`chunked_rule` with g ``[B, H, S, Dk]``, a log decay per key channel
    (``gated_delta.chunked_kda_rule``): the within-chunk decays are ``(C, C, Dk)`` and weigh the key
    channels before the sums over them."""
    seq, chunk, chunked = _chunks(op, key, KDA_CHUNK)
    zero = _scalar(op, 0.0)
    q, k, v, g = chunked(query), chunked(key), chunked(value), chunked(g)  # (B, H, N, C, D)
    beta = op.Unsqueeze(chunked(beta, False), _ints(op, -1))  # (B, H, N, C, 1)
    cum = op.CumSum(g, _ints(op, -2))  # (B, H, N, C, Dk): per channel, log decay from the chunk's start
    rows, cols = _positions(op, chunk)  # (C, 1), (1, C)
    diff = op.Sub(op.Unsqueeze(cum, _ints(op, -2)), op.Unsqueeze(cum, _ints(op, -3)))  # (B, H, N, C, C, Dk)
    lower = op.Unsqueeze(op.GreaterOrEqual(rows, cols), _ints(op, -1))  # (C, C, 1)
    decay = _masked_decay(op, lower, diff)  # (B, H, N, C, C, Dk), 0 above the diagonal
    k_j = op.Unsqueeze(k, _ints(op, -3))  # (B, H, N, 1, C, Dk)
    k_beta = op.Mul(k, beta)
    weighted = op.Mul(decay, k_j)  # (B, H, N, C, C, Dk): key j decayed to position i, per channel
    strict = op.Where(
        op.Greater(rows, cols),
        op.ReduceSum(op.Mul(op.Unsqueeze(k_beta, _ints(op, -2)), weighted), _ints(op, -1), keepdims=0),
        zero,
    )  # (B, H, N, C, C)
    t = _unit_lower_inverse(op, strict, rows, cols, KDA_LEVELS)

    exp_cum = _decay(op, cum)  # (B, H, N, C, Dk)
    new_values = op.MatMul(t, op.Mul(v, beta))  # (B, H, N, C, Dv)
    k_cumdecay = op.MatMul(t, op.Mul(k_beta, exp_cum))  # (B, H, N, C, Dk)
    intra = op.ReduceSum(op.Mul(op.Unsqueeze(q, _ints(op, -2)), weighted), _ints(op, -1), keepdims=0)  # (B, H, N, C, C)
    q_decayed = op.Mul(q, exp_cum)
    last = op.Slice(cum, _ints(op, -1), _ints(op, 2**62), _ints(op, -2))  # (B, H, N, 1, Dk): the chunk's log decay
    k_decayed = op.Mul(k, _decay(op, op.Sub(last, cum)))
    chunk_decay = op.Transpose(_decay(op, last), perm=[0, 1, 2, 4, 3])  # (B, H, N, Dk, 1)
    passed = _pass_state(op, state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, f"{name}/chunk")
    return _finish(op, passed, seq, dv)


def one_token_rule(op, query, key, value, g, beta, state, per_channel: bool = False, continues=None):
    """The rule for one token: query/key ``[B, H, 1, Dk]``, value ``[B, H, 1, Dv]``, g ``[B, H, 1]``
    (``[B, H, 1, Dk]`` when ``per_channel``: KDA), beta ``[B, H, 1]``, state -> ``(output [B, H, 1,
    Dv], final state)``. With ``d = exp(max(g, floor))``: ``v' = v·beta - (k·beta·d) S``, ``S' =
    d S + kᵀ v'`` (the chunked form's state step at ``C = 1``, where ``T = I`` and the decays
    between positions are ``exp(0)``), and ``output = q S'``, which is the chunked form's ``(q·d) S
    + (q·k) v'`` read from the new state: the runtime binds the present state to the past's buffer,
    and an output that read the past could run after the new state is written over it; read from
    the new state, it cannot. (Equal to the chunked form within float32 rounding, not bit for bit.)
    ``continues [B]`` (1 or 0; optional): the two factors that read the state are scaled by it,
    which gives a new sequence's row (0) the step from a zero state without a pass over the state
    (which holds finite numbers: zeros, or what the graph wrote)."""
    beta = op.Unsqueeze(beta, _ints(op, -1))  # (B, H, 1, 1)
    if per_channel:
        d = _decay(op, g)  # (B, H, 1, Dk)
        chunk_decay = op.Transpose(d, perm=[0, 1, 3, 2])  # (B, H, Dk, 1): the state's rows
    else:
        d = chunk_decay = op.Unsqueeze(_decay(op, g), _ints(op, -1))  # (B, H, 1, 1)
    k_cumdecay = op.Mul(op.Mul(key, beta), d)  # (B, H, 1, Dk)
    if continues is not None:
        row = op.Reshape(continues, _ints(op, -1, 1, 1, 1))  # (B, 1, 1, 1)
        k_cumdecay, chunk_decay = op.Mul(k_cumdecay, row), op.Mul(chunk_decay, row)
    v_new = op.Sub(op.Mul(value, beta), op.MatMul(k_cumdecay, state))  # (B, H, 1, Dv)
    final = op.Add(op.Mul(state, chunk_decay), op.Mul(op.Transpose(key, perm=[0, 1, 3, 2]), v_new))
    return op.MatMul(query, final), final


def _fresh_log_decay(op, g, continues):
    """``g [B, S, ...]`` (token-major log decays) with ``-inf`` at the first token of the rows
    whose ``continues [B]`` is 0: ``exp(-inf) = 0`` wipes what the state held before, so such a
    row starts from zeros without a pass over the state (ONNX Runtime's ``LinearAttention`` takes
    it at every length: tested). ``continues`` None: ``g`` as it is."""
    if continues is None:
        return g
    seq = op.Squeeze(op.Shape(g, start=1, end=2), _ints(op, 0))
    first = op.Unsqueeze(
        op.Equal(op.Range(op.Constant(value_int=0), seq, op.Constant(value_int=1)), op.Constant(value_int=0)),
        _ints(op, 0, 2),
    )  # (1, S, 1)
    new = op.Equal(op.Reshape(continues, _ints(op, -1, 1, 1)), _scalar(op, 0.0))  # (B, 1, 1)
    return op.Where(op.And(new, first), _scalar(op, float("-inf")), g)


def ort_linear_attention(
    op, query, key, value, g, beta, state, heads: int, dv: int, per_channel: bool = False, continues=None
):
    """The rule as ONNX Runtime's ``com.microsoft.LinearAttention`` (``update_rule="gated_delta"``),
    the ``gqa`` lowering's fast path: one node for any length (the recurrent step for one token, a
    chunked form for more), the state ``[B, H, Dk, Dv]`` in kvforge's layout, alias-safe (the
    present bound to the past's buffer gives what separate buffers give, bit for bit: tested).
    Measured against this module's lowering on one layer of the Qwen3.5-0.8B shape (batch 1, 2
    threads): 0.035 against 0.12 ms a token, 14.9 against 22.3 ms at 512 tokens
    (benchmarks/FINDINGS.md). Same inputs and results as :func:`one_token_rule` (``per_channel``:
    KDA's log decay per key channel, which the op takes packed like the keys); heads packed
    token-major (``[B, S, H * D]``) around the node, the query already scaled (``scale = 1``).
    ``continues [B]``: a new sequence's row (0) starts from a zero state through its first token's
    log decay, set to ``-inf`` (``exp(-inf) = 0`` wipes the past: the state holds finite numbers,
    zeros or what the graph wrote), so no pass over the state (the op's chunked form takes it: tested)."""

    def packed(x):  # (B, H, S, D) -> (B, S, H * D)
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), _ints(op, 0, 0, -1))

    g = packed(g) if per_channel else op.Transpose(g, perm=[0, 2, 1])  # (B, S, H * Dk) or (B, S, H)
    beta = op.Transpose(beta, perm=[0, 2, 1])  # (B, S, H)
    g = _fresh_log_decay(op, g, continues)
    output, final = op.LinearAttention(
        packed(query),
        packed(key),
        packed(value),
        state,
        g,
        beta,
        q_num_heads=heads,
        kv_num_heads=heads,
        update_rule="gated_delta",
        scale=1.0,
        _domain="com.microsoft",
        _outputs=2,
    )
    return op.Transpose(op.Reshape(output, _ints(op, 0, 0, heads, dv)), perm=[0, 2, 1, 3]), final  # (B, H, S, Dv)


def ort_mamba2_scan(op, x, dt, a, b, c, d, state, continues, heads: int, head_dim: int, groups: int, size: int):
    """Mamba2's SSD scan (:func:`kvforge.graphs.mamba2.mamba2_scan`) as ONNX Runtime's
    ``com.microsoft.LinearAttention`` with ``update_rule="gated"`` (``S = exp(g) S + k vᵀ``,
    ``o = qᵀ S``), the ``gqa`` lowering's form: the state update ``h = exp(dt·A) h + B ⊗ (dt·x)``
    with ``k = B`` (each group's repeated over its heads), ``v = dt·x``, ``q = C``, ``g = dt·A`` per
    head, then ``y = o + D·x``. ``x [B, S, H, P]``, ``dt [B, S, H]`` (0 past each row's last real
    token), ``a``/``d [H]``, ``b``/``c [B, S, G, N]``, ``state [B, H, N, P]``: the contract's layout
    is the op's ``[B, H, Dk, Dv]``, bound in place (alias-safe: tested). Rows whose ``continues`` is
    0 start from zeros (:func:`_fresh_log_decay`). Returns ``(y [B, S, H, P], final [B, H, N, P])``."""

    def per_head(t):  # (B, S, G, N) -> (B, S, H * N): group j serves heads [j H/G, (j + 1) H/G)
        spread = op.Expand(op.Unsqueeze(t, _ints(op, 3)), _ints(op, 1, 1, 1, heads // groups, 1))
        return op.Reshape(spread, _ints(op, 0, 0, heads * size))

    g = _fresh_log_decay(op, op.Mul(dt, a), continues)  # (B, S, H)
    value = op.Reshape(op.Mul(x, op.Unsqueeze(dt, _ints(op, -1))), _ints(op, 0, 0, heads * head_dim))
    output, final = op.LinearAttention(
        per_head(c),
        per_head(b),
        value,
        state,
        g,
        q_num_heads=heads,
        kv_num_heads=heads,
        update_rule="gated",
        scale=1.0,
        _domain="com.microsoft",
        _outputs=2,
    )
    y = op.Add(op.Reshape(output, _ints(op, 0, 0, heads, head_dim)), op.Mul(x, op.Unsqueeze(d, _ints(op, -1))))
    return y, final


def one_window_conv(op, x, weight2d, bias_column):
    """:func:`kvforge.graphs.state.depthwise_conv` of a window as long as the kernel, ``x [B, C,
    K]`` -> ``[B, C, 1]``: ``K`` products and a sum per channel (``weight2d [C, K]``, ``bias_column
    [C, 1]`` or None)."""
    out = op.ReduceSum(op.Mul(x, weight2d), _ints(op, -1), keepdims=1)
    return out if bias_column is None else op.Add(out, bias_column)


# ---------------------------------------------------------------- the translation and the expansion


def _schema(name: str, inputs: Sequence[str], outputs: Sequence[str], optional: int = 0) -> onnx.defs.OpSchema:
    param, option = onnx.defs.OpSchema.FormalParameter, onnx.defs.OpSchema.FormalParameterOption
    return onnx.defs.OpSchema(
        name,
        DOMAIN,
        1,
        inputs=[
            param(x, "T", param_option=option.Optional if i >= len(inputs) - optional else option.Single)
            for i, x in enumerate(inputs)
        ],
        outputs=[param(x, "T") for x in outputs],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "the model's float type")],
    )


_RULES = {"GatedDeltaRule": False, "KdaRule": True}  # node type -> per_channel


def translation_table() -> dict[object, Callable]:
    """``custom_translation_table`` entries: each op to one node of :data:`DOMAIN`, which
    :func:`expand` lowers."""
    import torch
    from onnxscript import values

    import kvforge.graphs.mamba2  # (registers kvforge::mamba2_scan)
    import kvforge.graphs.state  # noqa: F401  (registers kvforge::depthwise_conv)

    opset = values.Opset(DOMAIN, 1)
    outputs = ("output", "final_state")
    rule, kda = (values.Op(opset, name, _schema(name, _INPUTS, outputs, optional=1)) for name in _RULES)
    conv = values.Op(opset, "DepthwiseConv", _schema("DepthwiseConv", ("x", "weight", "bias"), ("y",), optional=1))
    ssd = values.Op(opset, "Mamba2Scan", _schema("Mamba2Scan", _MAMBA2_INPUTS, ("y", "final_state"), optional=1))

    def gated_delta_rule(query, key, value, g, beta, state, continues=None):
        return rule(query, key, value, g, beta, state, continues)

    def kda_rule(query, key, value, g, beta, state, continues=None):
        return kda(query, key, value, g, beta, state, continues)

    def depthwise_conv(x, weight, bias=None):
        return conv(x, weight, bias)

    def mamba2_scan(x, dt, a, b, c, d, state, continues=None):
        return ssd(x, dt, a, b, c, d, state, continues)

    return {
        torch.ops.kvforge.gated_delta_rule.default: gated_delta_rule,
        torch.ops.kvforge.kda_rule.default: kda_rule,
        torch.ops.kvforge.depthwise_conv.default: depthwise_conv,
        torch.ops.kvforge.mamba2_scan.default: mamba2_scan,
    }


def _name(nodes: Sequence[ir.Node], prefix: str) -> None:
    """Unique names (ONNX's one namespace across subgraphs) for ``nodes``, their outputs and the
    nodes of their subgraphs."""
    for i, node in enumerate(nodes):
        node.name = f"{prefix}/{node.op_type}_{i}"
        for j, out in enumerate(node.outputs):
            out.name = f"{node.name}_output_{j}"
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                _name(list(attr.value), f"{node.name}/{attr.name}")


def _branch(builder: _Builder, outputs: Sequence[ir.Value], like: Sequence[ir.Value], name: str) -> ir.Graph:
    """A branch of ``builder``'s nodes whose outputs have the types of the node's, ``like``."""
    for out, old in zip(outputs, like):
        out.dtype = old.dtype
    return ir.Graph([], list(outputs), nodes=builder.nodes, name=name)


def _static(value: ir.Value, axis: int, what: str) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise ValueError(f"{what} must be static, got {value.shape}")
    return dim


def _lower_rule(
    node: ir.Node, one_token: bool, prefix: str, fast: bool = False
) -> tuple[list[ir.Node], Sequence[ir.Value]]:
    """A delta rule's node -> ``If(S == 1, one_token_rule, chunked)`` (or the chunked form alone);
    with ``fast``, :func:`ort_linear_attention`."""
    per_channel = _RULES[node.op_type]
    query, key, value, g, beta, state, continues = (*node.inputs, None)[:7]
    dv = _static(value, -1, f"{node.op_type} {node.name!r}: the value head dim")
    if fast:
        heads = _static(value, 1, f"{node.op_type} {node.name!r}: the value heads")
        op = _Builder()
        results = ort_linear_attention(op, query, key, value, g, beta, state, heads, dv, per_channel, continues)
        return list(op.nodes), results
    chunked = _Builder()
    start = state
    if continues is not None:  # new sequences' rows from zeros
        keep = chunked.Cast(chunked.Reshape(continues, _ints(chunked, -1, 1, 1, 1)), to=ir.DataType.BOOL)
        start = chunked.Where(keep, state, _scalar(chunked, 0.0))
    rule = chunked_kda_rule if per_channel else chunked_rule
    results = rule(chunked, query, key, value, g, beta, start, dv, f"{prefix}/chunked")
    if not one_token:
        return list(chunked.nodes), results
    step = _Builder()
    single = one_token_rule(step, query, key, value, g, beta, state, per_channel, continues)
    top = _Builder()
    results = top.If(
        top.Equal(top.Shape(key, start=2, end=3), _ints(top, 1)),
        then_branch=_branch(step, single, node.outputs, f"{prefix}/one_token"),
        else_branch=_branch(chunked, results, node.outputs, f"{prefix}/chunked"),
        _outputs=2,
    )
    return list(top.nodes), results


def _lower_conv(
    node: ir.Node, one_token: bool, prefix: str, fast: bool = False
) -> tuple[list[ir.Node], Sequence[ir.Value]]:
    """A depthwise conv's node -> ``If(L == K, one_window_conv, Conv)`` (or the ``Conv`` alone).
    The weight's ``[C, K]`` view and the bias column are made in the enclosing graph, where the
    optimizers fold them into its initializers (a constant folded inside a branch would stay the
    branch's own, which the shared weights file does not take). ``fast`` changes nothing here: ORT's
    ``CausalConvWithState`` ran a one-token window of 6144 channels ×0.88 of these ops' time, and
    its present state is the whole padded chunk's last inputs, not each row's (benchmarks/FINDINGS.md)."""
    x, weight, bias = (*node.inputs, None)[:3]
    channels, width = (_static(weight, axis, f"DepthwiseConv {node.name!r}: the weight") for axis in (0, -1))
    top, conv = _Builder(), _Builder()
    y = conv.Conv(*([x, weight] if bias is None else [x, weight, bias]), group=channels)
    if not one_token:
        return list(conv.nodes), [y]
    step = _Builder()
    weight2d = top.Reshape(weight, _ints(top, channels, width))
    column = None if bias is None else top.Unsqueeze(bias, _ints(top, -1))
    out = one_window_conv(step, x, weight2d, column)
    results = top.If(
        top.Equal(top.Shape(x, start=2, end=3), _ints(top, width)),
        then_branch=_branch(step, [out], node.outputs, f"{prefix}/one_window"),
        else_branch=_branch(conv, [y], node.outputs, f"{prefix}/conv"),
    )
    return list(top.nodes), [results]


def _lower_mamba2(
    node: ir.Node, one_token: bool, prefix: str, fast: bool = False
) -> tuple[list[ir.Node], Sequence[ir.Value]]:
    """A Mamba2 scan's node -> :func:`ort_mamba2_scan`. Only the ``gqa`` lowering records it
    (:func:`kvforge.graphs.mamba2.linear_attention`); the others trace the scan in standard ops."""
    if not fast:
        raise ValueError(f"Mamba2Scan {node.name!r}: only the gqa lowering runs the scan as one op")
    x, dt, a, b, c, d, state, continues = (*node.inputs, None)[:8]
    heads, head_dim = (_static(x, axis, f"Mamba2Scan {node.name!r}: x") for axis in (2, 3))
    groups, size = (_static(b, axis, f"Mamba2Scan {node.name!r}: B") for axis in (2, 3))
    op = _Builder()
    results = ort_mamba2_scan(op, x, dt, a, b, c, d, state, continues, heads, head_dim, groups, size)
    return list(op.nodes), results


_LOWERINGS = {
    "GatedDeltaRule": _lower_rule,
    "KdaRule": _lower_rule,
    "DepthwiseConv": _lower_conv,
    "Mamba2Scan": _lower_mamba2,
}


def expand(model: ir.Model, one_token: bool = True, fast: bool = False) -> int:
    """Replace every :data:`DOMAIN` node of ``model``'s graph by its lowering, in place: an ``If``
    on the length whose one-token branch is :func:`one_token_rule` (:func:`one_window_conv`) and
    whose other is the chunked form (the ``Conv``); or (``one_token=False``) the latter alone,
    inline. ``fast`` (the ``gqa`` lowering: ONNX Runtime only) lowers the delta rules to
    :func:`ort_linear_attention` instead. Returns how many nodes were replaced."""
    graph = model.graph
    sites = [node for node in graph if node.domain == DOMAIN]
    for index, node in enumerate(sites):
        if node.op_type not in _LOWERINGS:
            raise ValueError(f"unknown {DOMAIN} op {node.op_type!r}")
        prefix = node.name or f"/{node.op_type}_{index}"
        new_nodes, results = _LOWERINGS[node.op_type](node, one_token, prefix, fast)
        _name(new_nodes, prefix)
        for new_node in new_nodes:  # the exporter's module scopes, which name the node (export._name_nodes)
            new_node.metadata_props.update(node.metadata_props)
        graph.insert_before(node, new_nodes)
        for old, new in zip(node.outputs, results):
            name, old.name = old.name, None
            new.name, new.dtype, new.shape = name, old.dtype, old.shape
            old.replace_all_uses_with(new, replace_graph_outputs=True)
        graph.remove(node, safe=True)
    if sites:
        model.opset_imports.pop(DOMAIN, None)
        if fast and any(site.op_type in (*_RULES, "Mamba2Scan") for site in sites):  # LinearAttention's domain
            model.opset_imports.setdefault("com.microsoft", 1)
    return len(sites)
