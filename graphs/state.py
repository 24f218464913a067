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
  graph, so the runtime never resets a state buffer: a ``Where`` over the past, except for the
  delta rules' recurrent states, which the rule zeroes itself (:meth:`ExportStateCache.unmasked`);
* the state written is the one after the row's last real token, ``lengths[b]`` new tokens in
  (``input_lengths`` in prefill; padding after them never reaches it).

The conv lowers to standard ONNX: ``Concat`` of the past state and the chunk, a depthwise
``Conv`` (``group = C``) over it, and ``GatherElements`` of each row's last ``K-1`` inputs for the
new state. Every state family's mixer runs transformers' ``causal_conv1d_forward`` hook (LFM2,
the Gated DeltaNet and KDA families, Mamba, Mamba2), where :class:`ExportCausalConv1dForward` takes
its place (:data:`CONV_KERNELS`, swapped in by compile's loader) and convolves through
:func:`depthwise_conv`, whose ONNX lowering branches on the window: one token, ``K`` products and
a sum per channel; more, the ``Conv`` over the valid positions.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import torch.nn.functional as F

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
        self._masked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(masked) -> (masked, past)

    def _past(self, layer: int, part: str) -> torch.Tensor:
        if (layer, part) not in self.past:
            raise RuntimeError(f"layer {layer} asks for a {part} state that the model's state layout does not list")
        past = self.past[(layer, part)]
        keep = self.continues.view(-1, *([1] * (past.dim() - 1)))  # (B, 1, ...)
        masked = torch.where(keep, past, torch.zeros((), dtype=past.dtype))
        self._masked[id(masked)] = (masked, past)
        return masked

    def unmasked(self, state: torch.Tensor) -> torch.Tensor | None:
        """The ``past_state`` input behind ``state``, when ``state`` is a past this cache handed out
        (new sequences' rows zeroed by a ``Where``); else None. A kernel that reads it raw applies
        :attr:`continues` itself, where that costs less than a ``Where`` over the whole state (the
        delta rule's one-token step: a factor on its per-row decays and keys). The ``Where`` it
        leaves unread is dropped by the optimizer."""
        entry = self._masked.get(id(state))
        return entry[1] if entry is not None and entry[0] is state else None

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


# ---------------------------------------------------------------- the causal convolution


@torch.library.custom_op("kvforge::depthwise_conv", mutates_args=())
def depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [B, C, L]``, ``weight [C, 1, K]``, ``bias [C]`` or None -> ``[B, C, L - K + 1]``: the
    depthwise convolution at its valid positions (no padding). One op for the exporter, lowered by
    :mod:`kvforge.graphs.gated_delta_onnx` (an ``If`` on ``L = K``: ORT's ``Conv`` runs a depthwise
    convolution one channel at a time, ~0.3 ms for the one position of a decode step of 6144
    channels, where the products over the window take a sixth of that)."""
    return F.conv1d(x, weight, bias, groups=x.shape[1])


@depthwise_conv.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], x.shape[1], x.shape[2] - weight.shape[-1] + 1)


class ExportCausalConv1dForward(torch.nn.Module):
    """What ``kernels.kernelize`` puts in place of transformers' ``causal_conv1d_forward`` (the
    causal depthwise conv of a linear-attention layer, reading and updating its conv state): the
    same result. Under export (an :class:`ExportStateCache`) the window the cache hands back holds
    the past ``K-1`` inputs, then the chunk's, so the chunk's outputs are the conv's valid positions
    (:func:`depthwise_conv`), where transformers pads both ends and slices. Outside an export (any
    other cache, or none) it hands the call back to transformers' own function, unchanged: a
    model's own forward (compile's parity reference) stays transformers' code."""

    can_torch_compile = True

    def forward(
        self,
        conv1d: torch.nn.Conv1d,
        hidden_states: torch.Tensor,
        cache,
        layer_idx: int,
        activation: str | None = None,
        state_idx: int = 0,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(cache, ExportStateCache):  # not exporting: transformers' function, as if never swapped
            return type(self).forward(
                self, conv1d, hidden_states, cache, layer_idx, activation=activation, state_idx=state_idx, **kwargs
            )
        from transformers.activations import ACT2FN

        width = conv1d.kernel_size[0]
        window = cache.update_conv_state(hidden_states, layer_idx, state_idx=state_idx, conv_kernel_size=width)
        out = torch.ops.kvforge.depthwise_conv(window.to(conv1d.weight.dtype), conv1d.weight, conv1d.bias)
        if activation is not None:
            out = ACT2FN[activation](out)
        return out.to(hidden_states.dtype)


# transformers' hub name of the causal convolution every linear-attention family calls (Gated
# DeltaNet, KDA, Mamba2, ...) -> kvforge's, for :func:`kvforge.graphs.kernel_swap.kernelize`
CONV_KERNELS = {"causal_conv1d_forward": ExportCausalConv1dForward}
