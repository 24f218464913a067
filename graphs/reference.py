"""Reference semantics of the KV contract (:mod:`kvforge.graphs.contract`) in plain torch.

One layer's cache update and masked attention, written for clarity, not speed. The torch custom
op behind the lowerings runs exactly these, so the exported graphs, the ONNX translations and the
runtime are all tested against them.
"""

from __future__ import annotations

import torch


def query_cache_indices(write_indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cache index of every new token: ``[B, S]`` int64, ``write_indices[b] + s``."""
    steps = torch.arange(seq_len, dtype=torch.int64, device=write_indices.device)
    return write_indices.unsqueeze(1) + steps.unsqueeze(0)  # (B, S)


def attention_mask(write_indices: torch.Tensor, seq_len: int, capacity: int, window: int | None = None) -> torch.Tensor:
    """Boolean mask ``[B, 1, S, S_max]``, True where a query may attend a key.

    Query ``s`` of row ``b`` sits at cache index ``i = write_indices[b] + s`` and attends cache
    indices ``[0, i]``, or ``(i - window, i]`` for a sliding-window layer.
    """
    q_idx = query_cache_indices(write_indices, seq_len).unsqueeze(-1)  # (B, S, 1)
    k_idx = torch.arange(capacity, dtype=torch.int64, device=write_indices.device)  # (S_max,)
    mask = k_idx <= q_idx  # (B, S, S_max)
    if window is not None:
        mask = mask & (k_idx > q_idx - window)
    return mask.unsqueeze(1)  # (B, 1, S, S_max)


def update(past: torch.Tensor, new: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """Functional KV update (ONNX ``TensorScatter``, axis -2, linear mode).

    past ``[B, H_kv, S_max, D]``, new ``[B, H_kv, S, D]``, write_indices ``[B]`` int64.
    Returns a new tensor equal to ``past`` with ``new[b]`` written at rows
    ``[write_indices[b], write_indices[b] + S)`` of row ``b``.
    """
    present = past.clone()
    seq_len = new.shape[-2]
    index = query_cache_indices(write_indices, seq_len)  # (B, S)
    index = index[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[-1])  # (B, H_kv, S, D)
    return present.scatter_(-2, index, new)


# ---------------------------------------------------------------- 8-bit KV (contract: --kv-dtype int8)
# The smallest scale the quantizer divides by: a row of zeros gets scale 0 and codes 0.
SCALE_FLOOR = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row (last axis) of ``x [..., D]``: returns
    ``(codes [..., D] int8, scale [..., 1] float32)`` with ``scale = max|x| / 127`` and
    ``codes = round(x / max(scale, SCALE_FLOOR))`` (half to even, as ONNX ``Round``), in float32."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # (..., 1)
    codes = torch.round(xf / scale.clamp_min(SCALE_FLOOR)).clamp(-127, 127)
    return codes.to(torch.int8), scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., D]`` int8 times ``scale [..., 1]`` float32, in ``dtype``."""
    return (codes.float() * scale).to(dtype)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked grouped-query attention (ONNX ``Attention`` with a boolean mask).

    query ``[B, H_q, S, D]``; key, value ``[B, H_kv, S_max, D]`` (``H_q`` a multiple of ``H_kv``);
    mask ``[B, 1, S, S_max]`` bool. Returns ``[B, H_q, S, D]``. Scores are computed in float32.

    ``sinks`` ``[H_q]`` (attention sinks, GPT-OSS's ``s_aux``): one extra logit per head that
    joins every query's softmax and attends no value: the scores gain a last column holding the
    head's sink, the softmax runs over ``S_max + 1`` columns, and the sink's column is dropped
    (transformers' eager attention of GPT-OSS). The probabilities of a row then sum to less than 1.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H_q, S_max, D)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # (B, H_q, S, S_max)
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H_q, S, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value.float()).to(query.dtype)


# ---------------------------------------------------------------- model state (contract schema 3)
# One step of each state kind, for clarity, not speed. ``lengths [B]`` int64 says how many of the
# ``S`` new inputs of each row are real (right padding follows them): the state written is the
# one after the row's last real input. A row that starts a sequence passes a zero state.


def conv_update(
    state: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution over ``inputs [B, C, S]`` continuing ``state [B, C, K-1]``
    (the last ``K-1`` inputs before them); ``weight [C, K]``, ``bias [C]`` or None.

    Returns ``(output [B, C, S], new_state [B, C, K-1])``: ``output[b, c, s] = bias[c] +
    sum_k weight[c, k] * full[b, c, s + k]`` over ``full = [state, inputs]`` (``[B, C, K-1+S]``),
    and the new state is ``full[b, :, n_b : n_b + K-1]``, the last ``K-1`` inputs up to the row's
    ``n_b = lengths[b]``-th. transformers' ``causal_conv1d_update`` for one token, its
    ``causal_conv1d_fn`` over a prompt.
    """
    width = state.shape[-1]  # K-1
    full = torch.cat([state, inputs.to(state.dtype)], dim=-1)  # (B, C, K-1+S)
    windows = full.unfold(-1, width + 1, 1)  # (B, C, S, K)
    output = (windows * weight[None, :, None, :]).sum(-1)  # (B, C, S)
    if bias is not None:
        output = output + bias[None, :, None]
    index = lengths.view(-1, 1, 1) + torch.arange(width).view(1, 1, -1)  # (B, 1, K-1)
    new_state = torch.gather(full, -1, index.expand(-1, full.shape[1], -1))  # (B, C, K-1)
    return output, new_state


def gated_delta_step(
    state: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (Qwen3.5 / Qwen3-Next linear attention), in float32:
    ``state [B, H, Dk, Dv]``, ``query``/``key [B, H, Dk]`` (already L2-normalized, the query
    scaled), ``value [B, H, Dv]``, ``g [B, H]`` (log decay), ``beta [B, H]``. Returns
    ``(output [B, H, Dv], new_state)``, as transformers' ``torch_recurrent_gated_delta_rule`` step."""
    state = state * g.exp()[..., None, None]  # decay
    memory = (state * key[..., None]).sum(-2)  # (B, H, Dv): what the state recalls for this key
    delta = (value - memory) * beta[..., None]  # (B, H, Dv)
    state = state + key[..., None] * delta[..., None, :]  # (B, H, Dk, Dv)
    return (state * query[..., None]).sum(-2), state


def mamba2_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba2's selective state update: ``state [B, H, N, P]`` (kvforge's layout:
    transformers' ``[B, H, P, N]`` transposed), ``x [B, H, P]``, ``dt [B, H]`` (after softplus),
    ``a [H]`` (negative), ``b``/``c [B, H, N]`` (groups already repeated to heads), ``d [H]``.
    Returns ``(y [B, H, P], new_state)``: ``h = exp(dt·A) h + B ⊗ (dt·x)``, ``y = Cᵀ h + D·x``."""
    decay = torch.exp(dt * a)[..., None, None]  # (B, H, 1, 1)
    state = state * decay + b[..., None] * (dt[..., None] * x)[:, :, None, :]  # (B, H, N, P)
    return (state * c[..., None]).sum(-2) + d[None, :, None] * x, state


def mamba_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of Mamba's selective scan: ``state [B, D, N]``, ``x``/``dt [B, D]`` (dt after
    softplus), ``a [D, N]`` (negative), ``b``/``c [B, N]``, ``d [D]``. Returns
    ``(y [B, D], new_state)``."""
    state = state * torch.exp(dt[..., None] * a) + (dt * x)[..., None] * b[:, None, :]  # (B, D, N)
    return (state * c[:, None, :]).sum(-1) + d * x, state
