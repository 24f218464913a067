"""Attention lowerings: one torch custom op per cached-attention layer, plus its ONNX translations.

The export wrappers run transformers' own modules with the attention function registered here
(``attn_implementation="kvforge"``). transformers hands that function the post-RoPE query, key and
value of one layer; the function passes them, with the layer's past cache, to the custom op
``kvforge::cached_attention``, which is opaque to the exporter. ``torch.onnx.export`` then replaces
the op with the translation of the chosen lowering:

* ``onnx``: opset-24 ``TensorScatter`` (axis -2) for the cache update and ``Attention`` with a
  boolean mask. TensorRT >= 10.15 parses both; ORT's CPU provider runs them in place.

The op is functional (it returns new present tensors, it never mutates its inputs) because the
exporter requires it; "in place" is a property of the runtime binding (past and present share a
buffer), not of the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvforge.graphs import contract

LOWERINGS = ("onnx",)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's cache update and attention.

    query ``[B, H_q, S, D]``, key/value ``[B, H_kv, S, D]`` (post-RoPE), past_key/past_value
    ``[B, H_kv, S_max, D]``, write_indices ``[B]`` int64, mask ``[B, 1, S, S_max]`` bool.
    Returns ``(output [B, H_q, S, D], present_key, present_value)``.
    """
    present_key = contract.reference_update(past_key, key, write_indices)
    present_value = contract.reference_update(past_value, value, write_indices)
    output = contract.reference_attention(query, present_key, present_value, mask, scale, softcap)
    return output, present_key, present_value


@cached_attention.register_fake
def _(query, key, value, past_key, past_value, write_indices, mask, scale, softcap):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


def _onnx_translation() -> Callable:
    """The ``onnx`` lowering, written with onnxscript (imported lazily: export-time only)."""
    from onnxscript import values

    op = values.Opset("", 24)

    def cached_attention_onnx(query, key, value, past_key, past_value, write_indices, mask, scale, softcap):
        present_key = op.TensorScatter(past_key, key, write_indices, axis=-2)
        present_value = op.TensorScatter(past_value, value, write_indices, axis=-2)
        # Attention returns (Y, present_key, present_value, qk_matmul_output); only Y is used.
        if softcap > 0.0:
            output = op.Attention(query, present_key, present_value, mask, scale=scale, softcap=softcap)
        else:
            output = op.Attention(query, present_key, present_value, mask, scale=scale)
        return output[0], present_key, present_value

    return cached_attention_onnx


def translation_table(lowering: str) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export`` under the given lowering."""
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; choose one of {', '.join(LOWERINGS)}")
    return {torch.ops.kvforge.cached_attention.default: _onnx_translation()}


@dataclass
class LayerCaches:
    """The cache tensors of one graph call, handed to the attention function through transformers'
    kwargs. ``past`` holds each layer's (key, value) inputs; the attention function fills
    ``present`` with the op's outputs, layer by layer, for the export wrapper to return. ``masks``
    holds one boolean mask per distinct sliding window (None = full causal), built on first use so
    the graph computes each mask once for all the layers that share it.
    """

    past: list[tuple[torch.Tensor, torch.Tensor]]
    write_indices: torch.Tensor  # (B,) int64
    seq_len: int
    present: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            capacity = self.past[0][0].shape[2]
            self.masks[window] = contract.attention_mask(self.write_indices, self.seq_len, capacity, window)
        return self.masks[window]


ATTN_IMPLEMENTATION = "kvforge"


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
    kvforge_caches: LayerCaches | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (registered as ``"kvforge"``).

    Receives post-RoPE ``query [B, H_q, S, D]`` and ``key``/``value [B, H_kv, S, D]`` of layer
    ``module.layer_idx``, and the layer's ``sliding_window`` and ``softcap`` as transformers passes
    them to every attention implementation; returns ``([B, S, H_q, D], None)`` as transformers
    expects. The mask transformers built is ignored: the cache-aware mask comes from
    ``kvforge_caches``.
    """
    if kvforge_caches is None:
        raise RuntimeError("the kvforge attention runs only inside a kvforge export wrapper")
    layer = module.layer_idx
    past_key, past_value = kvforge_caches.past[layer]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    output, present_key, present_value = cached_attention(
        query,
        key.to(past_key.dtype),
        value.to(past_value.dtype),
        past_key,
        past_value,
        kvforge_caches.write_indices,
        kvforge_caches.mask(int(sliding_window) if sliding_window else None),
        scale,
        float(softcap or 0.0),
    )
    kvforge_caches.present[layer] = (present_key, present_value)
    return output.transpose(1, 2), None  # (B, S, H_q, D)


def register() -> None:
    """Register the attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvforge_attention)
