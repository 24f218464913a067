"""The generic path: what a family outside the verified table needs, read from transformers itself.

Input: a ``config.json`` (dict) whose ``architectures[0]`` is not in
:data:`kvforge.graphs.architectures.ARCHITECTURES`, and its transformers ``*ForCausalLM`` class.
Output: the generic :class:`~kvforge.graphs.architectures.ArchSpec` (MoE experts implementation,
final logit scaling, read from the family's modeling source), or the reason the family cannot take
the path at all, found before any weight is read: kvforge compiles decoder-only LMs whose
attention goes through transformers' ``AttentionInterface`` (``ALL_ATTENTION_FUNCTIONS``) and
whose every layer keeps a KV cache. The export and the parity check against transformers decide
the rest.

:func:`probe_layers` checks a loaded model the same way from the inside: one tiny forward records
what each layer hands the attention function (KV heads, key and value head sizes), so that the
cache is shaped from what the layers do, not from config attribute names.
"""

from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass

import torch

from kvforge.graphs import lowering
from kvforge.graphs.architectures import ArchSpec
from kvforge.graphs.wrappers import decoder_of

# Modules that keep a recurrent state instead of (or beside) a KV cache.
_RECURRENT = re.compile(
    r"^class (\w*(?:Mamba|GatedDeltaNet|ShortConv|LinearAttention|Rwkv|RecurrentBlock|Rglru|[ms]LSTM|[MS]LSTM)\w*)\(",
    re.MULTILINE,
)
_NOT_A_LAYER = ("Output", "ForCausalLM", "Model", "Config", "Cache")
_ATTENTION_DISPATCH = "ALL_ATTENTION_FUNCTIONS"
# Final logit scaling in a *ForCausalLM.forward: "logits = logits * self.logit_scale",
# "logits = self.lm_head(...) * self.config.logits_scaling", "hidden_states = hidden_states / self.config.x".
_LOGIT_SCALE = re.compile(
    r"^\s*(?:logits\s*=\s*(?:logits|self\.lm_head\(.*\))|hidden_states\s*=\s*hidden_states)"
    r"\s*([*/])\s*self\.(?:config\.)?(\w+)\s*(?:#.*)?$",
    re.MULTILINE,
)
# DeepSeek sparse attention: a "lightning indexer" picks each query's top-k keys from a cache of its own.
_SPARSE_INDEXER = ("index_topk", "index_n_heads", "index_topk_blocks")
_SOFTCAP_ATTR = "final_logit_softcapping"
_STATE_KEYS = ("mamba_", "ssm_", "linear_conv", "linear_num_")
_NON_ATTENTION_LAYER = re.compile(r"mamba|linear|conv|recurrent|ssm|rnn|lstm|delta", re.IGNORECASE)


def first_line(error: BaseException) -> str:
    """``"TypeError: first line of the message"``, for one-line refusals."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _module_source(model_class: type) -> str:
    """The source of the modules that define ``model_class`` and its bases (a remote-code class
    that subclasses a transformers family inherits that family's attention)."""
    modules = dict.fromkeys(
        klass.__module__
        for klass in model_class.__mro__
        if klass.__module__.startswith("transformers.models.")  # a family's modeling file, not the core's
        or klass.__module__.split(".")[0] not in ("transformers", "torch", "builtins")  # remote code
    )
    return "\n".join(inspect.getsource(sys.modules[name]) for name in modules if name in sys.modules)


def _encoder_as_decoder(model_class: type) -> bool:
    """A BERT-style encoder that transformers runs as a decoder (``is_decoder=True``, optional
    cross-attention): its config class has ``add_cross_attention``."""
    try:
        return "add_cross_attention" in model_class.config_class().to_dict()
    except Exception:  # a config class without usable defaults: not this kind
        return False


def refusal(config: dict, model_class: type) -> str | None:
    """Why the family of ``config`` cannot take the generic path, or None. Reads the config and the
    modeling source only (no weights, no model)."""
    from transformers.models.auto import modeling_auto as auto

    architecture = model_class.__name__
    model_type = config.get("model_type")
    if architecture.endswith("ForConditionalGeneration"):
        return (
            "it is a multimodal model (a text decoder fed by vision or audio towers); kvforge compiles "
            "text-only decoders: compile the family's *ForCausalLM text model instead"
        )
    if (
        config.get("is_encoder_decoder")
        or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
        or model_type in getattr(auto, "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", {})
    ):
        return (
            "it is the decoder half of an encoder-decoder model (cross-attention to an encoder), not a decoder-only LM"
        )
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or _encoder_as_decoder(model_class):
        return "it is an encoder (masked-LM) family that transformers can also run as a decoder, not a decoder-only LM"
    indexer = [k for k in _SPARSE_INDEXER if config.get(k)]
    if indexer:
        return (
            f"it uses sparse attention whose indexer keeps a key cache of its own ({', '.join(indexer)}), "
            "which kvforge's KV contract has no place for"
        )
    source = _module_source(model_class)
    layer_types = config.get("layer_types") or config.get("layers_block_type") or []
    other = sorted({t for t in layer_types if isinstance(t, str) and _NON_ATTENTION_LAYER.search(t)})
    other += sorted(k for k in config if k.startswith(_STATE_KEYS))[:2]  # state-space sizes (Falcon-H1's mamba_*)
    recurrent = sorted({name for name in _RECURRENT.findall(source) if not name.endswith(_NOT_A_LAYER)})
    if other or recurrent:
        what = ", ".join(other or recurrent[:3])
        return f"it has recurrent/state-space layers ({what}), which keep a state, not a KV cache"
    if _ATTENTION_DISPATCH not in source:
        return (
            "its transformers modules do not dispatch attention through AttentionInterface "
            f"({_ATTENTION_DISPATCH}); they compute attention themselves"
        )
    return None


def spec(architecture: str, model_class: type) -> ArchSpec:
    """The generic (unverified) entry of a family, with what its modeling source says: MoE experts
    exported with ``batched_mm`` where transformers can switch them, and the final logit scaling
    its ``*ForCausalLM.forward`` applies."""
    can_switch = getattr(model_class, "_can_set_experts_implementation", None)
    experts = "batched_mm" if can_switch is not None and can_switch() else None
    forward = inspect.getsource(model_class.forward)
    multiplier = divisor = None
    notes = ["generic path, unverified"]
    for op, attr in _LOGIT_SCALE.findall(forward):
        if op == "*":
            multiplier = attr
        else:
            divisor = attr
        notes.append(f"logits {'multiplied' if op == '*' else 'divided'} by config.{attr}")
    softcap = _SOFTCAP_ATTR if _SOFTCAP_ATTR in forward else None
    if experts:
        notes.append("MoE experts exported with batched_mm")
    return ArchSpec(
        architecture,
        final_softcap_attr=softcap,
        logit_divisor_attr=divisor,
        logit_multiplier_attr=multiplier,
        experts_implementation=experts,
        verified=False,
        notes="; ".join(notes),
    )


@dataclass(frozen=True)
class LayerShapes:
    """What one layer handed the attention function: KV heads and the key/value head sizes."""

    kv_heads: int
    key_dim: int
    value_dim: int
    query_heads: int


class ProbeError(ValueError):
    """The loaded model's layers cannot share one KV cache layout (the message says why)."""


def probe_layers(model: torch.nn.Module, num_layers: int) -> list[LayerShapes]:
    """Run one 3-token forward of ``model`` (attention implementation "kvforge") and record, per
    ``layer_idx``, the shapes each layer passes to the attention function. Raises
    :class:`ProbeError` when a layer never calls it or calls it twice (shared or missing caches)."""
    records: dict = {}  # layer_idx -> [(kv_heads, key_dim, value_dim, query_heads)], "unhandled" -> names
    with torch.no_grad(), lowering.active(records):
        decoder_of(model)(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.arange(3)[None], use_cache=False)
    unhandled = sorted(records.pop("unhandled", ()))
    if unhandled:
        raise ProbeError(
            f"its layers pass {', '.join(unhandled)} to the attention function (attention sinks or another "
            "term kvforge's attention does not implement)"
        )
    missing = [i for i in range(num_layers) if i not in records]
    twice = [i for i, r in records.items() if len(r) > 1]
    if not records:
        raise ProbeError("no layer calls the attention function through AttentionInterface")
    if missing:
        raise ProbeError(
            f"layers {missing} of {num_layers} do not call the attention function "
            "(layers without their own KV cache: shared, recurrent or attention-free)"
        )
    if twice:
        raise ProbeError(f"layers {twice} call the attention function more than once (several caches per layer)")
    return [LayerShapes(*records[i][0]) for i in range(num_layers)]
