"""Mamba's (v1) selective scan for export: a chunked kernel, its ONNX lowering, and the swap that
puts it in transformers' Mamba layers.

transformers' ``mamba_scan_forward`` (Mamba, FalconMamba, Jamba) runs the scan token by token
from a zero state (``mamba_selective_scan``, a Python loop: it cannot be traced for a dynamic
sequence length, and it ignores the cached state when a prompt continues a sequence). kvforge
swaps it, through transformers' own extension point (the function is decorated
``use_kernel_forward_from_hub("mamba_scan_forward")`` and listed in the mixer's
``use_kernelized_func``; :func:`use_chunked_scan` registers a kernel mapping for that name and
calls ``kernels.kernelize``), for :class:`ChunkedMambaScan`, which reads the layer's state and
each row's ``lengths`` from the :class:`~kvforge.graphs.state.ExportStateCache` of the trace.

The scan. ``A [D, N]`` is diagonal, so the state recurrence ``h_t = exp(dt_t·A)·h_{t-1} +
dt_t·x_t·B_t`` is elementwise linear. Within a chunk of ``L`` tokens, with ``cum_t = Σ_{s≤t}
dt_s·A`` (a cumulative sum over the chunk), ``h_t = exp(cum_t)·h_0 + Σ_{s≤t} exp(cum_t -
cum_s)·dt_s·x_s·B_s``: a masked ``[L, L]`` matrix of decays (the exponent is 0 or negative where
``s ≤ t``; the others are set to -inf before ``Exp``, so nothing overflows) times the inputs
(``MatMul``), and ``y_t = h_t·C_t``. The chunks run in order, each starting from the last state
of the one before (an ONNX ``Scan`` over chunks, never over tokens). ``A`` differs per state
channel, so a chunk's decay matrix is ``[B, D, N, L, L]``: :func:`chunk_length` keeps it within
:data:`CHUNK_BUDGET` bytes per row. The chunk length is ``min(S, L)`` in the graph, so a decode
step (``S = 1``) is one chunk of one token: the recurrent step.

Ragged rows: ``dt`` is 0 at every position at or after a row's ``lengths[b]`` (and in the padding
that fills the last chunk), so the state there is unchanged: the state written is the one after the
row's last real token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvforge.graphs import kernel_swap, state

# Bytes of one chunk's [D, N, L, L] decay matrix per row that the chunk length is chosen to fit.
CHUNK_BUDGET = 8 << 20
MAX_CHUNK = 64
KERNEL_NAME = "mamba_scan_forward"  # transformers' use_kernel_forward_from_hub name of the swapped function


def chunk_length(channels: int, state_size: int, budget: int = CHUNK_BUDGET) -> int:
    """The longest power-of-two chunk (at most :data:`MAX_CHUNK`) whose float32 decay matrix
    ``[channels, state_size, L, L]`` fits ``budget`` bytes."""
    fit = math.isqrt(max(budget // (4 * channels * state_size), 1))
    return max(1, min(MAX_CHUNK, 1 << (fit.bit_length() - 1)))


def _chunk(h: torch.Tensor, dt, x, b, c, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: ``h [B, D, N]`` the state before it, ``dt``/``x [B, D, L]``, ``b``/``c [B, N, L]``,
    ``a [D, N]``. Returns ``(y [B, D, L], h after the chunk)``, float32."""
    length = dt.shape[-1]
    cum = torch.cumsum(dt[:, :, None, :] * a[None, :, :, None], dim=-1)  # (B, D, N, L)
    causal = torch.ones(length, length, dtype=torch.bool, device=dt.device).tril()  # (L_t, L_s)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))  # (B, D, N, L, L)
    inputs = (dt * x)[:, :, None, :] * b[:, None, :, :]  # (B, D, N, L)
    states = torch.exp(cum) * h[..., None] + (decay @ inputs[..., None]).squeeze(-1)  # (B, D, N, L)
    return (states * c[:, None, :, :]).sum(2), states[..., -1]


@torch.library.custom_op("kvforge::selective_scan", mutates_args=())
def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba's selective scan in chunks of ``chunk`` tokens, in float32.

    x ``[B, D, S]``, dt ``[B, D, S]`` (after the bias and softplus; 0 where a row has no real
    token), a ``[D, N]`` (negative), b/c ``[B, S, N]``, h0 ``[B, D, N]`` the state before the
    first token. Returns ``(y [B, D, S], h [B, D, N])``: ``y_t = h_t·C_t`` (no ``D`` skip, no
    gate) and the state after the last token."""
    seq = x.shape[-1]
    length = min(seq, chunk)
    h, ys = h0.float(), []
    bt, ct = b.float().transpose(1, 2), c.float().transpose(1, 2)  # (B, N, S)
    for start in range(0, seq, length):
        window = slice(start, start + length)
        y, h = _chunk(h, dt[..., window].float(), x[..., window].float(), bt[..., window], ct[..., window], a.float())
        ys.append(y)
    return torch.cat(ys, -1), h


@selective_scan.register_fake
def _(x, dt, a, b, c, h0, chunk):
    return x.new_empty(x.shape, dtype=torch.float32), h0.new_empty(h0.shape, dtype=torch.float32)


def _onnx_translation() -> Callable:
    """The scan in standard ONNX ops (opset 24, imported lazily: export-time only): the inputs
    padded to whole chunks and split (``Reshape``/``Transpose``), one ``Scan`` over the chunks
    whose body is :func:`_chunk`'s math (``CumSum``, ``Where``, ``Exp``, ``MatMul``), the outputs
    joined and cut back to ``S``."""
    from onnxscript import values

    op = values.Opset("", 24)
    scan = values.Op(op, "Scan", _scan_schema())

    def ints(*values_: int):
        return op.Constant(value_ints=list(values_))

    def selective_scan_onnx(x, dt, a, b, c, h0, chunk: int):
        seq = op.Shape(x, start=2, end=3)  # (1,)
        length = op.Min(seq, ints(chunk))  # min(S, chunk): one token per chunk in decode
        count = op.Div(op.Sub(op.Add(seq, length), ints(1)), length)  # chunks: ceil(S / L)
        pad = op.Sub(op.Mul(count, length), seq)
        zero2 = ints(0, 0)
        # time axes last: x, dt (B, D, S); b, c -> (B, N, S); padded with zeros to count * L
        b_t, c_t = op.Transpose(b, perm=[0, 2, 1]), op.Transpose(c, perm=[0, 2, 1])
        pads = op.Concat(zero2, ints(0), zero2, pad, axis=0)  # [0, 0, 0, 0, 0, pad]
        split = op.Concat(zero2, count, length, axis=0)  # (B, D|N, count, L)

        def chunks(t):  # (B, C, S) -> (count, B, C, L)
            return op.Transpose(op.Reshape(op.Pad(t, pads), split), perm=[2, 0, 1, 3])

        steps = op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1))  # (L,)
        causal = op.GreaterOrEqual(op.Unsqueeze(steps, ints(1)), op.Unsqueeze(steps, ints(0)))  # (L_t, L_s)
        body = _scan_body(a, causal, op.Sub(length, ints(1)))
        h, ys = scan(h0, chunks(dt), chunks(x), chunks(b_t), chunks(c_t), body=body, num_scan_inputs=4)
        # ys (count, B, D, L)
        joined = op.Reshape(op.Transpose(ys, perm=[1, 2, 0, 3]), ints(0, 0, -1))  # (B, D, count * L)
        return op.Slice(joined, ints(0), seq, ints(2)), h

    return selective_scan_onnx


def _scan_schema():
    """ONNX ``Scan`` with this kernel's arity (one state, four scanned inputs, two outputs): the
    exporter reads the number of outputs of a traced call from the schema, and Scan's own is
    variadic."""
    from onnx.defs import OpSchema

    param, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    return OpSchema(
        "Scan",
        "",
        24,
        inputs=[param(n, "T") for n in ("h0", "dt", "x", "b", "c")],
        outputs=[param(n, "T") for n in ("h", "y")],
        type_constraints=[("T", ["tensor(float)"], "float32 state and chunks")],
        attributes=[attr("body", kind.GRAPH, "one chunk"), attr("num_scan_inputs", kind.INT, "scanned inputs")],
    )


def _scan_body(a, causal, last_step):
    """The ``Scan`` body graph: state ``h [B, D, N]`` and one chunk of ``dt``/``x [B, D, L]`` and
    ``b``/``c [B, N, L]`` in; the next state and ``y [B, D, L]`` out. Outer-scope values: ``a [D,
    N]``, ``causal [L, L]`` bool (``t >= s``) and ``last_step`` (``[1]`` int64, ``L - 1``): the
    shape arithmetic stays outside the loop (ONNX's shape inference cannot propagate values from
    the outer scope into a body)."""
    import numpy as np
    import onnx_ir as ir

    f32 = ir.TensorType(ir.DataType.FLOAT)
    h = ir.Value(name="mamba_scan_h", type=f32, shape=ir.Shape([None, None, None]))
    dt, x, b, c = (
        ir.Value(name=f"mamba_scan_{n}", type=f32, shape=ir.Shape([None, None, None])) for n in ("dt", "x", "b", "c")
    )
    nodes: list[ir.Node] = []

    def node(op_type: str, *inputs, **attributes) -> ir.Value:
        n = ir.node(op_type, list(inputs), attributes or None, name=f"mamba_scan/{op_type}_{len(nodes)}")
        n.outputs[0].name = f"mamba_scan/{op_type}_{len(nodes)}_output"
        nodes.append(n)
        return n.outputs[0]

    def const(value, dtype=None) -> ir.Value:
        return node("Constant", value=ir.tensor(value, dtype=dtype))

    axis2, last = const(np.array([2])), const(np.array([-1]))
    a4 = node("Unsqueeze", a, const(np.array([0, 3])))  # (1, D, N, 1)
    cum = node("CumSum", node("Mul", node("Unsqueeze", dt, axis2), a4), const(np.array(-1)))  # (B, D, N, L)
    one = const(np.array([1]))
    diff = node("Sub", node("Unsqueeze", cum, last), node("Unsqueeze", cum, const(np.array([-2]))))  # (B, D, N, L, L)
    minus_inf = const(np.array(-np.inf, dtype=np.float32))
    decay = node("Exp", node("Where", causal, diff, minus_inf))
    inputs = node("Mul", node("Unsqueeze", node("Mul", dt, x), axis2), node("Unsqueeze", b, one))  # (B, D, N, L)
    carried = node("Mul", node("Exp", cum), node("Unsqueeze", h, last))  # (B, D, N, L)
    states = node("Add", carried, node("Squeeze", node("MatMul", decay, node("Unsqueeze", inputs, last)), last))
    y = node("ReduceSum", node("Mul", states, node("Unsqueeze", c, one)), axis2, keepdims=0)  # (B, D, L)
    h_next = node("Squeeze", node("Gather", states, last_step, axis=3), last)  # (B, D, N)
    return ir.Graph([h, dt, x, b, c], [h_next, y], nodes=nodes, name="mamba_chunk_scan")


def _linear_attention_schema():
    """The part of ORT's ``com.microsoft.LinearAttention`` schema (ORT >= 1.32) that the exporter
    needs to trace a call (onnx ships no schemas for ONNX Runtime's contrib ops)."""
    from onnx.defs import OpSchema

    param, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    maybe = OpSchema.FormalParameterOption.Optional
    return OpSchema(
        "LinearAttention",
        "com.microsoft",
        1,
        inputs=[param(n, "T") for n in ("query", "key", "value")]
        + [param(n, "T", "", param_option=maybe) for n in ("past_state", "decay", "beta")],
        outputs=[param(n, "T") for n in ("output", "present_state")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and state")],
        attributes=[
            attr("q_num_heads", kind.INT, "query heads"),
            attr("kv_num_heads", kind.INT, "key/value heads"),
            attr("update_rule", kind.STRING, "linear, gated, delta or gated_delta", required=False),
            attr("scale", kind.FLOAT, "output scale", required=False),
        ],
    )


def _linear_attention_translation() -> Callable:
    """The scan as ONNX Runtime's ``com.microsoft.LinearAttention`` (the ``gqa`` lowering): the
    recurrence ``h = exp(dt·A) ⊙ h + dt·x·B``, ``y = h·C`` per channel is the op's
    ``update_rule="gated"`` (``S = exp(g) ⊙ S + k vᵀ``, ``o = qᵀ S``) with each of the ``D``
    channels a head of ``Dk = N`` and ``Dv = 1``: ``k = B`` and ``q = C`` (shared by every channel,
    spread to each by ``Expand``), ``v = dt·x``, the log decay ``dt·A`` per key channel (as KDA's),
    the state ``[B, D, N]`` viewed as the op's ``[B, D, N, 1]``. One node for every length, chunked
    inside the op: one layer of Mamba-130m's shape (D = 1536, N = 16, batch 1, 2 threads) 0.36
    against the ``Scan`` form's 3.2 ms a token, 15 against 178 ms at 128 tokens, 96 against 736
    at 512 (benchmarks/FINDINGS.md)."""
    from onnxscript import values

    op = values.Opset("", 24)
    linear_attention = values.Op(values.Opset("com.microsoft", 1), "LinearAttention", _linear_attention_schema())

    def ints(*values_: int):
        return op.Constant(value_ints=list(values_))

    def selective_scan_linear_attention(x, dt, a, b, c, h0, chunk: int):
        channels = a.shape[0]  # static
        flat = ints(0, 0, -1)
        dt_t = op.Transpose(dt, perm=[0, 2, 1])  # (B, S, D)
        value = op.Mul(op.Transpose(x, perm=[0, 2, 1]), dt_t)  # (B, S, D): D heads of one value

        def per_channel(t):  # (B, S, N) -> (B, S, D * N)
            return op.Reshape(op.Expand(op.Unsqueeze(t, ints(2)), ints(1, 1, channels, 1)), flat)

        log_decay = op.Reshape(op.Mul(op.Unsqueeze(dt_t, ints(3)), a), flat)  # (B, S, D * N)
        output, final = linear_attention(
            per_channel(c),
            per_channel(b),
            value,
            op.Unsqueeze(h0, ints(3)),
            log_decay,
            q_num_heads=channels,
            kv_num_heads=channels,
            update_rule="gated",
            scale=1.0,
            _outputs=2,
        )
        return op.Transpose(output, perm=[0, 2, 1]), op.Squeeze(final, ints(3))

    return selective_scan_linear_attention


def translation_table(fast: bool = False) -> dict:
    """``custom_translation_table`` entries for the selective scan: one ``Scan`` over chunks in
    standard ops, or (``fast``: the ``gqa`` lowering, ONNX Runtime only) one ``LinearAttention``."""
    translation = _linear_attention_translation() if fast else _onnx_translation()
    return {torch.ops.kvforge.selective_scan.default: translation}


# ------------------------------------------------------------------------------ the swapped kernel


class ChunkedMambaScan(torch.nn.Module):
    """The kernel ``kernels.kernelize`` puts in place of transformers' ``mamba_scan_forward``
    (same signature; stateless, as the ``kernels`` package requires of a layer)."""

    def forward(self, module, hidden_states, time_step, B, C, gate, cache, **kwargs):
        """hidden_states, time_step (before ``dt_proj.bias`` and softplus), gate ``[B, D, S]``; B, C
        ``[B, S, N]``; cache: the trace's :class:`~kvforge.graphs.state.ExportStateCache` (or None:
        a zero state, every token real). Returns the gated output ``[B, D, S]`` with the ``D``
        skip, and records the layer's new state in the cache."""
        batch, channels, seq = hidden_states.shape
        a = -torch.exp(module.A_log.float())  # (D, N)
        dt = time_step.float()
        if module.dt_proj.bias is not None:
            dt = dt + module.dt_proj.bias.float()[:, None]
        dt = torch.nn.functional.softplus(dt)  # (B, D, S)
        active = state.current()
        if active is not None:  # padding after a row's real tokens leaves its state unchanged
            real = torch.arange(seq, device=dt.device)[None, :] < active.lengths[:, None]  # (B, S)
            dt = dt * real[:, None, :]
        h0 = cache.get_recurrent_state(module.layer_idx) if cache is not None else None
        if h0 is None:  # no cache, or transformers' own before its first update: a zero state
            h0 = torch.zeros(batch, channels, a.shape[-1], dtype=torch.float32, device=dt.device)
        chunk = chunk_length(channels, a.shape[-1])
        x = hidden_states.float()  # the scan runs in float32 whatever the model's dtype, as transformers' does
        y, h = torch.ops.kvforge.selective_scan(x, dt, a, B.float(), C.float(), h0.float(), chunk)
        y = y + x * module.D.float()[None, :, None]
        y = y * torch.nn.functional.silu(gate.float())
        if cache is not None:
            cache.update_recurrent_state(h, module.layer_idx)
        return y.to(hidden_states.dtype)


def use_chunked_scan(model: torch.nn.Module) -> None:
    """Swap :class:`ChunkedMambaScan` into every Mamba mixer of ``model`` (a transformers model of
    a family whose mixers call ``mamba_scan_forward``), and kvforge's causal convolution
    (:data:`kvforge.graphs.state.CONV_KERNELS`: one node whose one-token branch is products over
    the window, where ORT's depthwise ``Conv`` runs a channel at a time) where the mixers call
    ``causal_conv1d_forward``, with ``kernels.kernelize`` and a mapping of those names alone; the
    model's other kernel hooks keep their forwards. Raises when no mixer took the scan (a
    transformers version whose mixers no longer expose the hook)."""
    swapped = kernel_swap.kernelize(model, {KERNEL_NAME: ChunkedMambaScan, **state.CONV_KERNELS})[KERNEL_NAME]
    if not swapped:
        raise RuntimeError(
            f"no layer of {type(model).__name__} exposes transformers' {KERNEL_NAME!r} kernel hook, where kvforge "
            "swaps in its chunked selective scan; this transformers version is not one kvforge was tested with"
        )
