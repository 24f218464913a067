"""Tiny test configs, one or more per entry of ``kvforge.graphs.architectures.ARCHITECTURES``.

The mirror of the architecture table (tests/graphs/test_architectures.py fails when an entry has
no config here). Each case is (id, architecture, transformers config class, kwargs). Weights are
random with a larger ``initializer_range`` than real models, so greedy choices are not near-ties
that float rounding could flip. Windows are 8 tokens so that test sequences cross them.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,  # no early stop: the tests compare full-length greedy runs
    pad_token_id=None,
)
WINDOW = 8
LFM2_LAYERS = ["conv", "full_attention", "conv", "conv"]
# untied output embeddings: Mamba's residual stream keeps the input token's embedding, so tied
# logits would repeat the input token
MAMBA = {"state_size": 8, "conv_kernel": 4, "expand": 2, "time_step_rank": 8, "tie_word_embeddings": False}
# Gated DeltaNet layers (a conv and a float32 recurrent state) beside one attention layer; 2 key heads
# serve 4 value heads (grouped value attention)
GATED_DELTA = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
GATED_DELTA_MOE = dict(
    GATED_DELTA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)
# KDA layers (a decay per key channel) beside one latent-attention layer, with MoE after the first layer
KDA = dict(
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
)
# the Mamba2 mixer of the hybrid families (Granite 4, Bamba, Falcon-H1): 8 heads of 16 over hidden 64 x 2
MAMBA2_HYBRID = dict(
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8, mamba_expand=2
)

CASES: list[tuple[str, str, str, dict]] = [
    ("llama", "LlamaForCausalLM", "LlamaConfig", {}),
    (
        "llama-rope-llama3",
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    (
        "llama-rope-linear",
        "LlamaForCausalLM",
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    ("mistral-window", "MistralForCausalLM", "MistralConfig", {"sliding_window": WINDOW}),
    ("qwen2-bias-tied", "Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}),
    (
        "qwen2-sliding-layers",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    ("qwen3-qk-norm", "Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
    (
        "phi3-longrope",
        "Phi3ForCausalLM",
        "Phi3Config",
        {
            "max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(8)],
                "long_factor": [1.5 + 0.2 * i for i in range(8)],
                "original_max_position_embeddings": 32,  # test sequences cross it
            },
        },
    ),
    ("gemma", "GemmaForCausalLM", "GemmaConfig", {"head_dim": 16}),
    (
        "gemma2-softcap-window",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 5.0,  # small caps, so the soft-cap is exercised
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    (
        "gemma3-text",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {"head_dim": 16, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    (
        "gpt2",
        "GPT2LMHeadModel",
        "GPT2Config",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128},
    ),
    ("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", {"rotary_pct": 0.25, "use_parallel_residual": True}),
    (
        "granite",
        "GraniteForCausalLM",
        "GraniteConfig",
        {"embedding_multiplier": 6.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 4.0},
    ),
    ("olmo2", "Olmo2ForCausalLM", "Olmo2Config", {}),
    ("mixtral", "MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    (
        "qwen3-moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    # short-convolution layers (a conv state [C, K-1]) beside attention layers (KV only for those)
    ("lfm2", "Lfm2ForCausalLM", "Lfm2Config", {"num_hidden_layers": 4, "layer_types": LFM2_LAYERS, "conv_L_cache": 3}),
    (
        "lfm2-moe",
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": LFM2_LAYERS,
            "num_dense_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
        },
    ),
    # Mamba (v1) mixers: a conv state [D, K-1] and a selective-scan state [D, N] per layer, no KV
    ("mamba", "MambaForCausalLM", "MambaConfig", MAMBA),
    ("falcon-mamba", "FalconMambaForCausalLM", "FalconMambaConfig", MAMBA),
    (
        "jamba",
        "JambaForCausalLM",
        "JambaConfig",
        {
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
            "tie_word_embeddings": False,
        },
    ),
    (
        "lfm3",
        "Lfm3ForCausalLM",
        "Lfm3Config",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
            "conv_L_cache": 3,
            "sliding_window": WINDOW,
            "head_dim": 16,
        },
    ),
    ("qwen3.5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", GATED_DELTA),
    ("qwen3.5-moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", GATED_DELTA_MOE),
    ("qwen3-next", "Qwen3NextForCausalLM", "Qwen3NextConfig", GATED_DELTA_MOE),
    ("olmo-hybrid", "OlmoHybridForCausalLM", "OlmoHybridConfig", GATED_DELTA),
    ("kimi-linear", "KimiLinearForCausalLM", "KimiLinearConfig", KDA),
    (
        "bailing-hybrid",
        "BailingHybridForCausalLM",
        "BailingHybridConfig",
        # Bailing names KDA's sizes after its attention's (head_dim, num_attention_heads) and bounds
        # its forget gate (kda_safe_gate: lower_bound * sigmoid)
        {k: v for k, v in KDA.items() if not k.startswith("linear_")} | {"head_dim": 16, "short_conv_kernel_size": 4},
    ),
    (
        "lara-mini-window",
        "LaraMiniForCausalLM",
        "LaraMiniConfig",
        dict(
            GATED_DELTA_MOE,
            layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
            sliding_window=WINDOW,
        ),
    ),
    # Mamba2 (SSD) layers: conv [C, K-1] and recurrent [H, P, N] states; chunk_size 8, so that
    # transformers' own scan (the reference) crosses chunks on the test prompts
    (
        "mamba2",
        "Mamba2ForCausalLM",
        "Mamba2Config",
        {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "chunk_size": 8, "expand": 2},
    ),
    (
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            **MAMBA2_HYBRID,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "position_embedding_type": "rope",
            "embedding_multiplier": 6.0,
            "attention_multiplier": 0.2,
            "residual_multiplier": 0.5,
            "logits_scaling": 4.0,
        },
    ),
    ("bamba", "BambaForCausalLM", "BambaConfig", {"num_hidden_layers": 3, "attn_layer_indices": [1], **MAMBA2_HYBRID}),
    (
        "nemotron-h",
        "NemotronHForCausalLM",
        "NemotronHConfig",
        {
            "head_dim": 16,
            # Mamba2, attention, MLP-only and MoE blocks (the last two keep no state and no KV)
            "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe", "linear_attention"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "chunk_size": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    (
        "falcon-h1",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        # every layer runs attention and a Mamba2 mixer side by side
        {"head_dim": 16, **MAMBA2_HYBRID, "mamba_d_ssm": 128, "lm_head_multiplier": 0.5, "embedding_multiplier": 2.0},
    ),
    (
        "zamba2",
        "Zamba2ForCausalLM",
        "Zamba2Config",
        # Mamba2 layers and hybrid ones (a Mamba2 mixer after the shared attention block, which two
        # blocks of tied weights with per-layer LoRA adapters take turns running: one module, layer_idx -1)
        {
            "num_hidden_layers": 5,
            "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
            "n_mamba_heads": 8,
            "mamba_d_state": 16,
            "mamba_ngroups": 2,
            "chunk_size": 8,
            "num_mem_blocks": 2,
            "use_shared_attention_adapter": True,
            "adapter_rank": 8,
            "use_mem_rope": True,
            # as every published Zamba2: transformers' key/value adapters are sized for all heads
            "num_key_value_heads": 4,
        },
    ),
    (
        "gpt-oss-sinks-window",
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            # YaRN as gpt-oss ships it, scaled to the tiny context (its default expects 4096 tokens)
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
]

# Keys some config classes do not take (GPT-2 names its sizes n_*).
_GPT2_DROP = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}


def build(path: Path, architecture: str, config_class: str, overrides: dict, seed: int = 0) -> Path:
    """Save a tiny random model of the given family to ``path`` (config.json + model.safetensors)."""
    import transformers

    kwargs = dict(COMMON)
    if config_class == "GPT2Config":
        kwargs = {k: v for k, v in kwargs.items() if k not in _GPT2_DROP and k != "max_position_embeddings"}
    if config_class == "GPTNeoXConfig":  # multi-head attention only: no num_key_value_heads
        del kwargs["num_key_value_heads"]
    kwargs.update(overrides)
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(path)
    return path
