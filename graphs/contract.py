"""The KV-cache contract shared by the compiler, the graphs and the runtime.

Names and shapes only, with no imports beyond the standard library: the runtime imports this
module, and loading an engine must not pull in torch. The reference semantics of the contract (one
layer's cache update and attention, in plain torch) are in :mod:`kvforge.graphs.reference`.

Layout. One allocation per engine, ``[L, 2, B_max, H_kv, S_max, D]`` in the model's dtype. Layer
``l``'s key cache is the contiguous view ``cache[l, 0]`` = ``[B_max, H_kv, S_max, D]``, its value cache
``cache[l, 1]``. The first ``B`` rows of a layer's cache, ``cache[l, 0, :B]``, are contiguous too,
which is how a batch smaller than ``B_max`` is bound without a copy.

Rows. Row ``b`` holds its tokens at cache indices ``[0, len_b)``: no left padding inside the cache.
A graph call writes its ``S`` new tokens of row ``b`` at ``[write_indices[b], write_indices[b] + S)``
and the query at cache index ``i`` attends keys ``[0, i]`` of its own row (``[i - window + 1, i]``
for a sliding-window layer). Padding tokens of a ragged prefill are written but never attended by
a real token, and the next call overwrites them.
"""

from __future__ import annotations

# Graph input/output names (the manifest records them too; the runtime binds by these names).
INPUT_IDS = "input_ids"  # [B, S] int64
POSITION_IDS = "position_ids"  # [B, S] int64
WRITE_INDICES = "write_indices"  # [B] int64: cache index of each row's first new token
INPUT_LENGTHS = "input_lengths"  # [B] int64, prefill only: real (unpadded) tokens per row
LOGIT_INDICES = "logit_indices"  # [B, P] int64, verify only: the positions of each row that get logits
LOGITS = "logits"  # [B, V]: logits of each row's last real token ([B, S, V] score, [B, P, V] verify)
# verify (schema 2): the traced general graph itself, logits at ``logit_indices``; prefill, decode and
# speculative verification are all its cases, so the runtime's one session can serve them all.
GRAPHS = ("prefill", "decode", "score", "verify")


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


def verify_input_names(num_layers: int) -> list[str]:
    return [INPUT_IDS, POSITION_IDS, WRITE_INDICES, LOGIT_INDICES, *past_names(num_layers)]


def input_names(graph: str, num_layers: int) -> list[str]:
    """Input names of ``graph`` ("prefill", "decode", "score" or "verify"), in graph order."""
    if graph == "verify":
        return verify_input_names(num_layers)
    return prefill_input_names(num_layers) if graph == "prefill" else decode_input_names(num_layers)


def output_names(num_layers: int) -> list[str]:
    return [LOGITS, *present_names(num_layers)]


def cache_shape(
    num_layers: int, max_batch: int, num_kv_heads: int, max_seq: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """Shape of the one KV allocation: ``[L, 2, B_max, H_kv, S_max, D]``."""
    return (num_layers, 2, max_batch, num_kv_heads, max_seq, head_dim)
