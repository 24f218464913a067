"""Export wrappers: torch modules with the explicit tensor signatures of the prefill and decode graphs.

Both wrap one transformers ``*ForCausalLM`` whose attention implementation is ``"kvforge"`` and run
its own modules (embeddings, RoPE, norms, MLPs) with ``use_cache=False``; the cache lives in the
wrapper's inputs and outputs. Signatures (names from :mod:`kvforge.graphs.contract`):

prefill(input_ids [B, S], position_ids [B, S], write_indices [B], input_lengths [B], *past)
    -> (logits [B, V] of each row's last real token, *present)
decode(input_ids [B, 1], position_ids [B, 1], write_indices [B], *past)
    -> (logits [B, V], *present)

score(input_ids [B, S], position_ids [B, S], write_indices [B], *past)
    -> (logits [B, S, V] at every position, *present)

general(input_ids [B, S], position_ids [B, S], write_indices [B], logit_indices [B, K], *past)
    -> (logits [B, K, V] at the K positions ``logit_indices`` picks in each row, *present)

``past``/``present`` alternate key and value per attention layer, each ``[B, H_kv, S_max, D]``,
then (a family with state, contract schema 3) each state tensor ``[B, *shape]`` in the order of
the wrapper's :class:`~kvforge.graphs.contract.Layout` (:mod:`kvforge.graphs.state`). ``score`` is a
separate graph so that the prefill graph never computes the ``[B, S, V]`` logits of every position
(only tools such as perplexity need them).

Compile traces only :class:`GeneralGraph` (one trace of the model) and derives the three contract
graphs from it by replacing ``logit_indices`` (:mod:`kvforge.compile.derive`). The three direct
wrappers stay as the reference the derived graphs are tested against.
"""

from __future__ import annotations

import torch

from kvforge.graphs import lowering, state
from kvforge.graphs.architectures import ArchSpec
from kvforge.graphs.contract import Layout
from kvforge.graphs.lowering import LayerCaches
from kvforge.graphs.state import ExportStateCache


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (its ``base_model``), also for a family whose
    ``base_model_prefix`` names no submodule, so that ``base_model`` is the LM itself (Llama 4)."""
    base = model.base_model
    if base is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        return model.model
    return base


class _CausalLMGraph(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, spec: ArchSpec, layout: Layout | None = None) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        lowering.shared_layers(model)  # Zamba2's shared attention block: its layer comes with each call
        self.layout = layout if layout is not None and layout.has_state else None  # None: every layer attends
        # 8-bit KV: the pasts end with each layer's key and value scales (contract order)
        self.kv_int8 = layout is not None and layout.quantized_kv
        self.final_softcap = spec.final_logit_softcap(model.config)
        self.logit_scale = spec.logit_scale(model.config)

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        past: tuple[torch.Tensor, ...],
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states ``[B, S, hidden]`` and the present caches in contract order. ``lengths``
        ``[B]``: real new tokens per row, where a family's state is taken (state families only)."""
        if self.layout is not None:
            return self._run_with_state(input_ids, position_ids, write_indices, past, lengths)
        scales = None
        if self.kv_int8:  # past = KV of n layers, then their scales
            n = len(past) // 4
            past, rest = past[: 2 * n], past[2 * n :]
            scales = {i: (rest[2 * i], rest[2 * i + 1]) for i in range(n)}
        caches = LayerCaches(
            past={i: (past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)},
            write_indices=write_indices,
            seq_len=input_ids.shape[1],
            scales=scales,
        )
        decoder = decoder_of(self.model)
        with lowering.active(caches):  # the attention function reads the caches from this context
            out = decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                # A 4D mask is passed through untouched by transformers' mask builders; the attention
                # function ignores it and uses the cache-aware masks above.
                attention_mask=caches.mask(None),
                use_cache=False,
            )
        presents = [t for layer in range(len(caches.past)) for t in caches.present[layer]]
        if scales is not None:
            presents += [t for layer in range(len(caches.past)) for t in caches.present_scales[layer]]
        return out.last_hidden_state, presents

    def _run_with_state(self, input_ids, position_ids, write_indices, past, lengths):
        """:meth:`_run` for a family with state layers: KV for the layout's attention layers through
        the attention function, each state through :class:`ExportStateCache` passed as the
        decoder's ``cache``. The decoder gets its per-layer-type masks as a dict (transformers'
        hybrid families take one as given): None for the state layers (no padding mask; padding
        follows the real tokens and never reaches a real token or the state written), the
        cache-aware 4D mask for the others (ignored by the attention function)."""
        layout = self.layout
        kv = len(layout.attention)
        caches = LayerCaches(
            past={layer: (past[2 * i], past[2 * i + 1]) for i, layer in enumerate(layout.attention)},
            write_indices=write_indices,
            seq_len=input_ids.shape[1],
        )
        tensors = layout.state_tensors()
        states = ExportStateCache(
            {(entry.layer, t.part): past[2 * kv + i] for i, (entry, t) in enumerate(tensors)}, write_indices, lengths
        )
        config = self.model.config
        stateful = {entry.layer for entry in layout.states}
        types = list(config.layer_types[: config.num_hidden_layers])
        mask = caches.mask(None) if layout.attention else None
        masks = {t: None for t in types} | {types[i]: mask for i in range(len(types)) if i not in stateful}
        if layout.attention:  # transformers' own keys, for decoders that read both in every layer (Falcon-H1)
            masks |= {"full_attention": mask, "linear_attention": None}
        else:  # no layer attends (Mamba2): no mask at all; such decoders take no dict
            masks = None
        with lowering.active(caches), state.active(states):
            out = decoder_of(self.model)(
                input_ids=input_ids, position_ids=position_ids, attention_mask=masks, cache=states, use_cache=False
            )
        presents = [t for layer in layout.attention for t in caches.present[layer]]
        presents += [states.present[(entry.layer, t.part)] for entry, t in tensors]
        return out.last_hidden_state, presents

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [B, S, hidden]`` -> ``logits [B, S, V]``, through the family's head module
        (``spec.head_attr``, if any), with its final scaling.

        The lm_head runs on a 2-D ``[B * S, hidden]`` view so that it lowers to ``Gemm`` with
        ``transB=1`` on the stored ``[V, hidden]`` weight in every graph. A 3-D MatMul would need
        the weight transposed: a second copy on disk (constant-folded) or, for a weight tied to
        the embedding, in memory (folded again by ONNX Runtime at every load)."""
        batch, seq, width = hidden.shape
        hidden = hidden.reshape(batch * seq, width)  # (B*S, hidden)
        if self.spec.head_attr:  # a prediction head before the vocabulary projection
            hidden = getattr(self.model, self.spec.head_attr)(hidden)  # (B*S, hidden)
        head = self.model.get_output_embeddings()
        # Mamba keeps its residual stream in float32 (residual_in_fp32) and casts before its lm_head
        hidden = hidden.to(head.weight.dtype)
        logits = head(hidden)  # (B*S, V)
        logits = logits.view(batch, seq, -1)  # (B, S, V)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class PrefillGraph(_CausalLMGraph):
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        input_lengths: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        hidden, presents = self._run(input_ids, position_ids, write_indices, past, input_lengths)  # (B, S, hidden)
        last = (input_lengths - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])  # (B, 1, hidden)
        hidden = torch.gather(hidden, 1, last)  # (B, 1, hidden)
        return (self._logits(hidden).squeeze(1), *presents)


class DecodeGraph(_CausalLMGraph):
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ones = torch.ones_like(write_indices) if self.layout else None  # (B,): one real token per row
        hidden, presents = self._run(input_ids, position_ids, write_indices, past, ones)  # (B, 1, hidden)
        return (self._logits(hidden).squeeze(1), *presents)  # (B, V)


class ScoreGraph(_CausalLMGraph):
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        full = torch.full_like(write_indices, input_ids.shape[1]) if self.layout else None  # (B,): every token
        hidden, presents = self._run(input_ids, position_ids, write_indices, past, full)  # (B, S, hidden)
        return (self._logits(hidden), *presents)  # (B, S, V)


class GeneralGraph(_CausalLMGraph):
    """The one traced graph: every contract graph is this one with ``logit_indices`` replaced."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        logit_indices: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        # A state is taken after the last position that gets logits: each row's last real token in
        # prefill (input_lengths - 1), the one token in decode, the last drafted token in verify.
        lengths = logit_indices[:, -1] + 1 if self.layout else None  # (B,)
        hidden, presents = self._run(input_ids, position_ids, write_indices, past, lengths)  # (B, S, hidden)
        picks = logit_indices.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, K, hidden)
        hidden = torch.gather(hidden, 1, picks)  # (B, K, hidden)
        return (self._logits(hidden), *presents)  # (B, K, V)
