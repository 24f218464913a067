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

``past``/``present`` alternate key and value per layer, each ``[B, H_kv, S_max, D]``. ``score`` is a
separate graph so that the prefill graph never computes the ``[B, S, V]`` logits of every position
(only tools such as perplexity need them).

Compile traces only :class:`GeneralGraph` (one trace of the model) and derives the three contract
graphs from it by replacing ``logit_indices`` (:mod:`kvforge.compile.derive`). The three direct
wrappers stay as the reference the derived graphs are tested against.
"""

from __future__ import annotations

import torch

from kvforge.graphs import lowering
from kvforge.graphs.architectures import ArchSpec
from kvforge.graphs.lowering import LayerCaches


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (its ``base_model``), also for a family whose
    ``base_model_prefix`` names no submodule, so that ``base_model`` is the LM itself (Llama 4)."""
    base = model.base_model
    if base is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        return model.model
    return base


class _CausalLMGraph(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, spec: ArchSpec) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.final_softcap = spec.final_logit_softcap(model.config)
        self.logit_scale = spec.logit_scale(model.config)

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        past: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Hidden states ``[B, S, hidden]`` and the present caches in contract order."""
        caches = LayerCaches(
            past=[(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)],
            write_indices=write_indices,
            seq_len=input_ids.shape[1],
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
        logits = self.model.get_output_embeddings()(hidden)  # (B*S, V)
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
        hidden, presents = self._run(input_ids, position_ids, write_indices, past)  # (B, S, hidden)
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
        hidden, presents = self._run(input_ids, position_ids, write_indices, past)  # (B, 1, hidden)
        return (self._logits(hidden).squeeze(1), *presents)  # (B, V)


class ScoreGraph(_CausalLMGraph):
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_indices: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        hidden, presents = self._run(input_ids, position_ids, write_indices, past)  # (B, S, hidden)
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
        hidden, presents = self._run(input_ids, position_ids, write_indices, past)  # (B, S, hidden)
        picks = logit_indices.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, K, hidden)
        hidden = torch.gather(hidden, 1, picks)  # (B, K, hidden)
        return (self._logits(hidden), *presents)  # (B, K, V)
