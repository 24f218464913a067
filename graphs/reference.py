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
