"""The generic path: a family outside the table compiles when its parity check passes, and is
refused, naming the verified families, when it fails or cannot take the path at all. What the path
reads from transformers' modeling source (experts implementation, logit scaling, the soft-cap's
multiply not taken for a scale, a head module before the output embeddings, complex rotary
arithmetic) and the refusals it gives before export (multimodal, encoder-decoder, encoder,
recurrent layers, no AttentionInterface dispatch, attention classes from a table keyed by
attn_implementation, chunked attention past one chunk, expert loops transformers cannot batch,
layers that call attention twice or pass it a tensor it does not implement, a generation cache that keeps fewer
keys than the attention reads within max_seq) are checked on the real transformers classes,
without exporting."""

from __future__ import annotations

import json
import types

import pytest
import torch
import transformers

from kvforge.compile import compile_model, generic
from kvforge.compile.load import load_model, resolve_spec
from kvforge.graphs import lowering
from kvforge.graphs.architectures import UnsupportedArchitectureError
from kvforge.runtime import Engine
from tests import families
from tests.helpers import load_benchmark


def test_unlisted_family_passes_its_parity_check(tmp_path):
    overrides = {"sliding_window": None, "use_bias": True}
    model = families.build(tmp_path / "m", "Starcoder2ForCausalLM", "Starcoder2Config", overrides)
    messages = []
    manifest = compile_model(model, tmp_path / "out", max_batch=1, max_seq=32, progress=messages.append)
    assert any("not in kvforge's verified table: taking the generic path" in m for m in messages)
    assert manifest.parity["verified_family"] is False and manifest.parity["greedy_match"] is True
    assert manifest.parity["decode_max_abs_diff"] < 1e-3
    with Engine.load(tmp_path / "out") as engine:
        assert len(engine.generate([[1, 2, 3]], max_new_tokens=4)[0].token_ids) == 4


def test_unlisted_family_failing_parity_is_refused(tmp_path, monkeypatch):
    # Cohere multiplies its logits by config.logit_scale; blind the source reader to it, and the
    # parity gate must refuse the family rather than ship wrong logits.
    monkeypatch.setattr(generic, "_LOGIT_SCALE", generic.re.compile(r"(?!x)x"))
    model = families.build(tmp_path / "m", "CohereForCausalLM", "CohereConfig", {"logit_scale": 0.25})
    with pytest.raises(UnsupportedArchitectureError, match=r"failed its parity check .*kvforge verifies: .*Llama"):
        compile_model(model, tmp_path / "out", max_batch=1, max_seq=32, progress=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("architecture", "model_type", "message"),
    [
        ("BertForMaskedLM", "bert", "not a decoder-only causal LM that transformers .* knows"),
        ("RwkvForCausalLM", "rwkv", r"WKV recurrence on the CPU \(rwkv_linear_attention_cpu\) loops over tokens"),
        ("MiniMaxForCausalLM", "minimax", r"lightning-attention layers \(MiniMaxLightningAttention\) run"),
        ("RecurrentGemmaForCausalLM", "recurrent_gemma", r"module attributes \(conv1d_state, rg_lru"),
        ("xLSTMForCausalLM", "xlstm", r"mLSTM blocks keep a matrix memory per head .* xLSTMCache.rnn_state"),
        ("Qwen4ExpForCausalLM", "qwen4_exp_text", r"sparse attention whose indexer \(Qwen4ExpTextQSAIndexer\)"),
        ("InklingForCausalLM", "inkling_text", r"learned relative-position bias to the scores \(position_bias"),
        ("ZambaForCausalLM", "zamba", r"Mamba mixers \(ZambaMambaMixer\) call transformers' selective scan directly"),
        ("Gemma3ForConditionalGeneration", "gemma3", "multimodal model"),
        ("BartForCausalLM", "bart", "decoder half of an encoder-decoder model"),
        ("BertLMHeadModel", "bert", r"encoder \(masked-LM\) family"),
        ("BertGenerationDecoder", "bert-generation", r"encoder \(masked-LM\) family"),
        # GIT's text attention comes from a dict keyed by attn_implementation; only its vision tower
        # dispatches through AttentionInterface (transformers itself would fail with KeyError 'kvforge').
        ("GitForCausalLM", "git", r"attention classes picked from GIT_SELF_ATTENTION_CLASSES \(eager\)"),
    ],
)
def test_families_that_cannot_take_the_generic_path(tmp_path, architecture, model_type, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type}))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match=f"{message}.*; kvforge verifies: .*MistralForCausalLM"):
        compile_model(tmp_path / "m", tmp_path / "out", progress=None)


# Two conditions kvforge checks in a family's modeling source, each on a family of its own (remote
# code written here), so the refusal does not depend on a transformers family staying unconverted:
# Falcon computed attention itself and LongcatFlash looped over its experts until transformers 5.25.
_CONFIGURATION = """
from transformers import PretrainedConfig


class {name}Config(PretrainedConfig):
    model_type = "{model_type}"
"""

_MODELING = """
import torch
from transformers import GenerationMixin, PreTrainedModel

from .configuration_{model_type} import {name}Config
{body}

class {name}ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = {name}Config
"""

# attention computed in the module: softmax(q k^T) v, no dispatch through AttentionInterface
_OWN_ATTENTION = """
class {name}Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1) @ v
"""

# attention dispatched through AttentionInterface, but experts looped over with data-dependent control flow
_EXPERT_LOOP = """
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class {name}Attention(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, q, k, v, mask)


class {name}Experts(torch.nn.Module):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        expert_hit = torch.unique(top_k_index)
        for expert_idx in expert_hit:
            out = out + self.experts[expert_idx](hidden_states)
        return out
"""


@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        ("OwnAttn", _OWN_ATTENTION, r"do not dispatch attention through AttentionInterface"),
        ("LoopMoe", _EXPERT_LOOP, r"MoE experts that loop over the experts the tokens picked"),
    ],
)
def test_modeling_source_conditions_refuse_before_export(tmp_path, name, body, message):
    model_type = name.lower()
    root = tmp_path / "m"
    root.mkdir()
    (root / f"configuration_{model_type}.py").write_text(_CONFIGURATION.format(name=name, model_type=model_type))
    source = _MODELING.format(name=name, model_type=model_type, body=body.format(name=name))
    (root / f"modeling_{model_type}.py").write_text(source)
    config = {
        "architectures": [f"{name}ForCausalLM"],
        "model_type": model_type,
        "auto_map": {
            "AutoConfig": f"configuration_{model_type}.{name}Config",
            "AutoModelForCausalLM": f"modeling_{model_type}.{name}ForCausalLM",
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"")  # refused before any weight is read
    with pytest.raises(UnsupportedArchitectureError, match=f"{message}.*; kvforge verifies: .*MistralForCausalLM"):
        compile_model(root, tmp_path / "out", trust_remote_code=True, progress=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["falcon", "longcat_flash"])
def test_families_transformers_5_25_converted_compile_token_exact(model_type, tmp_path):
    # Falcon dispatches attention through ALL_ATTENTION_FUNCTIONS and LongcatFlash's experts take
    # @use_experts_implementation since transformers 5.25: both now take the generic path, and the
    # coverage survey's two checks (compile's parity record, Engine greedy tokens against generate) pass.
    coverage = load_benchmark("coverage")
    [result] = coverage.survey([model_type], tmp_path, timeout=600, jobs=1, say=lambda _: None)
    assert result.result == coverage.TOKEN_EXACT, f"{model_type}: {result.result}: {result.detail}"


def test_class_flag_is_not_the_test_the_modeling_source_is():
    # StableLM does not set _supports_attention_backend, but its attention goes through
    # ALL_ATTENTION_FUNCTIONS: the generic path takes it.
    assert not getattr(transformers.StableLmForCausalLM, "_supports_attention_backend", False)
    spec = resolve_spec({"architectures": ["StableLmForCausalLM"], "model_type": "stablelm"})
    assert not spec.verified and spec.experts_implementation is None and spec.logit_scale(object()) == 1.0


@pytest.mark.parametrize(
    ("architecture", "config", "scale", "softcap"),
    [
        ("CohereForCausalLM", {"logit_scale": 0.25}, 0.25, 0.0),  # logits * self.logit_scale
        ("GraniteMoeForCausalLM", {"logits_scaling": 4.0}, 0.25, 0.0),  # logits / config.logits_scaling
        ("HyperCLOVAXForCausalLM", {"logits_scaling": 4.0}, 4.0, 0.0),  # lm_head(...) * config.logits_scaling
        ("MiniCPM3ForCausalLM", {"logits_scaling": 4.0}, 0.25, 0.0),  # hidden_states / config.logits_scaling
        ("VaultGemmaForCausalLM", {"final_logit_softcapping": 30.0}, 1.0, 30.0),
        ("Starcoder2ForCausalLM", {}, 1.0, 0.0),
        # "logits = logits * self.config.final_logit_softcapping" ends the soft-cap: not a scale
        ("BeamForCausalLM", {"final_logit_softcapping": 30.0}, 1.0, 30.0),
    ],
)
def test_logit_scaling_is_read_from_the_forward_source(architecture, config, scale, softcap):
    spec = generic.spec(architecture, getattr(transformers, architecture))
    attrs = type("Config", (), config)
    assert spec.logit_scale(attrs) == pytest.approx(scale)
    assert spec.final_logit_softcap(attrs) == softcap


def test_moe_families_export_experts_with_batched_mm():
    assert generic.spec("OlmoeForCausalLM", transformers.OlmoeForCausalLM).experts_implementation == "batched_mm"
    assert generic.spec("Starcoder2ForCausalLM", transformers.Starcoder2ForCausalLM).experts_implementation is None


@pytest.mark.parametrize(
    ("architecture", "config_class", "overrides", "message"),
    [
        # DiffLlama's differential attention calls the attention function twice per layer (two value
        # halves): two caches per layer, which the KV contract has no place for.
        ("DiffLlamaForCausalLM", "DiffLlamaConfig", {}, r"layers \[0, 1\] call the attention function more than once"),
    ],
)
def test_the_shape_probe_refuses_before_export(tmp_path, architecture, config_class, overrides, message):
    model = families.build(tmp_path / "m", architecture, config_class, overrides)
    messages = []
    with pytest.raises(UnsupportedArchitectureError, match=message):
        compile_model(model, tmp_path / "out", max_batch=1, max_seq=32, progress=messages.append)
    assert not any("exporting" in m for m in messages)  # refused at load, before export


def test_the_shape_probe_names_tensors_the_attention_does_not_implement():
    # Attention sinks (s_aux: GPT-OSS, Granite-SWA, MiMo-V2-Flash, Flint) are the op's; any other
    # tensor a family hands the attention function would change the attention: the probe names it.
    records: dict = {}
    module = types.SimpleNamespace(layer_idx=0)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    out, _ = lowering.kvforge_attention(
        module, q, k, k, None, s_aux=torch.zeros(4), position_ids=torch.arange(3)[None], kvforge_probe=records
    )
    assert records["unhandled"] == set() and out.shape == (1, 3, 4, 8)
    lowering.kvforge_attention(module, q, k, k, None, bias_table=torch.zeros(4), kvforge_probe=records)
    assert records["unhandled"] == {"bias_table"}


def test_a_shared_attention_module_is_keyed_by_the_layer_each_call_names():
    # Zamba2: one attention module (layer_idx -1) run at several layers, each call naming its layer;
    # the probe records each call under that layer, and a module with its own layer keeps it.
    class Shared(torch.nn.Module):
        layer_idx = -1

        def forward(self, q, layer_idx, k=None):
            return lowering.kvforge_attention(self, q, k, k, None)[0]

    class Own(torch.nn.Module):
        layer_idx = 2

        def forward(self, q, k):
            return lowering.kvforge_attention(self, q, k, k, None)[0]

    model = torch.nn.ModuleDict({"shared": Shared(), "own": Own()})
    assert lowering.shared_layers(model) == 1 and lowering.shared_layers(model) == 1  # idempotent: one hook
    records: dict = {}
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with lowering.active(records):
        model["shared"](q, 3, k=k)
        model["shared"](q, layer_idx=0, k=k)
        model["own"](q, k)
    assert sorted(r for r in records if r != "unhandled") == [0, 2, 3]
    assert all(len(records[r]) == 1 for r in (0, 2, 3))


def test_a_head_before_the_output_embeddings_is_read_from_the_forward_source():
    # ModernBERT-decoder: logits = self.decoder(self.lm_head(hidden_states)), lm_head a dense + norm head
    spec = generic.spec("ModernBertDecoderForCausalLM", transformers.ModernBertDecoderForCausalLM)
    assert spec.head_attr == "lm_head"
    assert generic.spec("LlamaForCausalLM", transformers.LlamaForCausalLM).head_attr is None


@pytest.mark.parametrize(("max_seq", "refused"), [(32, True), (None, True), (16, False)])
def test_chunked_attention_is_refused_past_one_chunk(max_seq, refused):
    # Llama 4: a query attends only its own chunk's keys; within one chunk that is causal attention.
    config = transformers.Llama4TextConfig(
        num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"], attention_chunk_size=16
    )
    why = generic.chunked_attention_refusal(config, max_seq)
    assert (why is not None) == refused
    if refused:
        assert why.startswith("layers [0] use chunked attention (attention_chunk_size=16") and "--max-seq 16" in why
    assert generic.chunked_attention_refusal(transformers.LlamaConfig(num_hidden_layers=2), 32) is None


def test_complex_rotary_arithmetic_is_read_from_the_modeling_source():
    # DeepSeek-V2 and Llama 4 rotate with view_as_complex/polar: export carries them as real pairs
    assert generic.spec("DeepseekV2ForCausalLM", transformers.DeepseekV2ForCausalLM).complex_arithmetic
    assert generic.spec("Llama4ForCausalLM", transformers.Llama4ForCausalLM).complex_arithmetic
    assert not generic.spec("DeepseekV3ForCausalLM", transformers.DeepseekV3ForCausalLM).complex_arithmetic


def _layers(*windows):
    return [generic.LayerShapes(2, 16, 16, 4, w) for w in windows]


@pytest.mark.parametrize(
    ("attention", "cache", "max_seq", "refused"),
    [
        ((None, None), (8, 8), 32, True),  # Moshi: full-causal attention, sliding generation cache
        ((None, None), (8, 8), 8, False),  # ... within the window forward and generate agree
        ((8, None), (8, None), 32, False),  # Mistral/Gemma-style: the attention gets the cache's window
        ((16, None), (8, None), 32, True),  # the attention reads further back than the cache keeps
        ((4, None), (8, None), 32, False),  # a cache that keeps more than the attention reads
        ((None, None), None, 32, False),  # transformers cannot say: no refusal
    ],
)
def test_a_generation_cache_narrower_than_the_attention_is_found(attention, cache, max_seq, refused):
    why = generic.window_mismatch(_layers(*attention), list(cache) if cache else None, max_seq)
    assert (why is not None) == refused
    if refused:
        assert "kvforge cannot match both" in why and f"--max-seq {min(c for c in cache if c)}" in why


def test_moshi_is_refused_at_load_unless_max_seq_stays_inside_its_window(tmp_path):
    # config.sliding_window without layer_types: transformers' generate keeps 8 keys, its forward all.
    model = families.build(tmp_path / "m", "MoshiForCausalLM", "MoshiConfig", {"sliding_window": 8, "head_dim": 16})
    with pytest.raises(
        UnsupportedArchitectureError, match=r"layers \[0, 1\] get no sliding window in their attention .* last 8 keys"
    ):
        load_model(model, max_seq=32)
    assert load_model(model, max_seq=8).dims.num_layers == 2
