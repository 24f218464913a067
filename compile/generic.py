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
# A head between the decoder and the output embeddings: "logits = self.decoder(self.lm_head(hidden_states))"
# (ModernBERT-decoder's dense + activation + norm prediction head before its vocabulary projection).
_HEAD_BEFORE_OUTPUT = re.compile(
    r"^\s*logits\s*=\s*self\.\w+\(\s*self\.(\w+)\(\s*hidden_states\s*\)\s*\)", re.MULTILINE
)
# Rotary embeddings computed in complex numbers (DeepSeek-V2, Llama 4): the ONNX exporter has no
# translation for most complex-valued ops, so export rewrites them (kvforge.compile.complex_to_real).
_COMPLEX = re.compile(r"torch\.(view_as_complex|polar)\(")
# Attention classes picked from a plain dict by attn_implementation ("eager", "sdpa", ...): a name
# registered with AttentionInterface is not among its keys.
_CLASS_TABLE = re.compile(r"\b(\w+_ATTENTION_CLASSES)\[\s*(?:self\.)?(?:config\.)?_?attn_implementation\s*\]")
# MoE experts that loop over the experts the tokens picked (data-dependent control flow).
_EXPERT_LOOP = re.compile(r"^\s*for \w+ in expert_hit\b", re.MULTILINE)
_STATE_KEYS = ("mamba_", "ssm_", "linear_conv", "linear_num_")
# A learned bias added to the attention scores, handed to the attention function (Inkling's
# relative-position logits): kvforge's attention lowerings take no additive score bias.
_SCORE_BIAS = re.compile(r"^\s*position_bias=position_bias,", re.MULTILINE)
# Mamba (v1) mixers, and the kernel hook where kvforge swaps in its chunked scan (graphs/mamba.py).
_MAMBA_MIXER = re.compile(r"^class (\w*(?<!2)MambaMixer)\(", re.MULTILINE)
_MAMBA_HOOK = 'use_kernel_forward_from_hub("mamba_scan_forward")'
# State families whose state kvforge keeps elsewhere, refused for what else they need (by model_type)
_STATE_FAMILY_REFUSALS = {
    # MiniMax, RecurrentGemma and RWKV keep states kvforge's contract has kinds for ([B, H, D, D], [B, D],
    # [B, C, K-1]), xLSTM's would be a new kind; what stops them all is that transformers computes their
    # recurrence inline, behind no kernel hook.
    "minimax": (
        "its lightning-attention layers (MiniMaxLightningAttention) run their linear-attention recurrence "
        "inline, in Python loops over blocks and, once a state exists, over every token, behind no kernel hook "
        "(use_kernelized_func) where kvforge could swap in a chunked op: a graph with a dynamic sequence length "
        "cannot be traced through them without patching transformers"
    ),
    "recurrent_gemma": (
        "its recurrent blocks keep their convolution and RG-LRU states in module attributes (conv1d_state, "
        "rg_lru.recurrent_states) that forward reads and overwrites, not in the cache passed to forward, and the "
        "RG-LRU loops over tokens in Python behind no kernel hook: kvforge can neither bind those states as graph "
        "inputs nor trace a dynamic sequence length without patching transformers"
    ),
    "xlstm": (
        "its mLSTM blocks keep a matrix memory per head (C [Dqk, Dv], n [Dqk], m) that the decoder passes to "
        "each block and copies back into its own xLSTMCache.rnn_state, not a transformers cache, and run it "
        "through kernel functions bound in the backend's constructor (wrap_chunkwise_arbitrary_sequence_length: "
        "Python branches on the sequence length, no per-row lengths), behind no kernel hook: kvforge can neither "
        "bind that memory as graph inputs nor trace a dynamic sequence length without patching transformers"
    ),
    "rwkv": (
        "its WKV recurrence on the CPU (rwkv_linear_attention_cpu) loops over tokens in Python behind no kernel "
        "hook (the hub kernel it can load is CUDA-only), and its state is a list of tensors passed as state=, not "
        "a transformers cache: a graph with a dynamic sequence length cannot be traced through it without "
        "patching transformers"
    ),
}
# A sparse-attention indexer module (Qwen4-exp's QSA) that the config does not name by _SPARSE_INDEXER's keys.
_INDEXER_CLASS = re.compile(r"^class (\w*Indexer)\(", re.MULTILINE)
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
    indexers = sorted(set(_INDEXER_CLASS.findall(source)))
    if indexers:
        return (
            f"it uses sparse attention whose indexer ({', '.join(indexers)}) selects each query's keys from a key "
            "cache of its own, which kvforge's KV contract has no place for"
        )
    if _SCORE_BIAS.search(source):
        return (
            "its attention adds a learned relative-position bias to the scores (position_bias, passed to the "
            "attention function), which kvforge's attention lowerings have no input for"
        )
    mixers = _MAMBA_MIXER.findall(source)
    if mixers and _MAMBA_HOOK not in source:
        return (
            f"its Mamba mixers ({', '.join(mixers)}) call transformers' selective scan directly (per head, from a "
            "zero state, and update the state in place in decode), not through the mamba_scan_forward kernel hook "
            "where kvforge swaps in its chunked scan"
        )
    layer_types = config.get("layer_types") or config.get("layers_block_type") or []
    other = sorted({t for t in layer_types if isinstance(t, str) and _NON_ATTENTION_LAYER.search(t)})
    other += sorted(k for k in config if k.startswith(_STATE_KEYS))[:2]  # state-space sizes (Falcon-H1's mamba_*)
    recurrent = sorted({name for name in _RECURRENT.findall(source) if not name.endswith(_NOT_A_LAYER)})
    if model_type in _STATE_FAMILY_REFUSALS:
        return _STATE_FAMILY_REFUSALS[model_type]
    if other or recurrent:
        what = ", ".join(other or recurrent[:3])
        return f"it has recurrent/state-space layers ({what}), which keep a state, not a KV cache"
    if _ATTENTION_DISPATCH not in source:
        return (
            "its transformers modules do not dispatch attention through AttentionInterface "
            f"({_ATTENTION_DISPATCH}); they compute attention themselves"
        )
    missing = _what_is_missing(config, model_class, source)
    return "it has " + ", and ".join(missing) if missing else None


def _what_is_missing(config: dict, model_class: type, source: str) -> list[str]:
    """What a family whose source does dispatch through AttentionInterface still has that kvforge
    does not carry, read from its config and modeling source (empty when nothing)."""
    missing = []
    for table in dict.fromkeys(_CLASS_TABLE.findall(source)):
        keys = _table_keys(model_class, table)
        tower = " (only its vision sub-model, vision_config, dispatches through AttentionInterface)"
        missing.append(
            f"attention classes picked from {table}{keys} by attn_implementation, not through AttentionInterface"
            + (tower if config.get("vision_config") else "")
        )
    can_switch = getattr(model_class, "_can_set_experts_implementation", None)
    if _EXPERT_LOOP.search(source) and not (can_switch is not None and can_switch()):
        missing.append(
            "MoE experts that loop over the experts the tokens picked (data-dependent control flow torch.export "
            "cannot trace) and that transformers cannot switch to a batched experts_implementation"
        )
    return missing


def _table_keys(model_class: type, table: str) -> str:
    """`` (eager, sdpa)``: the implementations an attention class table has, where it can be read."""
    for klass in model_class.__mro__:
        found = getattr(sys.modules.get(klass.__module__), table, None)
        if isinstance(found, dict):
            return f" ({', '.join(map(str, found))})"
    return ""


def spec(architecture: str, model_class: type) -> ArchSpec:
    """The generic (unverified) entry of a family, with what its modeling source says: MoE experts
    exported with ``batched_mm`` where transformers can switch them, and what its
    ``*ForCausalLM.forward`` does between the decoder and the logits: a head module before the
    output embeddings, the final logit scaling and soft-cap; and whether its modules compute in
    complex numbers."""
    can_switch = getattr(model_class, "_can_set_experts_implementation", None)
    experts = "batched_mm" if can_switch is not None and can_switch() else None
    forward = inspect.getsource(model_class.forward)
    multiplier = divisor = None
    notes = ["generic path, unverified"]
    for op, attr in _LOGIT_SCALE.findall(forward):
        if attr == _SOFTCAP_ATTR:  # "logits = logits * config.final_logit_softcapping" ends the soft-cap
            continue
        if op == "*":
            multiplier = attr
        else:
            divisor = attr
        notes.append(f"logits {'multiplied' if op == '*' else 'divided'} by config.{attr}")
    softcap = _SOFTCAP_ATTR if _SOFTCAP_ATTR in forward else None
    head = next(iter(_HEAD_BEFORE_OUTPUT.findall(forward)), None)
    if head:
        notes.append(f"the hidden states pass through self.{head} before the output embeddings")
    if experts:
        notes.append("MoE experts exported with batched_mm")
    complex_arithmetic = bool(_COMPLEX.search(_module_source(model_class)))
    if complex_arithmetic:
        notes.append("complex rotary arithmetic carried as real pairs")
    return ArchSpec(
        architecture,
        final_softcap_attr=softcap,
        logit_divisor_attr=divisor,
        logit_multiplier_attr=multiplier,
        head_attr=head,
        experts_implementation=experts,
        complex_arithmetic=complex_arithmetic,
        verified=False,
        notes="; ".join(notes),
    )


@dataclass(frozen=True)
class LayerShapes:
    """What one layer handed the attention function: KV heads, the key/value head sizes, query
    heads and its sliding window (None: full causal)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    query_heads: int
    window: int | None = None


class ProbeError(ValueError):
    """The loaded model's layers cannot share one KV cache layout (the message says why)."""


def probe_layers(model: torch.nn.Module, num_layers: int) -> list[LayerShapes]:
    """Run one 3-token forward of ``model`` (attention implementation "kvforge") and record, per
    ``layer_idx``, the shapes each layer passes to the attention function. Raises
    :class:`ProbeError` when a layer never calls it or calls it twice (shared or missing caches)."""
    records: dict = {}  # layer_idx -> [(kv_heads, key_dim, value_dim, query_heads, window)], "unhandled" -> names
    lowering.shared_layers(model)  # a shared attention module records under each call's layer
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


def generation_cache_windows(config) -> list[int | None] | None:
    """Per layer, the window of the cache transformers' ``generate`` builds for ``config``
    (``DynamicCache(config=...)``: a layer keeps only its last ``window`` keys; None keeps all), or
    None where transformers cannot say."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    try:
        types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError, IndexError):  # a config without per-layer structure
        return None
    # chunked layers are judged by chunked_attention_refusal
    return [kw.get("sliding_window") if t != "chunked_attention" else None for t, kw in zip(types, kwargs)]


def chunked_attention_refusal(config, max_seq: int | None) -> str | None:
    """Why a family with chunked attention layers (Llama 4: a query attends only the keys of its own
    ``attention_chunk_size``-token chunk) cannot be compiled with ``max_seq`` tokens, or None. Within
    one chunk it is causal attention, which kvforge carries: ``max_seq`` at most the chunk size."""
    types = getattr(config, "layer_types", None) or []
    chunk = getattr(config, "attention_chunk_size", None)
    layers = [i for i, t in enumerate(types) if t == "chunked_attention"]
    if not chunk or not layers or (max_seq is not None and max_seq <= chunk):
        return None
    return (
        f"layers {layers} use chunked attention (attention_chunk_size={chunk}: a query attends only the keys of "
        f"its own chunk), which kvforge's causal and sliding-window masks do not express: compile with "
        f"max_seq <= {chunk} (--max-seq {chunk}), where it is causal attention"
    )


def window_mismatch(
    layers: list[LayerShapes], cache_windows: list[int | None] | None, max_seq: int | None
) -> str | None:
    """Why transformers' own forward and its ``generate`` disagree on this family within ``max_seq``
    tokens, or None. A layer whose generation cache keeps only the last ``w`` keys while its
    attention is given no window (or a wider one) attends all earlier tokens in a forward but only
    ``w`` of them once ``generate`` has cached more than ``w`` tokens (Moshi: ``config.sliding_window``
    without ``layer_types`` makes the cache sliding; its attention and mask are full causal).
    kvforge can match only one of the two, so such a family compiles only with ``max_seq`` at most
    ``w``, where they agree."""
    if not cache_windows or len(cache_windows) != len(layers):
        return None
    bad = [
        (i, cache)
        for i, (layer, cache) in enumerate(zip(layers, cache_windows))
        if cache is not None and (layer.window is None or layer.window > cache)
    ]
    window = min((cache for _, cache in bad), default=None)
    if window is None or (max_seq is not None and max_seq <= window):
        return None
    windows = sorted({layers[i].window for i, _ in bad if layers[i].window})
    given = f"a sliding window of {', '.join(map(str, windows))}" if windows else "no sliding window"
    return (
        f"layers {[i for i, _ in bad]} get {given} in their attention but transformers' "
        f"generation cache keeps only their last {window} keys (config.sliding_window without layer_types), so "
        f"transformers' own forward and generate disagree past {window} tokens and kvforge cannot match both: "
        f"compile with max_seq <= {window} (--max-seq {window}), where they agree"
    )
