"""The architecture table: the decoder families kvforge verifies, one small frozen entry each.

An entry maps the ``architectures[0]`` string of a Hugging Face ``config.json`` to what the export
wrappers need to know beyond transformers' own modules. Everything that a family does in its own
modules (RoPE variants, norms, MLPs) stays transformers' code; an entry only says what the wrapper
must do around them. ``tests/graphs/test_architectures.py`` mirrors this table with one tiny test
config per entry, and fails when an entry has none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvforge.graphs.contract import Layout, StateEntry, StateTensor


@dataclass(frozen=True)
class ArchSpec:
    """What kvforge needs to know about one family beyond transformers' own modules.

    architecture: the ``config.architectures[0]`` string.
    final_softcap_attr: config attribute of a final logit soft-cap ``tanh(x / c) * c`` that the
        family's ``*ForCausalLM.forward`` applies after the lm_head (Gemma 2).
    logit_divisor_attr: config attribute the logits are divided by after the lm_head (Granite).
    logit_multiplier_attr: config attribute the logits are multiplied by after the lm_head (Cohere).
    head_attr: attribute of the ``*ForCausalLM`` naming a module that its forward applies to the
        decoder's hidden states before the output embeddings (ModernBERT-decoder's prediction head:
        dense, activation, norm); None when the output embeddings take the hidden states directly.
    experts_implementation: transformers experts implementation to export MoE blocks with. The
        default ("eager") loops over experts with data-dependent shapes, which does not export;
        "batched_mm" gathers each token's expert weights and runs batched matmuls: static shapes.
    complex_arithmetic: the family computes in complex numbers (DeepSeek-V2's and Llama 4's rotary
        embeddings, ``view_as_complex``/``polar``): export traces it with ``torch.export`` first and
        carries the complex values as real pairs (:mod:`kvforge.compile.complex_to_real`), because
        the ONNX exporter translates few complex-valued ops.
    state: the kind of state (:data:`kvforge.graphs.contract.STATE_KINDS`) the family's
        non-attention layers keep, read by :func:`state_layout`; None: every layer attends.
    ssm_attrs: for ``state="mamba2"``, the config attributes naming the Mamba2 mixer's heads,
        head dim, state size, groups and conv kernel (each family names them its own way).
    verified: False for the generic path (a family not in the table), which compile accepts only
        when its parity check passes.
    notes: what the family needed beyond the shared path (documentation).
    """

    architecture: str
    final_softcap_attr: str | None = None
    logit_divisor_attr: str | None = None
    logit_multiplier_attr: str | None = None
    head_attr: str | None = None
    experts_implementation: str | None = None
    complex_arithmetic: bool = False
    state: str | None = None
    ssm_attrs: tuple[str, ...] = ()
    verified: bool = True
    notes: str = ""

    def final_logit_softcap(self, config: Any) -> float:
        return float(getattr(config, self.final_softcap_attr, None) or 0.0) if self.final_softcap_attr else 0.0

    def logit_scale(self, config: Any) -> float:
        multiplier = getattr(config, self.logit_multiplier_attr, None) if self.logit_multiplier_attr else None
        divisor = getattr(config, self.logit_divisor_attr, None) if self.logit_divisor_attr else None
        return float(multiplier or 1.0) / float(divisor or 1.0)


_MOE = "batched_mm"
# Mamba2 mixer dims (heads, head dim, state size, groups, conv kernel) as each family's config names them
_MAMBA2_ATTRS = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")
_HYBRID_MAMBA2_ATTRS = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.architecture: spec
    for spec in (
        ArchSpec("LlamaForCausalLM", notes="shared path; RoPE scaling (llama3, linear, ...) is transformers' own"),
        ArchSpec("MistralForCausalLM", notes="sliding window: the window transformers passes per layer"),
        ArchSpec("Qwen2ForCausalLM", notes="shared path (qkv bias, optional sliding layers via layer_types)"),
        ArchSpec("Qwen3ForCausalLM", notes="shared path (q/k norm inside transformers' attention module)"),
        ArchSpec("Phi3ForCausalLM", notes="shared path (fused qkv and gate/up; longrope picks its factors traceably)"),
        ArchSpec("GemmaForCausalLM", notes="shared path (embedding scale, GeLU MLP)"),
        ArchSpec(
            "Gemma2ForCausalLM",
            final_softcap_attr="final_logit_softcapping",
            notes="attention soft-cap (Attention softcap attribute), final logit soft-cap, alternating windows",
        ),
        ArchSpec(
            "Gemma3ForCausalLM",
            final_softcap_attr="final_logit_softcapping",
            notes="local/global RoPE and windows per layer type; optional final logit soft-cap",
        ),
        ArchSpec("GPT2LMHeadModel", notes="learned absolute positions from position_ids; Conv1D; multi-head"),
        ArchSpec("GPTNeoXForCausalLM", notes="shared path (partial rotary, parallel residual)"),
        ArchSpec("GraniteForCausalLM", logit_divisor_attr="logits_scaling", notes="logits divided by logits_scaling"),
        ArchSpec("Olmo2ForCausalLM", notes="shared path (q/k norm over the projections, post-norms)"),
        ArchSpec("MixtralForCausalLM", experts_implementation=_MOE, notes="MoE experts exported with batched_mm"),
        ArchSpec("Qwen3MoeForCausalLM", experts_implementation=_MOE, notes="MoE experts exported with batched_mm"),
        ArchSpec(
            "Lfm2ForCausalLM",
            state="conv",
            notes="short-convolution layers keep a conv state [C, K-1]; KV only for the attention layers",
        ),
        ArchSpec(
            "Lfm2MoeForCausalLM",
            state="conv",
            experts_implementation=_MOE,
            notes="LFM2's conv state beside attention layers; MoE experts exported with batched_mm",
        ),
        # Gated DeltaNet linear attention (a conv state and a float32 recurrent state) beside full attention
        ArchSpec(
            "Qwen3_5ForCausalLM",
            state="gated_delta",
            notes="Gated DeltaNet layers keep a conv state [C, K-1] and a recurrent state [H, Dk, Dv] (float32); "
            "their kernels swapped at export for kvforge's chunked gated delta rule",
        ),
        ArchSpec(
            "Qwen3_5MoeForCausalLM",
            state="gated_delta",
            experts_implementation=_MOE,
            notes="Qwen3.5's Gated DeltaNet state beside attention layers; MoE experts exported with batched_mm",
        ),
        ArchSpec(
            "Qwen3NextForCausalLM",
            state="gated_delta",
            experts_implementation=_MOE,
            notes="Gated DeltaNet state (fused qkvz projection) beside gated attention; MoE experts with batched_mm",
        ),
        ArchSpec(
            "OlmoHybridForCausalLM",
            state="gated_delta",
            notes="Gated DeltaNet state (separate q/k/v projections, beta up to 2) beside attention layers",
        ),
        ArchSpec(
            "LaraMiniForCausalLM",
            state="gated_delta",
            experts_implementation=_MOE,
            notes="Gated DeltaNet state beside sliding-window (RoPE) and full (no positions) attention layers; "
            "MoE experts with batched_mm",
        ),
        # KDA (Kimi Delta Attention): the gated delta rule with a decay per key channel, beside latent attention
        ArchSpec(
            "KimiLinearForCausalLM",
            state="gated_delta",
            experts_implementation=_MOE,
            notes="KDA layers keep a conv state [3·H·D, K-1] and a recurrent state [H, D, D] (float32), their "
            "kernels swapped at export for kvforge's per-channel chunked rule; latent (MLA) attention layers "
            "cache expanded keys and values; MoE experts with batched_mm",
        ),
        ArchSpec(
            "BailingHybridForCausalLM",
            state="gated_delta",
            experts_implementation=_MOE,
            notes="KDA state (bounded sigmoid forget gate) beside latent attention with RoPE; MoE experts with "
            "batched_mm",
        ),
        ArchSpec(
            "Lfm3ForCausalLM",
            state="conv",
            notes="LFM2's short convolutions (conv state [C, K-1]) beside full and sliding attention layers",
        ),
        ArchSpec(
            "JambaForCausalLM",
            state="mamba",
            experts_implementation=_MOE,
            notes="Mamba mixers (chunked scan, as Mamba) beside attention layers; MoE experts exported with batched_mm",
        ),
        ArchSpec(
            "MambaForCausalLM",
            state="mamba",
            notes="every layer a Mamba mixer: conv state [D, K-1] and selective-scan state [D, N] float32; "
            "transformers' token loop swapped for kvforge's chunked scan (graphs/mamba.py); no KV",
        ),
        ArchSpec(
            "FalconMambaForCausalLM",
            state="mamba",
            notes="Mamba with RMS norms on dt, B and C (transformers' own, before the scan); chunked scan as Mamba",
        ),
        ArchSpec(
            "Mamba2ForCausalLM",
            state="mamba2",
            ssm_attrs=_MAMBA2_ATTRS,
            notes="every layer a Mamba2 (SSD) mixer: conv state [C, K-1] and recurrent state [H, N, P] float32, "
            "no KV; kvforge's chunked scan (kvforge.graphs.mamba2) swapped in through the kernels mapping",
        ),
        ArchSpec(
            "GraniteMoeHybridForCausalLM",
            logit_divisor_attr="logits_scaling",
            experts_implementation=_MOE,
            state="mamba2",
            ssm_attrs=_HYBRID_MAMBA2_ATTRS,
            notes="Granite 4: Mamba2 layers beside attention layers (KV only for those), MoE or dense MLPs, "
            "logits divided by logits_scaling",
        ),
        ArchSpec(
            "BambaForCausalLM",
            state="mamba2",
            ssm_attrs=_HYBRID_MAMBA2_ATTRS,
            notes="Mamba2 layers beside the attention layers attn_layer_indices names (KV only for those)",
        ),
        ArchSpec(
            "NemotronHForCausalLM",
            experts_implementation=_MOE,
            state="mamba2",
            ssm_attrs=("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel"),
            notes="Mamba2, attention, MLP-only and MoE blocks (layers_block_type): KV for the attention blocks, "
            "a Mamba2 state for the Mamba2 blocks, nothing for the others",
        ),
        ArchSpec(
            "FalconH1ForCausalLM",
            logit_multiplier_attr="lm_head_multiplier",
            state="mamba2",
            ssm_attrs=_HYBRID_MAMBA2_ATTRS,
            notes="every layer runs attention and a Mamba2 mixer side by side (KV and a Mamba2 state each); "
            "muP multipliers are transformers' own; logits multiplied by lm_head_multiplier",
        ),
        ArchSpec(
            "Zamba2ForCausalLM",
            state="mamba2",
            ssm_attrs=("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv"),
            notes="Mamba2 layers and hybrid layers (a Mamba2 state and KV each): one shared attention block "
            "(weights tied across the layers that run it, per-layer LoRA adapters) told its layer per call "
            "(kvforge.graphs.lowering.shared_layers)",
        ),
        ArchSpec(
            "GptOssForCausalLM",
            experts_implementation=_MOE,
            notes="attention sinks (s_aux: one softmax logit per head), alternating sliding windows, "
            "MoE experts (biased, clamped SwiGLU) exported with batched_mm",
        ),
    )
}


class UnsupportedArchitectureError(ValueError):
    pass


def supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def lookup(architecture: str | None, generic: bool = False) -> ArchSpec:
    """The entry for ``architecture``. Without one: the generic, unverified spec if ``generic``,
    else an error that lists the supported families."""
    if architecture in ARCHITECTURES:
        return ARCHITECTURES[architecture]
    if generic and architecture:
        return ArchSpec(architecture, verified=False, notes="generic path, unverified")
    raise UnsupportedArchitectureError(
        f"architecture {architecture!r} is not supported; kvforge verifies: {supported()}"
    )


@dataclass(frozen=True)
class Dims:
    """The model dimensions the KV contract needs, read from a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> Dims:
        # a family with no attention layer names no attention heads: Mamba2's mixer heads, else one
        # nominal head of the hidden size (Mamba); no KV is allocated for it (its layout lists no attention layer)
        num_heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None) or 1
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if getattr(config, "kv_lora_rank", None):  # latent attention: keys and values expanded to every head
            head_dim, num_kv_heads = max(config.qk_head_dim, config.v_head_dim), num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )


def state_layout(spec: ArchSpec, config: Any, dtype: str) -> Layout:
    """Which layers of a model of family ``spec`` keep attention KV and which a state, with each
    state tensor's per-row shape and dtype (``dtype``: the model's, numpy-style), from its
    transformers ``config``. Every layer attends unless ``spec.state`` says otherwise."""
    n = config.num_hidden_layers
    if spec.state is None:
        return Layout.all_attention(n)
    if spec.state == "conv":  # LFM2: layer_types[i] == "conv" is a short convolution of kernel conv_L_cache
        conv = [i for i, t in enumerate(config.layer_types[:n]) if t == "conv"]
        width = config.conv_L_cache - 1
        entries = tuple(StateEntry(i, "conv", (StateTensor("conv", (config.hidden_size, width), dtype),)) for i in conv)
        return Layout(tuple(i for i in range(n) if i not in conv), entries)
    if spec.state == "mamba":  # Mamba mixers where layer_types says "linear_attention" (every layer of Mamba)
        return _mamba_layout(config, n, dtype)
    if spec.state == "gated_delta":
        return _gated_delta_layout(config, dtype)
    if spec.state == "mamba2":
        return _mamba2_layout(spec, config, dtype)
    raise ValueError(f"state kind {spec.state!r} of {spec.architecture} has no layout reader")


# Mamba mixer sizes under each family's config names: (channels D, state size N, conv kernel K).
_MAMBA_SIZES = (
    ("intermediate_size", "state_size", "conv_kernel"),  # Mamba, FalconMamba
    ("mamba_expand", "mamba_d_state", "mamba_d_conv"),  # Jamba (D = mamba_expand * hidden_size)
)


def _mamba_layout(config: Any, n: int, dtype: str) -> Layout:
    """Mamba (v1) mixers: ``conv [D, K-1]`` in the model's dtype, ``recurrent [D, N]`` float32 (the
    dtype transformers keeps the scan state in) for each ``linear_attention`` layer."""
    for channels, size, kernel in _MAMBA_SIZES:
        if hasattr(config, size):
            width = getattr(config, channels)
            if channels == "mamba_expand":
                width *= config.hidden_size
            conv = StateTensor("conv", (width, getattr(config, kernel) - 1), dtype)
            recurrent = StateTensor("recurrent", (width, getattr(config, size)), "float32")
            break
    else:
        raise ValueError(f"{type(config).__name__} names no Mamba state size kvforge knows ({_MAMBA_SIZES})")
    mixers = [i for i, t in enumerate(list(config.layer_types)[:n]) if t == "linear_attention"]
    entries = tuple(StateEntry(i, "mamba", (conv, recurrent)) for i in mixers)
    return Layout(tuple(i for i in range(n) if i not in mixers), entries)


def _gated_delta_layout(config: Any, dtype: str) -> Layout:
    """Gated DeltaNet families: ``layer_types[i] == "linear_attention"`` keeps the causal conv's
    last ``K-1`` inputs over its channels (query, key and value: ``2·Hk·Dk + Hv·Dv``), in the
    model's dtype, and the delta rule's state ``[Hv, Dk, Dv]`` in float32 (transformers' kernels
    run it in float32); every other layer attends. KDA families (Kimi-Linear, Bailing-hybrid) name
    one head count and size for queries, keys and values (``linear_num_heads``, ``linear_head_dim``)."""
    n = config.num_hidden_layers
    linear = [i for i, t in enumerate(config.layer_types[:n]) if t == "linear_attention"]
    if hasattr(config, "linear_key_head_dim"):
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    else:  # KDA
        dk = dv = config.linear_head_dim
        hk = hv = config.linear_num_heads
    conv = StateTensor("conv", (2 * hk * dk + hv * dv, config.linear_conv_kernel_dim - 1), dtype)
    recurrent = StateTensor("recurrent", (hv, dk, dv), "float32")
    entries = tuple(StateEntry(i, "gated_delta", (conv, recurrent)) for i in linear)
    return Layout(tuple(i for i in range(n) if i not in linear), entries)


def _mamba2_layout(spec: ArchSpec, config: Any, dtype: str) -> Layout:
    """Mamba2 layers are ``layer_types[i] == "linear_attention"`` (transformers' name for them in
    every Mamba2 family); each keeps ``conv [H*P + 2*G*N, K-1]`` in the model's dtype and
    ``recurrent [H, N, P]`` float32 (transformers' ``[H, P, N]`` transposed: the layout ONNX Runtime's
    ``LinearAttention`` updates in place, so the ``gqa`` graphs bind it with no transpose). Attention layers
    (``"full_attention"``) keep KV, a ``"hybrid"`` layer both (Falcon-H1: attention and a Mamba2 mixer
    side by side); any other layer type (Nemotron-H's MLP-only blocks) keeps neither."""
    n = config.num_hidden_layers
    heads, head_dim, size, groups, kernel = (int(getattr(config, a)) for a in spec.ssm_attrs)
    types = list(config.layer_types[:n])
    conv = StateTensor("conv", (heads * head_dim + 2 * groups * size, kernel - 1), dtype)
    recurrent = StateTensor("recurrent", (heads, size, head_dim), "float32", axes="hnp")
    entries = tuple(StateEntry(i, "mamba2", (conv, recurrent)) for i, t in enumerate(types) if t in _MAMBA2_TYPES)
    return Layout(tuple(i for i, t in enumerate(types) if t in _ATTENTION_TYPES), entries)


# transformers' layer type names: "hybrid" is a layer with both (Falcon-H1)
_MAMBA2_TYPES = ("linear_attention", "hybrid")
_ATTENTION_TYPES = ("full_attention", "hybrid")
