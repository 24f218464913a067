"""The KV-cache contract shared by the compiler, the graphs and the runtime.

Everything here is plain torch (no transformers, no ONNX), so the runtime can import it cheaply.

Layout. One allocation per engine, ``[L, 2, B_max, H_kv, S_max, D]`` in the model's dtype. Layer
``l``'s key cache is the contiguous view ``cache[l, 0]`` = ``[B_max, H_kv, S_max, D]``, its value cache
``cache[l, 1]``. The first ``B`` rows of a layer's cache, ``cache[l, 0, :B]``, are contiguous too,
which is how a batch smaller than ``B_max`` is bound without a copy.

Rows. Row ``b`` holds its tokens at cache indices ``[0, len_b)``: no left padding inside the cache.
A graph call writes its ``S`` new tokens of row ``b`` at ``[write_indices[b], write_indices[b] + S)``
and the query at cache index ``i`` attends keys ``[0, i]`` of its own row (``[i - window + 1, i]``
for a sliding-window layer). Padding tokens of a ragged prefill are written but never attended by
a real token, and the next call overwrites them.

The functions below are the reference semantics of one layer's update and attention; the ONNX
lowerings and the runtime are tested against them.
"""

from __future__ import annotations

import torch

# Graph input/output names (the manifest records them too; the runtime binds by these names).
INPUT_IDS = "input_ids"  # [B, S] int64
POSITION_IDS = "position_ids"  # [B, S] int64
WRITE_INDICES = "write_indices"  # [B] int64: cache index of each row's first new token
INPUT_LENGTHS = "input_lengths"  # [B] int64, prefill only: real (unpadded) tokens per row
LOGITS = "logits"  # [B, V]: logits of each row's last real token ([B, S, V] in the score graph)
GRAPHS = ("prefill", "decode", "score")


def past_key_name(layer: int) -> str:
    return f"past_key_values.{layer}.key"


def past_value_name(layer: int) -> str:
    return f"past_key_values.{layer}.value"


def present_key_name(layer: int) -> str:
    return f"present.{layer}.key"


def present_value_name(layer: int) -> str:
    return f"present.{layer}.value"


def past_names(num_layers: int) -> list[str]:
    """Past-cache input names in graph order: layer 0 key, layer 0 value, layer 1 key, ..."""
    return [n for layer in range(num_layers) for n in (past_key_name(layer), past_value_name(layer))]


def present_names(num_layers: int) -> list[str]:
    """Present-cache output names, in the same order as :func:`past_names`."""
    return [n for layer in range(num_layers) for n in (present_key_name(layer), present_value_name(layer))]


def prefill_input_names(num_layers: int) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, INPUT_LENGTHS, *past_names(num_layers)]


def decode_input_names(num_layers: int) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, *past_names(num_layers)]


def input_names(graph: str, num_layers: int) -> list[str]:
    """Input names of ``graph`` ("prefill", "decode" or "score"), in graph order."""
    return prefill_input_names(num_layers) if graph == "prefill" else decode_input_names(num_layers)


def output_names(num_layers: int) -> list[str]:
    return [LOGITS, *present_names(num_layers)]


def cache_shape(
    num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of the one KV allocation: ``[L, 2, B_max, H_kv, S_max, D]``."""
    return (num_layers, 2, max_batch, num_kv_heads, max_seq, head_dim)


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


def reference_update(past: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """Functional KV update (ONNX ``TensorScatter``, axis -2, linear mode).

    past ``[B, H_kv, S_max, D]``, update ``[B, H_kv, S, D]``, write_indices ``[B]`` int64.
    Returns a new tensor equal to ``past`` with ``update[b]`` written at rows
    ``[write_indices[b], write_indices[b] + S)`` of row ``b``.
    """
    present = past.clone()
    seq_len = update.shape[-2]
    index = query_cache_indices(write_indices, seq_len)  # (B, S)
    index = index[:, None, :, None].expand(-1, update.shape[1], -1, update.shape[-1])  # (B, H_kv, S, D)
    return present.scatter_(-2, index, update)


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Masked grouped-query attention (ONNX ``Attention`` with a boolean mask).

    query ``[B, H_q, S, D]``; key, value ``[B, H_kv, S_max, D]`` (``H_q`` a multiple of ``H_kv``);
    mask ``[B, 1, S, S_max]`` bool. Returns ``[B, H_q, S, D]``. Scores are computed in float32.
    """
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)  # (B, H_q, S_max, D)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale  # (B, H_q, S, S_max)
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value.float()).to(query.dtype)
