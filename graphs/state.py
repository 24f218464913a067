"""The export side of the model-state contract (:mod:`kvforge.graphs.contract`, schema 3).

:class:`ExportStateCache` is what the export wrappers hand a hybrid family's decoder as its
``cache``: it speaks transformers' cache interface (``cache_utils.LinearAttentionLayer``'s
``get_conv_state`` / ``update_conv_state``, and ``update`` for the attention layers), but its
states are the graph's ``past_state.*`` inputs and what it records are the ``present_state.*``
outputs. Nothing is mutated: the graph stays functional, and "in place" is the runtime binding a
past and its present to one buffer (every read of the past precedes the write of the present,
which is computed from it).

Attention layers are untouched: ``update`` hands their key and value back as they came, and
kvforge's attention function (:mod:`kvforge.graphs.lowering`) reads and writes their KV as for
every other family.

Semantics (checked against :func:`kvforge.graphs.reference.conv_update` and transformers):

* a row whose ``write_indices`` is 0 starts a sequence: its past state is replaced by zeros in the
  graph (``Where``), so the runtime never resets a state buffer;
* the state written is the one after the row's last real token, ``lengths[b]`` new tokens in
  (``input_lengths`` in prefill; padding after them never reaches it).

The conv lowers to standard ONNX: ``Concat`` of the past state and the chunk, a depthwise
``Conv`` (``group = C``) over it (prefill and decode alike: decode is the one-token chunk), and
``GatherElements`` of each row's last ``K-1`` inputs for the new state.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

_ACTIVE: contextvars.ContextVar[ExportStateCache | None] = contextvars.ContextVar("kvforge_state_cache", default=None)


@contextlib.contextmanager
def active(cache: ExportStateCache) -> Iterator[ExportStateCache]:
    """Make ``cache`` the one :func:`current` returns while a wrapper traces the decoder: how a
    family's recurrent kernel (swapped in for transformers' at export) reads each row's
    ``lengths`` and whether it continues a sequence, which transformers' kernels are not passed."""
    token = _ACTIVE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE.reset(token)


def current() -> ExportStateCache | None:
    """The :class:`ExportStateCache` of the trace in progress (None outside one)."""
    return _ACTIVE.get()


class ExportStateCache:
    """transformers' cache interface over one graph call's state tensors.

    past: ``{(layer, part): [B, *shape]}``, the ``past_state.*`` inputs; write_indices ``[B]``
    int64; lengths ``[B]`` int64, real new tokens per row. ``present`` collects the new states
    under the same keys, for the wrapper to return in contract order.
    """

    is_compileable = False

    def __init__(self, past: dict[tuple[int, str], torch.Tensor], write_indices: torch.Tensor, lengths: torch.Tensor):
        self.past = past
        self.lengths = lengths
        self.continues = write_indices > 0  # (B,) bool: False = a new sequence, zero state
        self.present: dict[tuple[int, str], torch.Tensor] = {}

    def _past(self, layer: int, part: str) -> torch.Tensor:
        if (layer, part) not in self.past:
            raise RuntimeError(f"layer {layer} asks for a {part} state that the model's state layout does not list")
        past = self.past[(layer, part)]
        keep = self.continues.view(-1, *([1] * (past.dim() - 1)))  # (B, 1, ...)
        return torch.where(keep, past, torch.zeros((), dtype=past.dtype))

    # ---------------------------------------------------------------- attention layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attention layers: the KV goes through kvforge's attention function, not through here."""
        return key_states, value_states

    # ---------------------------------------------------------------- convolution state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._past(layer_idx, "conv")

    def is_recording_past(self, layer_idx: int) -> bool:
        # Always True: transformers then takes the path that concatenates the state to the chunk
        # (update_conv_state), never its in-place one-token update.
        return True

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, conv_kernel_size: int | None = None, **_
    ) -> torch.Tensor:
        """``conv_states [B, C, S]``, the chunk's convolution inputs -> ``[B, C, K-1+S]``, the past
        state followed by them (what the causal conv runs over); records the new state, each row's
        last ``K-1`` inputs up to its last real token."""
        past = self._past(layer_idx, "conv")  # (B, C, K-1)
        width = past.shape[-1]
        full = torch.cat([past, conv_states.to(past.dtype)], dim=-1)  # (B, C, K-1+S)
        index = self.lengths.view(-1, 1, 1) + torch.arange(width, device=full.device).view(1, 1, -1)  # (B, 1, K-1)
        self.present[(layer_idx, "conv")] = torch.gather(full, -1, index.expand(-1, full.shape[1], -1))
        return full

    # ---------------------------------------------------------------- recurrent state

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self._past(layer_idx, "recurrent")

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # no intermediate states: the graph writes the state after each row's last real token

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **_
    ) -> torch.Tensor:
        """Records the layer's new recurrent state. The kernel that computed it must already have
        stopped each row at its last real token (``lengths``, via :func:`current`): padding after
        it must leave the state unchanged."""
        past = self._past(layer_idx, "recurrent")
        self.present[(layer_idx, "recurrent")] = recurrent_states.to(past.dtype)
        return recurrent_states
