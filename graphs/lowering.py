"""Attention lowerings: one torch custom op per cached-attention layer, plus its ONNX translations.

The export wrappers run transformers' own modules with the attention function registered here
(``attn_implementation="kvforge"``). transformers hands that function the post-RoPE query, key and
value of one layer; the function passes them, with the layer's past cache, to the custom op
``kvforge::cached_attention``, which is opaque to the exporter. ``torch.onnx.export`` then replaces
the op with the translation of the chosen lowering:

* ``onnx``: opset-24 ``TensorScatter`` (axis -2) for the cache update and ``Attention`` with a
  boolean mask. TensorRT >= 10.15 parses both; ORT's CPU provider runs them in place. A layer with
  an attention logit soft-cap (Gemma-2) spells its attention out in MatMul/Tanh/Where/Softmax
  instead, because TensorRT's parser rejects ``Attention``'s ``softcap`` attribute.
* ``gqa``: ONNX Runtime's ``com.microsoft.GroupQueryAttention`` with the past and present caches
  in one shared buffer (ORT's fast path, CPU and CUDA). It derives its lengths from the same
  inputs: ``seqlens_k[b] = write_indices[b] + S - 1`` (the index of the row's last new token;
  right padding counts as tokens, is written, never attended by a real token, and is overwritten
  later) and ``total_sequence_length = max(seqlens_k) + 1``. A sliding window of ``w`` tokens
  (transformers: keys ``(i - w, i]``) is ``local_window_size = w``, checked against transformers.
  The state layers' recurrences take ORT's path here too: ``com.microsoft.LinearAttention``
  for the delta rules (:func:`kvforge.graphs.gated_delta_onnx.ort_linear_attention`) and for
  Mamba2's scan (:func:`kvforge.graphs.gated_delta_onnx.ort_mamba2_scan`), where ``onnx`` and
  ``exact`` keep them in standard ops.
* ``exact``: ``onnx``'s ``TensorScatter`` cache update, with the attention spelled out in standard
  ops (:func:`_exact_attention`) so that a call of S tokens gives each token bit for bit what a
  one-token call gives: speculative verification then reproduces plain decoding exactly, in
  float32 and in int4 (issue 23). ORT's ``Attention`` and ``GroupQueryAttention`` multiply one
  query row per head (M = S); at M = 1 MLAS takes its matrix-vector kernel, whose float32 sums
  differ from the M > 1 kernel's in the last bits. The same holds for int4 blocks (``MatMulNBits``)
  on some CPUs, so compile gives each of an ``exact`` artifact's a zero row when its call has one
  (:func:`kvforge.compile.quantize.never_one_row`).

Attention sinks (``s_aux``: GPT-OSS, Granite-SWA, MiMo-V2-Flash, Flint; one softmax logit per query
head that attends no value, :func:`reference.attention`) reach the op as its ``sinks`` input. ``onnx``
and ``exact`` spell such a layer out, concatenating the sink column before ``Softmax`` and slicing it
off after (``Attention`` has no sinks); ``gqa`` passes them as ``GroupQueryAttention``'s ``head_sink``.

8-bit KV (``--kv-dtype int8``): the layer's cache is int8 with a float32 scale per row and head
(:mod:`kvforge.graphs.contract`), and the attention function calls ``kvforge::cached_attention_int8``
instead: it quantizes the new key and value rows (:func:`reference.quantize_rows`), scatters codes
and scales into their caches (``TensorScatter``, as above), and reads only the filled rows
``[0, max(write_indices) + S)`` (``Slice``): ``onnx`` casts their codes to floats and folds the
scales into the scores and the probabilities (:func:`_scaled_attention`: no dequantized copy of
the cache); ``exact`` dequantizes them (``Cast``, ``Mul``) for its own attention. ``gqa`` has no
int8 translation: ORT's ``GroupQueryAttention`` takes a float cache only, so compile refuses
``--lowering gqa`` with int8 KV and defaults to ``onnx``.

The op is functional (it returns new present tensors, it never mutates its inputs) because the
exporter requires it; "in place" is a property of the runtime binding (past and present share a
buffer), not of the graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from kvforge.graphs import reference

LOWERINGS = ("onnx", "gqa", "exact")


@torch.library.custom_op("kvforge::cached_attention", mutates_args=())
def cached_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    write_indices: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's cache update and attention.

    query ``[B, H_q, S, D]``, key/value ``[B, H_kv, S, D]`` (post-RoPE), past_key/past_value
    ``[B, H_kv, S_max, D]``, write_indices ``[B]`` int64, mask ``[B, 1, S, S_max]`` bool (which
    already encodes ``window``, the sliding window in tokens or 0; the ``gqa`` lowering needs it as
    a number), sinks ``[H_q]`` the layer's attention sinks or None (:func:`reference.attention`).
    Returns ``(output [B, H_q, S, D], present_key, present_value)``.
    """
    present_key = reference.update(past_key, key, write_indices)
    present_value = reference.update(past_value, value, write_indices)
    output = reference.attention(query, present_key, present_value, mask, scale, softcap, sinks)
    return output, present_key, present_value


@cached_attention.register_fake
def _(query, key, value, past_key, past_value, write_indices, mask, scale, softcap, window, sinks=None):
    # Contiguous like the real op's outputs (empty_like would copy the strides of a transposed query)
    return query.new_empty(query.shape), past_key.new_empty(past_key.shape), past_value.new_empty(past_value.shape)


@torch.library.custom_op("kvforge::cached_attention_int8", mutates_args=())
def cached_attention_int8(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    past_key_scale: torch.Tensor,
    past_value_scale: torch.Tensor,
    write_indices: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cached_attention` over an 8-bit cache: past_key/past_value ``[B, H_kv, S_max, D]``
    int8, past_key_scale/past_value_scale ``[B, H_kv, S_max, 1]`` float32; key/value in the
    model's dtype, quantized per row and head on write (:func:`reference.quantize_rows`), the
    cache dequantized on read. Returns ``(output, present_key, present_value, present_key_scale,
    present_value_scale)``."""
    key_codes, key_scale = reference.quantize_rows(key)
    value_codes, value_scale = reference.quantize_rows(value)
    present_key = reference.update(past_key, key_codes, write_indices)
    present_value = reference.update(past_value, value_codes, write_indices)
    present_key_scale = reference.update(past_key_scale, key_scale, write_indices)
    present_value_scale = reference.update(past_value_scale, value_scale, write_indices)
    keys = reference.dequantize_rows(present_key, present_key_scale, query.dtype)
    values = reference.dequantize_rows(present_value, present_value_scale, query.dtype)
    output = reference.attention(query, keys, values, mask, scale, softcap, sinks)
    return output, present_key, present_value, present_key_scale, present_value_scale


@cached_attention_int8.register_fake
def _(query, key, value, past_key, past_value, past_key_scale, past_value_scale, *args, **kwargs):
    return (
        query.new_empty(query.shape),
        past_key.new_empty(past_key.shape),
        past_value.new_empty(past_value.shape),
        past_key_scale.new_empty(past_key_scale.shape),
        past_value_scale.new_empty(past_value_scale.shape),
    )


def _int8_translation(exact: bool = False) -> Callable:
    """``kvforge::cached_attention_int8`` in standard ops, for the ``onnx`` (``exact``: the
    ``exact``) lowering: quantize (:func:`reference.quantize_rows`), ``TensorScatter`` the codes and
    scales, dequantize the filled rows ``[0, T)``, ``T = max(write_indices) + S``, then the lowering's
    attention on them."""
    from onnxscript import ir, values

    op = values.Opset("", 24)

    def quantize(x, name: str):
        xf = op.Cast(x, to=ir.DataType.FLOAT)
        amax = op.ReduceMax(op.Abs(xf), op.Constant(value_ints=[-1]), keepdims=1)  # (B, H_kv, S, 1)
        scale = _named(op.Div(amax, op.Constant(value_float=127.0)), f"attention/{name}/scale")
        safe = op.Max(scale, op.Constant(value_float=reference.SCALE_FLOOR))
        low, high = op.Constant(value_float=-127.0), op.Constant(value_float=127.0)
        codes = _named(
            op.Cast(op.Clip(op.Round(op.Div(xf, safe)), low, high), to=ir.DataType.INT8), f"attention/{name}/codes"
        )
        return codes, scale

    def live_rows(codes, scale, live):
        start, axis = op.Constant(value_ints=[0]), op.Constant(value_ints=[2])
        return op.Slice(codes, start, live, axis), op.Slice(scale, start, live, axis)  # (B, H_kv, T, D|1)

    def dequantize(codes, scale, like, name: str):
        rows = op.Mul(op.Cast(codes, to=ir.DataType.FLOAT), scale)
        return _named(op.CastLike(rows, like), f"attention/{name}/dequantized")

    def cached_attention_int8_onnx(
        query,
        key,
        value,
        past_key,
        past_value,
        past_key_scale,
        past_value_scale,
        write_indices,
        mask,
        scale,
        softcap,
        window,
        sinks=None,
    ):
        key_codes, key_scale = quantize(key, "key")
        value_codes, value_scale = quantize(value, "value")
        present_key = op.TensorScatter(past_key, key_codes, write_indices, axis=-2)
        present_value = op.TensorScatter(past_value, value_codes, write_indices, axis=-2)
        present_key_scale = op.TensorScatter(past_key_scale, key_scale, write_indices, axis=-2)
        present_value_scale = op.TensorScatter(past_value_scale, value_scale, write_indices, axis=-2)
        kv_heads = past_key.shape[1]  # static
        live = op.Add(op.ReduceMax(write_indices, keepdims=1), op.Shape(query, start=2, end=3))  # (1,): T
        key_codes, key_scale = live_rows(present_key, present_key_scale, live)  # (B, H_kv, T, D), (B, H_kv, T, 1)
        value_codes, value_scale = live_rows(present_value, present_value_scale, live)
        live_mask = op.Slice(mask, op.Constant(value_ints=[0]), live, op.Constant(value_ints=[3]))  # (B, 1, S, T)
        if exact:
            keys = dequantize(key_codes, key_scale, query, "key")  # (B, H_kv, T, D)
            values = dequantize(value_codes, value_scale, query, "value")
            output = _exact_attention(
                op, query, keys, values, write_indices, live_mask, scale, softcap, kv_heads, sinks
            )
        else:
            output = _scaled_attention(
                op, query, key_codes, key_scale, value_codes, value_scale, live_mask, scale, softcap, kv_heads, sinks
            )
        return output, present_key, present_value, present_key_scale, present_value_scale

    return cached_attention_int8_onnx


def _scaled_attention(
    op, query, key_codes, key_scale, value_codes, value_scale, mask, scale: float, softcap: float, kv_heads: int, sinks
):
    """:func:`_spelled_attention` over int8 rows whose scales are folded into the scores and the
    probabilities instead of into the rows: ``q·(c_t·s_t) = s_t·(q·c_t)`` and
    ``Σ p_t·(c_t·s_t) = Σ (p_t·s_t)·c_t``, so the only pass over the cache is the ``Cast`` of its
    codes (after a ``Transpose`` of the int8 keys, a quarter of the bytes of a float transpose);
    the scales multiply ``[.., T]`` vectors. key_codes/value_codes ``[B, H_kv, T, D]`` int8,
    key_scale/value_scale ``[B, H_kv, T, 1]`` float32, mask ``[B, 1, S, T]``; output
    ``[B, H_q, S, D]`` in the query's dtype."""
    from onnxscript import ir

    num_heads, head_dim = query.shape[1], query.shape[3]  # static ints
    model_dtype = query.dtype
    group_axis = op.Constant(value_ints=[2])
    per_key = op.Constant(value_ints=[0, 0, 1, 1, -1])  # (B, H_kv, T, 1) -> (B, H_kv, 1, 1, T): a free reshape
    grouped = op.Reshape(query, op.Constant(value_ints=[0, kv_heads, num_heads // kv_heads, -1, head_dim]))
    grouped = _named(grouped, "attention/int8/group_query_heads")  # (B, H_kv, G, S, D)
    keys_t = _named(op.Transpose(key_codes, perm=[0, 1, 3, 2]), "attention/int8/keys_transposed")  # (B, H_kv, D, T)
    keys_t = _named(op.CastLike(op.Unsqueeze(keys_t, group_axis), query), "attention/int8/keys")  # (B, H_kv, 1, D, T)
    values = _named(op.CastLike(op.Unsqueeze(value_codes, group_axis), query), "attention/int8/values")
    scores = _named(op.MatMul(grouped, keys_t), "attention/int8/qk")  # (B, H_kv, G, S, T) in codes
    key_scale = op.Mul(op.Reshape(key_scale, per_key), op.Constant(value_float=scale))  # (B, H_kv, 1, 1, T)
    scores = _named(op.Mul(scores, op.CastLike(key_scale, query)), "attention/int8/scale")
    if softcap > 0.0:
        cap = op.CastLike(op.Constant(value_float=softcap), query)
        scores = _named(op.Mul(op.Tanh(op.Div(scores, cap)), cap), "attention/int8/softcap")
    if model_dtype != ir.DataType.FLOAT:  # transformers' softmax upcasts to float32
        scores = _named(op.Cast(scores, to=ir.DataType.FLOAT), "attention/int8/softmax/upcast")
    allowed = _named(op.Unsqueeze(mask, op.Constant(value_ints=[1])), "attention/int8/mask_per_group")
    masked = _named(op.Where(allowed, scores, op.Constant(value_float=float("-inf"))), "attention/int8/mask")
    if sinks is not None:
        column = op.Reshape(sinks, op.Constant(value_ints=[1, kv_heads, num_heads // kv_heads, 1, 1]))
        probs = _with_sinks(op, masked, column, "attention/int8")
    else:
        probs = _named(op.Softmax(masked, axis=-1), "attention/int8/softmax")
    probs = _named(op.Mul(probs, op.Reshape(value_scale, per_key)), "attention/int8/value_scale")  # float32
    if model_dtype != ir.DataType.FLOAT:
        probs = _named(op.Cast(probs, to=model_dtype), "attention/int8/softmax/downcast")
    output = _named(op.MatMul(probs, values), "attention/int8/pv")  # (B, H_kv, G, S, D)
    return op.Reshape(output, op.Constant(value_ints=[0, num_heads, -1, head_dim]))  # (B, H_q, S, D)


def _onnx_translation(exact: bool = False) -> Callable:
    """The ``onnx`` lowering (``exact``: the ``exact`` one), written with onnxscript (imported
    lazily: export-time only)."""
    from onnxscript import values

    op = values.Opset("", 24)

    def cached_attention_onnx(
        query, key, value, past_key, past_value, write_indices, mask, scale, softcap, window, sinks=None
    ):
        present_key = op.TensorScatter(past_key, key, write_indices, axis=-2)
        present_value = op.TensorScatter(past_value, value, write_indices, axis=-2)
        if exact:
            kv_heads = past_key.shape[1]  # static (the TensorScatter outputs carry no shape yet)
            output = _exact_attention(
                op, query, present_key, present_value, write_indices, mask, scale, softcap, kv_heads, sinks
            )
            return output, present_key, present_value
        # TensorRT's parser rejects Attention's softcap attribute, and Attention has no sinks: spell it out
        if softcap > 0.0 or sinks is not None:
            kv_heads = past_key.shape[1]  # static (the TensorScatter outputs carry no shape yet)
            output = _spelled_attention(op, query, present_key, present_value, mask, scale, softcap, kv_heads, sinks)
            return output, present_key, present_value
        # Attention returns (Y, present_key, present_value, qk_matmul_output); only Y is used.
        output = op.Attention(query, present_key, present_value, mask, scale=scale)
        return output[0], present_key, present_value

    return cached_attention_onnx


def _named(value, name: str):
    """Name the node that produces ``value`` (export prefixes the module scope:
    ``/model/layers.0/self_attn/<name>``) and return the value."""
    value.producer().name = name
    return value


def _spelled_attention(op, query, key, value, mask, scale: float, softcap: float, kv_heads: int, sinks=None):
    """Grouped-query attention with a soft-cap or attention sinks in standard ONNX ops, for the
    ``onnx`` lowering.

    Same inputs and output as ``Attention(query, key, value, mask, scale=scale, softcap=softcap)``:
    query ``[B, H_q, S, D]``; key/value the present caches ``[B, H_kv, S_max, D]``, ``H_kv`` given
    as ``kv_heads``; mask ``[B, 1, S, S_max]`` bool, True = attend; output ``[B, H_q, S, D]`` in
    the model's dtype. Written in ops that TensorRT's ONNX parser takes, in the order and dtypes of
    transformers' eager attention of Gemma-2: ``(Q·Kᵀ)·scale`` and ``softcap·tanh(scores/softcap)``
    in the model's dtype (``softcap`` 0: none), then the mask, softmax in float32, cast back to the
    model's dtype, ``·V``. Masked keys get ``-inf``, as ``Attention`` does for a boolean mask. (A
    fully masked row would give NaN here and 0 there; the contract's mask always lets a query
    attend its own cache row.)

    ``sinks`` ``[H_q]`` (GPT-OSS): the masked scores gain a column holding each head's sink, the
    softmax runs over it, and the column is sliced off before ``·V`` (:func:`_with_sinks`).

    GQA: the query heads are grouped per KV head (``[B, H_kv, G, S, D]``, a free reshape) and the
    cache gains a broadcast axis (``[B, H_kv, 1, S_max, D]``), so the cache is never copied per
    group, as expanding K/V to ``H_q`` heads would do at every step.
    """
    from onnxscript import ir

    num_heads, head_dim = query.shape[1], query.shape[3]  # static ints
    model_dtype = query.dtype
    group_axis = op.Constant(value_ints=[2])
    grouped = op.Reshape(query, op.Constant(value_ints=[0, kv_heads, num_heads // kv_heads, -1, head_dim]))
    grouped = _named(grouped, "attention/group_query_heads")  # (B, H_kv, G, S, D)
    keys_t = _named(op.Transpose(key, perm=[0, 1, 3, 2]), "attention/keys_transposed")  # (B, H_kv, D, S_max)
    keys_t = _named(op.Unsqueeze(keys_t, group_axis), "attention/keys_per_group")  # (B, H_kv, 1, D, S_max)
    values = _named(op.Unsqueeze(value, group_axis), "attention/values_per_group")  # (B, H_kv, 1, S_max, D)

    scores = _named(op.MatMul(grouped, keys_t), "attention/qk")  # (B, H_kv, G, S, S_max)
    scores = _named(op.Mul(scores, op.CastLike(op.Constant(value_float=scale), query)), "attention/scale")
    capped = scores
    if softcap > 0.0:
        cap = op.CastLike(op.Constant(value_float=softcap), query)
        capped = _named(op.Div(scores, cap), "attention/softcap/div")
        capped = _named(op.Tanh(capped), "attention/softcap/tanh")
        capped = _named(op.Mul(capped, cap), "attention/softcap/mul")
    if model_dtype != ir.DataType.FLOAT:  # transformers' softmax upcasts to float32
        capped = _named(op.Cast(capped, to=ir.DataType.FLOAT), "attention/softmax/upcast")
    allowed = _named(op.Unsqueeze(mask, op.Constant(value_ints=[1])), "attention/mask_per_group")  # (B, 1, 1, S, S_max)
    masked = _named(op.Where(allowed, capped, op.Constant(value_float=float("-inf"))), "attention/mask")
    if sinks is not None:
        column = op.Reshape(sinks, op.Constant(value_ints=[1, kv_heads, num_heads // kv_heads, 1, 1]))
        probs = _with_sinks(op, masked, column)
    else:
        probs = _named(op.Softmax(masked, axis=-1), "attention/softmax")
    if model_dtype != ir.DataType.FLOAT:
        probs = _named(op.Cast(probs, to=model_dtype), "attention/softmax/downcast")
    output = _named(op.MatMul(probs, values), "attention/pv")  # (B, H_kv, G, S, D)
    return op.Reshape(output, op.Constant(value_ints=[0, num_heads, -1, head_dim]))  # (B, H_q, S, D)


def _with_sinks(op, scores, sinks, prefix: str = "attention"):
    """``Softmax`` of float32 ``scores`` ``[..., T]`` joined by one sink logit per row, without the
    sink's column: ``sinks`` broadcasts to ``scores[..., :1]`` (one value per head). Concat, Softmax
    and Slice, as transformers' eager attention of GPT-OSS computes it (the max it subtracts first
    changes nothing but rounding; ``Softmax`` subtracts the row's max itself). The sink's column
    comes first, not last as in transformers: every key keeps one column whatever ``T`` is, so the
    ``exact`` lowering's sums do not depend on how many keys a call reads."""
    from onnxscript import ir

    column_shape = op.Concat(op.Shape(scores, start=0, end=-1), op.Constant(value_ints=[1]), axis=0)
    column = op.Expand(op.Cast(sinks, to=ir.DataType.FLOAT), column_shape)  # (..., 1)
    joined = _named(op.Concat(column, scores, axis=-1), f"{prefix}/sinks/concat")  # (..., 1 + T)
    probs = _named(op.Softmax(joined, axis=-1), f"{prefix}/softmax")
    first, end, last = op.Constant(value_ints=[1]), op.Constant(value_ints=[2**62]), op.Constant(value_ints=[-1])
    return _named(op.Slice(probs, first, end, last), f"{prefix}/sinks/drop")  # (..., T)


def _exact_attention(
    op, query, key, value, write_indices, mask, scale: float, softcap: float, kv_heads: int, sinks=None
):
    """Grouped-query attention whose result for each query token does not depend on how many
    tokens the call holds (the ``exact`` lowering).

    Same inputs and output as :func:`_spelled_attention` (``softcap`` 0: none; ``sinks`` None:
    none), plus ``write_indices``. Every query head of one KV head and every token of the call are the rows of
    ONE matrix product per KV head, ``(B, H_kv, G·S, D) · (B, H_kv, D, T)`` over the filled cache
    rows ``T = max(write_indices) + S``: M = G·S is never 1 (a model without grouping, G = 1, has
    its query rows doubled), so MLAS never takes its M = 1 kernel; its M > 1 kernel computes each
    row the same way whatever M is; ``P·V``'s K-blocks start at fixed multiples whatever T is, a
    masked key adds an exact zero, and the mask, softmax (trailing ``-inf`` change nothing) and
    scale act on each row alone. Measured in float32 (fp32 and int4 artifacts): every row of calls
    of 2 … 33 tokens equals a one-token call's, 0.0 difference (benchmarks/FINDINGS.md: "Bit identity").
    """
    from onnxscript import ir

    num_heads, head_dim = query.shape[1], query.shape[3]  # static ints
    groups = num_heads // kv_heads
    model_dtype = query.dtype
    rows = op.Reshape(query, op.Constant(value_ints=[0, kv_heads, -1, head_dim]))  # (B, H_kv, G·S, D): heads kv-major
    rows = _named(rows, "attention/exact/query_rows")
    if groups == 1:  # M = S would be 1 in a one-token call: double the rows, drop the copy at the end
        rows, groups = _named(op.Concat(rows, rows, axis=2), "attention/exact/double_rows"), 2
    # Only the keys some query of the call attends, [0, T) with T = max(write_indices) + S: the
    # sums do not depend on T (masked keys add exact zeros; MLAS's K-blocks start at fixed multiples)
    live = op.Add(op.ReduceMax(write_indices, keepdims=1), op.Shape(query, start=2, end=3))  # (1,): T
    start, axis = op.Constant(value_ints=[0]), op.Constant(value_ints=[2])
    key = _named(op.Slice(key, start, live, axis), "attention/exact/live_keys")  # (B, H_kv, T, D)
    value = _named(op.Slice(value, start, live, axis), "attention/exact/live_values")  # (B, H_kv, T, D)
    mask = _named(op.Slice(mask, start, live, op.Constant(value_ints=[3])), "attention/exact/live_mask")
    keys_t = _named(op.Transpose(key, perm=[0, 1, 3, 2]), "attention/exact/keys_transposed")  # (B, H_kv, D, T)
    scores = _named(op.MatMul(rows, keys_t), "attention/exact/qk")  # (B, H_kv, G·S, T)
    scores = _named(op.Mul(scores, op.CastLike(op.Constant(value_float=scale), query)), "attention/exact/scale")
    if softcap > 0.0:
        cap = op.CastLike(op.Constant(value_float=softcap), query)
        scores = _named(op.Mul(op.Tanh(op.Div(scores, cap)), cap), "attention/exact/softcap")
    if model_dtype != ir.DataType.FLOAT:  # transformers' softmax upcasts to float32
        scores = _named(op.Cast(scores, to=ir.DataType.FLOAT), "attention/exact/softmax/upcast")
    # (B, 1, G·S, T): row g·S + s is token s's mask, as the query rows are
    allowed = _named(op.Tile(mask, op.Constant(value_ints=[1, 1, groups, 1])), "attention/exact/mask_rows")
    masked = _named(op.Where(allowed, scores, op.Constant(value_float=float("-inf"))), "attention/exact/mask")
    if sinks is not None:  # row g·S + s is query head (kv head, g)'s: its sink, repeated over S
        column = op.Reshape(sinks, op.Constant(value_ints=[1, kv_heads, num_heads // kv_heads, 1]))  # (1, H_kv, G, 1)
        if groups != num_heads // kv_heads:  # the doubled rows: the sinks twice
            column = op.Concat(column, column, axis=2)
        column = op.Unsqueeze(column, op.Constant(value_ints=[3]))  # (1, H_kv, G, 1, 1)
        column = op.Expand(
            column,
            op.Concat(
                op.Constant(value_ints=[1, kv_heads, groups]),
                op.Shape(query, start=2, end=3),
                op.Constant(value_ints=[1]),
                axis=0,
            ),
        )
        column = op.Reshape(column, op.Constant(value_ints=[1, kv_heads, -1, 1]))  # (1, H_kv, G·S, 1)
        probs = _with_sinks(op, masked, column, "attention/exact")
    else:
        probs = _named(op.Softmax(masked, axis=-1), "attention/exact/softmax")
    if model_dtype != ir.DataType.FLOAT:
        probs = _named(op.Cast(probs, to=model_dtype), "attention/exact/softmax/downcast")
    output = _named(op.MatMul(probs, value), "attention/exact/pv")  # (B, H_kv, G·S, D)
    if num_heads == kv_heads:  # the doubled rows: keep the first copy
        copies = op.Reshape(output, op.Constant(value_ints=[0, kv_heads, 2, -1, head_dim]))  # (B, H_kv, 2, S, D)
        output = _named(op.Gather(copies, op.Constant(value_int=0), axis=2), "attention/exact/first_copy")
    return op.Reshape(output, op.Constant(value_ints=[0, num_heads, -1, head_dim]))  # (B, H_q, S, D)


def _gqa_schema():
    """The part of ORT's ``GroupQueryAttention`` schema that the exporter needs to trace a call
    (onnx ships no schemas for ONNX Runtime's contrib ops)."""
    from onnx.defs import OpSchema

    param, attr, kind = OpSchema.FormalParameter, OpSchema.Attribute, OpSchema.AttrType
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    # ORT's optional inputs up to head_sink (in ORT 1.32's schema: one extra softmax logit per query head)
    optional = {"cos_cache": "T", "sin_cache": "T", "position_ids": "I", "attention_bias": "T", "head_sink": "T"}
    maybe = OpSchema.FormalParameterOption.Optional
    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=[param(n, "M" if n in ("seqlens_k", "total_sequence_length") else "T") for n in names]
        + [param(n, t, "", param_option=maybe) for n, t in optional.items()],
        outputs=[param(n, "T") for n in ("output", "present_key", "present_value")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations and cache"),
            ("M", ["tensor(int32)"], "lengths"),
            ("I", ["tensor(int64)"], "positions"),
        ],
        attributes=[
            attr("num_heads", kind.INT, "query heads"),
            attr("kv_num_heads", kind.INT, "key/value heads"),
            attr("scale", kind.FLOAT, "score scale", required=False),
            attr("softcap", kind.FLOAT, "score soft-cap", required=False),
            attr("local_window_size", kind.INT, "sliding window - 1, or -1", required=False),
        ],
    )


def _gqa_translation() -> Callable:
    """The ``gqa`` lowering: ``com.microsoft.GroupQueryAttention`` on the shared cache buffer."""
    from onnxscript import values

    op = values.Opset("", 18)
    group_query_attention = values.Op(values.Opset("com.microsoft", 1), "GroupQueryAttention", _gqa_schema())

    def cached_attention_gqa(
        query, key, value, past_key, past_value, write_indices, mask, scale, softcap, window, sinks=None
    ):
        num_heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]  # static ints
        # [B, H, S, D] -> GQA's [B, S, H * D] (Reshape's 0 copies a dimension: no shape arithmetic)
        seq = op.Shape(query, start=2, end=3)
        flat = op.Constant(value_ints=[0, 0, -1])
        q = op.Reshape(op.Transpose(query, perm=[0, 2, 1, 3]), flat)
        k = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]), flat)
        v = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), flat)
        last = op.Sub(op.Add(write_indices, seq), op.Constant(value_ints=[1]))  # index of each row's last new token
        seqlens_k = op.Cast(last, to=6)  # int32
        total = op.Cast(op.Add(op.ReduceMax(last, keepdims=0), op.Constant(value_int=1)), to=6)
        # head_sink: GroupQueryAttention adds exp(sink) to each head's softmax denominator (checked
        # against transformers' GPT-OSS attention in tests/graphs/test_sinks.py)
        head_sink = () if sinks is None else (None, None, None, None, op.CastLike(sinks, query))
        output, present_key, present_value = group_query_attention(
            q,
            k,
            v,
            past_key,
            past_value,
            seqlens_k,
            total,
            *head_sink,
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            scale=scale,
            softcap=softcap,
            local_window_size=window if window > 0 else -1,
            _outputs=3,
        )
        unflat = op.Constant(value_ints=[0, 0, num_heads, head_dim])
        output = op.Transpose(op.Reshape(output, unflat), perm=[0, 2, 1, 3])  # (B, H_q, S, D)
        return output, present_key, present_value

    return cached_attention_gqa


def translation_table(lowering: str) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export`` under the given lowering."""
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; choose one of {', '.join(LOWERINGS)}")
    if lowering == "gqa":  # no int8 KV translation: GroupQueryAttention takes a float cache only
        return {torch.ops.kvforge.cached_attention.default: _gqa_translation()}
    exact = lowering == "exact"
    return {
        torch.ops.kvforge.cached_attention.default: _onnx_translation(exact=exact),
        torch.ops.kvforge.cached_attention_int8.default: _int8_translation(exact=exact),
    }


@dataclass
class LayerCaches:
    """The cache tensors of one graph call, handed to the attention function through transformers'
    kwargs. ``past`` holds each layer's (key, value) inputs; the attention function fills
    ``present`` with the op's outputs, layer by layer, for the export wrapper to return. ``masks``
    holds one boolean mask per distinct sliding window (None = full causal), built on first use so
    the graph computes each mask once for all the layers that share it.
    """

    past: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer index -> (key, value), attention layers only
    write_indices: torch.Tensor  # (B,) int64
    seq_len: int
    present: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # 8-bit KV: layer index -> (key_scale, value_scale) [B, H_kv, S_max, 1] float32; None: a float cache
    scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    present_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            capacity = next(iter(self.past.values()))[0].shape[2]  # the first attention layer's
            self.masks[window] = reference.attention_mask(self.write_indices, self.seq_len, capacity, window)
        return self.masks[window]


ATTN_IMPLEMENTATION = "kvforge"
# Tensors transformers may pass to every attention function that kvforge's masks and positions
# already account for; any other tensor argument besides the attention sinks (``s_aux``, which
# the op takes) changes the attention itself, and the shape probe refuses the family.
_IGNORED_TENSORS = frozenset({"position_ids", "cache_position"})

# The caches (or the probe's records) of the forward in progress. A context, not a forward kwarg:
# not every family threads unknown kwargs from its decoder down to its attention modules.
_ACTIVE: ContextVar[LayerCaches | dict | None] = ContextVar("kvforge_active", default=None)


@contextmanager
def active(state: LayerCaches | dict) -> Iterator[None]:
    """Make ``state`` what the kvforge attention function uses inside this block: the
    :class:`LayerCaches` of an export wrapper's call, or a dict that records each layer's shapes
    (:func:`kvforge.compile.generic.probe_layers`)."""
    token = _ACTIVE.set(state)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# The layer a shared attention module runs at in this call (:func:`shared_layers`).
_CALL_LAYER: ContextVar[int | None] = ContextVar("kvforge_call_layer", default=None)


def _shared(module: torch.nn.Module) -> bool:
    """A module whose ``layer_idx`` names no one layer (Zamba2's shared attention block: -1), run
    at several layers and told which in each call by its forward's ``layer_idx`` argument."""
    layer = getattr(module, "layer_idx", 0)
    if isinstance(layer, int) and layer >= 0:
        return False
    return "layer_idx" in inspect.signature(type(module).forward).parameters


def _take_layer(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs)
    layer = bound.arguments.get("layer_idx")
    _CALL_LAYER.set(int(layer) if layer is not None else None)


def shared_layers(model: torch.nn.Module) -> int:
    """Tell the attention function the layer of each call of a shared attention module of
    ``model`` (:func:`_shared`: one module, one set of weights, run at several layers, each use
    with its own KV under the ``layer_idx`` its caller passes): a forward pre-hook, PyTorch's own
    extension point, records that argument for :func:`call_layer`. Idempotent; returns how many
    modules are shared."""
    shared = [m for m in model.modules() if _shared(m)]
    for module in shared:
        if not getattr(module, "_kvforge_layer_hook", False):
            module.register_forward_pre_hook(_take_layer, with_kwargs=True)
            module._kvforge_layer_hook = True
    return len(shared)


def call_layer(module: torch.nn.Module) -> int | None:
    """The layer whose KV an attention call of ``module`` uses: its ``layer_idx``, or for a shared
    module (:func:`shared_layers`) the one its forward was called with."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and layer >= 0:
        return layer
    return _CALL_LAYER.get() if _shared(module) else layer


def kvforge_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    kvforge_caches: LayerCaches | None = None,
    kvforge_probe: dict | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as ``"kvforge"``).

    Receives post-RoPE ``query [B, H_q, S, D_k]``, ``key [B, H_kv, S, D_k]`` and
    ``value [B, H_kv, S, D_v]`` of layer :func:`call_layer` (``module.layer_idx``), and the layer's
    ``sliding_window`` and ``softcap`` as transformers passes them to every attention
    implementation, and its attention sinks ``s_aux [H_q]`` where the family has them (GPT-OSS,
    Granite-SWA, MiMo-V2's sliding layers; None elsewhere: :func:`reference.attention`); returns
    ``([B, S, H_q, D_v], None)`` as transformers expects. The mask transformers built is ignored:
    the cache-aware mask comes from ``kvforge_caches``. Where the cache's head size ``D`` is larger
    than ``D_k`` or ``D_v`` (multi-head latent attention: ``D_v < D_k``), the heads are zero-padded
    to ``D`` (zeros change no score) and the output is cut back to ``D_v``. Where the cache has more
    KV heads than the layer (a multiple: MiMo-V2-Flash's full layers have half its sliding layers'),
    each key and value head is repeated ``r`` times: query head ``h`` (``G`` per KV head) then reads
    copy ``h // (G / r)``, a copy of its own head ``h // G``.

    The caches come from :func:`active` (or the ``kvforge_caches`` kwarg). A dict there instead
    (or as ``kvforge_probe``): record each layer's shapes under its
    ``layer_idx`` and compute plain causal attention, for :func:`kvforge.compile.generic.probe_layers`.
    """
    state = kvforge_caches if kvforge_caches is not None else kvforge_probe
    state = state if state is not None else _ACTIVE.get()
    if isinstance(state, dict):
        extra = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _IGNORED_TENSORS)
        state.setdefault("unhandled", set()).update(extra)
        return _probe(module, query, key, value, scaling, sliding_window, softcap, s_aux, state)
    if state is None:
        raise RuntimeError("the kvforge attention runs only inside a kvforge export wrapper")
    kvforge_caches = state
    layer = call_layer(module)
    if layer not in kvforge_caches.past:
        raise RuntimeError(f"the kvforge attention was called by layer {layer}, which the model's layout gives no KV")
    past_key, past_value = kvforge_caches.past[layer]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    value_dim, width = value.shape[-1], past_key.shape[-1]
    repeats = past_key.shape[1] // key.shape[1]
    if repeats > 1:  # fewer KV heads than the cache's: each head repeated (query head h still reads its own)
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    mask = kvforge_caches.mask(int(sliding_window) if sliding_window else None)
    if kvforge_caches.scales is not None:  # 8-bit KV: the new rows stay in the query's dtype until quantized
        past_key_scale, past_value_scale = kvforge_caches.scales[layer]
        output, present_key, present_value, key_scale, value_scale = cached_attention_int8(
            _pad_heads(query, width),
            _pad_heads(key.to(query.dtype), width),
            _pad_heads(value.to(query.dtype), width),
            past_key,
            past_value,
            past_key_scale,
            past_value_scale,
            kvforge_caches.write_indices,
            mask,
            scale,
            float(softcap or 0.0),
            int(sliding_window or 0),
            s_aux,
        )
        kvforge_caches.present_scales[layer] = (key_scale, value_scale)
    else:
        output, present_key, present_value = cached_attention(
            _pad_heads(query, width),
            _pad_heads(key.to(past_key.dtype), width),
            _pad_heads(value.to(past_value.dtype), width),
            past_key,
            past_value,
            kvforge_caches.write_indices,
            mask,
            scale,
            float(softcap or 0.0),
            int(sliding_window or 0),
            s_aux,
        )
    kvforge_caches.present[layer] = (present_key, present_value)
    if value_dim != width:
        output = output[..., :value_dim]  # (B, H_q, S, D_v)
    # contiguous, as transformers' own attention functions return it: some families .view() it
    return output.transpose(1, 2).contiguous(), None  # (B, S, H_q, D_v)


def _pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [B, H, S, d]`` zero-padded to ``[B, H, S, width]`` (unchanged when ``d == width``)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _probe(
    module, query, key, value, scaling, sliding_window, softcap, sinks, records: dict
) -> tuple[torch.Tensor, None]:
    """Record ``(kv_heads, key_dim, value_dim, query_heads, sliding_window or None)`` under the
    layer's index and compute plain causal attention (no cache) so that the forward goes on."""
    layer = call_layer(module)
    window = int(sliding_window) if sliding_window else None
    records.setdefault(layer, []).append((key.shape[1], key.shape[-1], value.shape[-1], query.shape[1], window))
    seq = query.shape[2]
    width = max(key.shape[-1], value.shape[-1])
    mask = reference.attention_mask(torch.zeros(query.shape[0], dtype=torch.int64), seq, seq, sliding_window or None)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    padded = (_pad_heads(query, width), _pad_heads(key, width), _pad_heads(value, width))
    output = reference.attention(*padded, mask, scale, float(softcap or 0.0), sinks)
    return output[..., : value.shape[-1]].transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvforge_attention)
