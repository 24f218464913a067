"""The ONNX lowering of ``kvforge::gated_delta_rule`` (:mod:`kvforge.graphs.gated_delta`) in standard
opset-24 ops, for ``torch.onnx.export(custom_translation_table=...)``; export-time only.

:func:`kvforge.graphs.gated_delta.chunked_rule`, op for op: the sequence padded to ``N`` chunks of
``C = min(S, CHUNK)`` tokens (``Min``/``Pad``/``Reshape`` on the run-time length, so one graph serves
prefill, decode and verify); within the chunks, all at once, ``CumSum``, ``Exp``, ``Where`` masks
and MatMuls, ``(I + A)⁻¹`` in ``LEVELS`` unrolled levels of block forward substitution; across
chunks one ``Scan`` that carries the state ``[B, H, Dk, Dv]`` (the only loop: ``N`` iterations).
Every op here is one TensorRT's ONNX parser takes (``Scan`` included).

No ``from __future__ import annotations`` here: the exporter reads the onnxscript function's
annotations (its output count) as objects.
"""

from collections.abc import Callable

from onnxscript import FLOAT, graph, ir, script, values

from kvforge.graphs.gated_delta import CHUNK, KDA_CHUNK, KDA_LEVELS, LEVELS, LOG_DECAY_FLOOR

op = values.Opset("", 24)
# The function's ops: the exporter builds at opset 18 and converts the model to 24 after inlining
# functions, which must then share the model's version. Scan-16 and these ops are unchanged since.
op18 = values.Opset("", 18)
# Symbolic dims of the scan's types: batch, value heads, key and value head dims, chunks, chunk length,
# and the rows of the chunk's decay: 1 (a decay per head) or Dk (KDA: per key channel)
B_, H_, Dk_, Dv_, N_, C_, G_ = "B", "H", "Dk", "Dv", "N", "C", "G"


@script(values.Opset("kvforge.gated_delta", 1), default_opset=op18)
def chunk_scan(
    state: FLOAT[B_, H_, Dk_, Dv_],
    new_values: FLOAT[B_, H_, N_, C_, Dv_],
    k_cumdecay: FLOAT[B_, H_, N_, C_, Dk_],
    q_decayed: FLOAT[B_, H_, N_, C_, Dk_],
    intra: FLOAT[B_, H_, N_, C_, C_],
    k_decayed: FLOAT[B_, H_, N_, C_, Dk_],
    chunk_decay: FLOAT[B_, H_, N_, G_, 1],
) -> tuple[FLOAT[B_, H_, Dk_, Dv_], FLOAT[B_, H_, N_, C_, Dv_]]:
    """The loop over chunks: ``(state [B, H, Dk, Dv], new_values/k_cumdecay/q_decayed/intra/k_decayed
    [B, H, N, C, *], chunk_decay [B, H, N, G, 1]: G = 1, or Dk for KDA) -> (final state, outputs
    [B, H, N, C, Dv])``. An
    onnxscript function (inlined by the export's optimizer) rather than traced ops, because the
    exporter's op recorder gives a variadic-output op such as ``Scan`` one output."""

    @graph()
    def chunk(
        s: FLOAT[B_, H_, Dk_, Dv_],
        nv: FLOAT[B_, H_, C_, Dv_],
        kcd: FLOAT[B_, H_, C_, Dk_],
        qd: FLOAT[B_, H_, C_, Dk_],
        att: FLOAT[B_, H_, C_, C_],
        kd: FLOAT[B_, H_, C_, Dk_],
        cd: FLOAT[B_, H_, G_, 1],
    ) -> tuple[FLOAT[B_, H_, Dk_, Dv_], FLOAT[B_, H_, C_, Dv_]]:
        # one chunk: the state (B, H, Dk, Dv) and the chunk's slices (B, H, C, *)
        v_new = op18.Sub(nv, op18.MatMul(kcd, s))  # (B, H, C, Dv): the values less what the state recalls
        out = op18.Add(op18.MatMul(qd, s), op18.MatMul(att, v_new))  # (B, H, C, Dv)
        s_new = op18.Add(op18.Mul(s, cd), op18.MatMul(op18.Transpose(kd, perm=[0, 1, 3, 2]), v_new))  # (B, H, Dk, Dv)
        return s_new, out

    final, outputs = op18.Scan(
        state,
        new_values,
        k_cumdecay,
        q_decayed,
        intra,
        k_decayed,
        chunk_decay,
        body=chunk,
        num_scan_inputs=6,
        scan_input_axes=[2, 2, 2, 2, 2, 2],
        scan_output_axes=[2],
    )
    return final, outputs


# onnxscript types Scan's outputs as its body's: right for the state, one axis short for the stacked
# outputs, which the model's shape inference then rejects. Say what they are.
[_scan] = list(chunk_scan.function_ir)
_scan.outputs[1].shape = ir.Shape([B_, H_, N_, C_, Dv_])


def _ints(*v):
    return op.Constant(value_ints=list(v))


def _scalar(x: float):
    return op.Constant(value_float=x)


def _chunks(key, size: int):
    """The run-time chunking of a sequence of ``S = key.shape[2]`` tokens: ``(seq [1], chunk [1],
    chunked)`` where ``chunk = min(S, size)`` and ``chunked(x)`` pads ``x (B, H, S, *)`` with zeros
    to ``N = ceil(S / chunk)`` chunks and reshapes it to ``(B, H, N, chunk, *)``."""
    seq = op.Shape(key, start=2, end=3)  # [1]: S
    chunk = op.Min(seq, _ints(size))  # [1]: C
    chunks = op.Div(op.Add(seq, op.Sub(chunk, _ints(1))), chunk)  # [1]: N = ceil(S / C)
    pads = op.Concat(_ints(0), op.Sub(op.Mul(chunks, chunk), seq), axis=0)  # axis 2: (begin, end)

    def chunked(x, trailing: bool = True):  # (B, H, S, *) -> (B, H, N, C, *), zero padded
        x = op.Pad(x, pads, _scalar(0.0), _ints(2))
        return op.Reshape(x, op.Concat(_ints(0, 0), chunks, chunk, *([_ints(-1)] if trailing else []), axis=0))

    return seq, chunk, chunked


def _decay(log_decay):
    """``gated_delta.decay``: ``Exp(Max(x, LOG_DECAY_FLOOR))``, never a denormal."""
    return op.Exp(op.Max(log_decay, _scalar(LOG_DECAY_FLOOR)))


def _masked_decay(mask, log_decay):
    """``exp(log_decay)`` floored where ``mask`` holds, 0 elsewhere."""
    return op.Where(mask, _decay(log_decay), _scalar(0.0))


def _positions(chunk):
    """``(rows (C, 1), cols (1, C))``: a chunk's position indices, to build its masks."""
    idx = op.Range(op.Constant(value_int=0), op.Squeeze(chunk, _ints(0)), op.Constant(value_int=1))  # (C,)
    return op.Unsqueeze(idx, _ints(1)), op.Unsqueeze(idx, _ints(0))


def _unit_lower_inverse(strict, rows, cols, levels: int):
    """``T = (I + strict)^-1`` (gated_delta.unit_lower_inverse) in ``levels`` unrolled levels: a
    level whose blocks are as large as the chunk finds nothing to merge and leaves T as it is."""
    zero = _scalar(0.0)
    t = None
    for level in range(levels):
        block = 1 << level
        same = op.Equal(op.Div(rows, _ints(2 * block)), op.Div(cols, _ints(2 * block)))
        apart = op.Not(op.Equal(op.Div(rows, _ints(block)), op.Div(cols, _ints(block))))
        off = op.Where(op.And(same, apart), strict, zero)  # (B, H, N, C, C)
        if t is None:  # T = I: I - I·off·I
            t = op.Sub(op.Cast(op.Equal(rows, cols), to=ir.DataType.FLOAT), off)
        else:
            t = op.Sub(t, op.MatMul(op.MatMul(t, off), t))
    return t


def gated_delta_rule(query, key, value, g, beta, state):
    """``kvforge::gated_delta_rule``: query/key ``[B, H, S, Dk]``, value ``[B, H, S, Dv]``, g/beta
    ``[B, H, S]``, state ``[B, H, Dk, Dv]``, all float32 -> ``(output [B, H, S, Dv], final state)``."""
    dv = value.shape[-1]  # static
    seq, chunk, chunked = _chunks(key, CHUNK)
    zero = _scalar(0.0)
    q, k, v = chunked(query), chunked(key), chunked(value)  # (B, H, N, C, D)
    g, beta = chunked(g, False), chunked(beta, False)  # (B, H, N, C)
    cum = op.CumSum(g, _ints(-1))  # (B, H, N, C): log decay from the chunk's start
    rows, cols = _positions(chunk)  # (C, 1), (1, C)
    diff = op.Sub(op.Unsqueeze(cum, _ints(-1)), op.Unsqueeze(cum, _ints(-2)))  # (B, H, N, C, C): cum_i - cum_j
    pairwise = _masked_decay(op.GreaterOrEqual(rows, cols), diff)
    beta = op.Unsqueeze(beta, _ints(-1))  # (B, H, N, C, 1)
    k_beta = op.Mul(k, beta)
    k_t = op.Transpose(k, perm=[0, 1, 2, 4, 3])  # (B, H, N, Dk, C)
    strict = op.Where(op.Greater(rows, cols), op.Mul(op.MatMul(k_beta, k_t), pairwise), zero)
    t = _unit_lower_inverse(strict, rows, cols, LEVELS)

    exp_cum = op.Unsqueeze(_decay(cum), _ints(-1))  # (B, H, N, C, 1)
    new_values = op.MatMul(t, op.Mul(v, beta))  # (B, H, N, C, Dv)
    k_cumdecay = op.MatMul(t, op.Mul(k_beta, exp_cum))  # (B, H, N, C, Dk)
    intra = op.Mul(op.MatMul(q, k_t), pairwise)  # (B, H, N, C, C)
    q_decayed = op.Mul(q, exp_cum)
    last = op.Slice(cum, _ints(-1), _ints(2**62), _ints(-1))  # (B, H, N, 1): the chunk's whole log decay
    k_decayed = op.Mul(k, op.Unsqueeze(_decay(op.Sub(last, cum)), _ints(-1)))
    chunk_decay = op.Unsqueeze(_decay(last), _ints(-1))  # (B, H, N, 1, 1)

    final, outputs = chunk_scan(state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay)
    output = op.Reshape(outputs, _ints(0, 0, -1, dv))  # (B, H, N*C, Dv)
    return op.Slice(output, _ints(0), seq, _ints(2)), final  # (B, H, S, Dv)


def kda_rule(query, key, value, g, beta, state):
    """``kvforge::kda_rule`` (:func:`kvforge.graphs.gated_delta.chunked_kda_rule`): as
    :func:`gated_delta_rule` with g ``[B, H, S, Dk]``, a log decay per key channel, so the
    within-chunk decays are ``(C, C, Dk)`` and weigh the key channels before the sums over them."""
    dv = value.shape[-1]  # static
    seq, chunk, chunked = _chunks(key, KDA_CHUNK)
    zero = _scalar(0.0)
    q, k, v, g = chunked(query), chunked(key), chunked(value), chunked(g)  # (B, H, N, C, D)
    beta = op.Unsqueeze(chunked(beta, False), _ints(-1))  # (B, H, N, C, 1)
    cum = op.CumSum(g, _ints(-2))  # (B, H, N, C, Dk): per channel, log decay from the chunk's start
    rows, cols = _positions(chunk)  # (C, 1), (1, C)
    diff = op.Sub(op.Unsqueeze(cum, _ints(-2)), op.Unsqueeze(cum, _ints(-3)))  # (B, H, N, C, C, Dk)
    lower = op.Unsqueeze(op.GreaterOrEqual(rows, cols), _ints(-1))  # (C, C, 1)
    decay = _masked_decay(lower, diff)  # (B, H, N, C, C, Dk), 0 above the diagonal
    k_j = op.Unsqueeze(k, _ints(-3))  # (B, H, N, 1, C, Dk)
    k_beta = op.Mul(k, beta)
    weighted = op.Mul(decay, k_j)  # (B, H, N, C, C, Dk): key j decayed to position i, per channel
    strict = op.Where(
        op.Greater(rows, cols),
        op.ReduceSum(op.Mul(op.Unsqueeze(k_beta, _ints(-2)), weighted), _ints(-1), keepdims=0),
        zero,
    )  # (B, H, N, C, C)
    t = _unit_lower_inverse(strict, rows, cols, KDA_LEVELS)

    exp_cum = _decay(cum)  # (B, H, N, C, Dk)
    new_values = op.MatMul(t, op.Mul(v, beta))  # (B, H, N, C, Dv)
    k_cumdecay = op.MatMul(t, op.Mul(k_beta, exp_cum))  # (B, H, N, C, Dk)
    intra = op.ReduceSum(op.Mul(op.Unsqueeze(q, _ints(-2)), weighted), _ints(-1), keepdims=0)  # (B, H, N, C, C)
    q_decayed = op.Mul(q, exp_cum)
    last = op.Slice(cum, _ints(-1), _ints(2**62), _ints(-2))  # (B, H, N, 1, Dk): the chunk's whole log decay
    k_decayed = op.Mul(k, _decay(op.Sub(last, cum)))
    chunk_decay = op.Transpose(_decay(last), perm=[0, 1, 2, 4, 3])  # (B, H, N, Dk, 1)

    final, outputs = chunk_scan(state, new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay)
    output = op.Reshape(outputs, _ints(0, 0, -1, dv))  # (B, H, N*C, Dv)
    return op.Slice(output, _ints(0), seq, _ints(2)), final  # (B, H, S, Dv)


def translation_table() -> dict[object, Callable]:
    """``custom_translation_table`` entries: the op and its translation."""
    import torch

    return {torch.ops.kvforge.gated_delta_rule.default: gated_delta_rule, torch.ops.kvforge.kda_rule.default: kda_rule}
