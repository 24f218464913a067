"""The families whose attention takes sinks (``s_aux``) and that compile on the generic path,
end to end: Flint, Granite-SWA, GraniteMoE-SWA and MiMo-V2-Flash (whose full-attention layers have
half the KV heads of its sliding ones: the cache takes the larger count, the smaller layers' heads
repeated). GPT-OSS is in the verified table and runs in tests/runtime/test_families.py.

Each is built from its config class's defaults shrunk, as the coverage survey builds it
(``benchmarks/coverage.py``'s ``tiny_config``: windows of 8 tokens, sliding and full layers), with
its sinks drawn at random (Granite-SWA's init leaves them at 0), compiled under one of the two
lowerings (``gqa``: the sinks are GroupQueryAttention's ``head_sink``, and the rotary still moves
into it), and checked as the verified families are: prefill and decode logits within tolerance of
transformers, 24 greedy tokens equal to transformers' ``generate`` for batch 1 and for each row of
a ragged batch of 2, and a prompt prefilled in two chunks gives the logits of one call.
"""

from __future__ import annotations

import onnx
import pytest
import torch

from kvforge.compile import compile_model
from kvforge.runtime import Engine
from tests.helpers import assert_close, hf_greedy, load_benchmark
from tests.runtime.test_families import ATOL, PROMPTS, RTOL, _hf_steps

NEW_TOKENS = 24  # prompts + outputs cross the 8-token windows; 12 + 24 < max_seq 48

# (model_type, lowering): every family once, the lowerings alternated (the repeated KV heads are
# the attention function's, before either lowering)
CASES = [("flint", "onnx"), ("granite_swa", "gqa"), ("granitemoe_swa", "onnx"), ("mimo_v2_flash", "gqa")]


def _build(model_type: str, path) -> torch.nn.Module:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    coverage = load_benchmark("coverage")
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    config = coverage.tiny_config(model_type)
    config.architectures = [architecture]
    config.eos_token_id = None  # no early stop: full-length greedy runs are compared
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    coverage._randomize_zero_matrices(model)
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert sinks, f"{model_type}: no attention sinks"
    with torch.no_grad():
        for s in sinks:
            s.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "lowering"), CASES, ids=[f"{t}-{lw}" for t, lw in CASES])
def test_sink_family_is_token_exact(model_type, lowering, tmp_path):
    reference = _build(model_type, tmp_path / "model")
    manifest = compile_model(
        tmp_path / "model",
        tmp_path / "out",
        max_batch=2,
        max_seq=48,
        lowering=lowering,
        score_graph=False,
        optimize=lowering == "gqa",
        progress=None,
    )
    assert manifest.parity["greedy_match"] and not manifest.parity["verified_family"]
    if lowering == "gqa":  # the sinks go to GroupQueryAttention's head_sink (input 11) of each layer that has them
        graph = onnx.load(str(tmp_path / "out" / "prefill.ort.onnx"), load_external_data=False).graph
        attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        with_sinks = [n for n in attentions if len(n.input) > 11 and n.input[11]]
        layers = [m for m in reference.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
        assert len(with_sinks) == len(layers) > 0
        if model_type == "granite_swa":  # its rotary still moves into the attention beside the sinks
            assert all(any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) for n in attentions)
            assert not [n for n in graph.node if n.op_type == "RotaryEmbedding"]

    with Engine.load(tmp_path / "out") as engine:
        expected = hf_greedy(reference, PROMPTS[0], NEW_TOKENS)
        steps = expected[:12]
        ours = [engine.prefill([PROMPTS[0]])[0].copy()]
        for token in steps:
            ours.append(engine.decode([token])[0].copy())
        for i, (a, b) in enumerate(zip(ours, _hf_steps(reference, PROMPTS[0], steps))):
            assert_close(a, b, ATOL, RTOL, f"{model_type}: {'prefill' if i == 0 else f'decode step {i}'} logits")

        [alone] = engine.generate([PROMPTS[0]], max_new_tokens=NEW_TOKENS)
        assert alone.token_ids == expected
        batch = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
        assert batch[0].token_ids == expected
        assert batch[1].token_ids == hf_greedy(reference, PROMPTS[1], NEW_TOKENS)

        # The 12-token prompt in chunks of 5 and 7 (the second crosses the 8-token window)
        one_shot = engine.prefill([PROMPTS[0]])[0].copy()
        engine.prefill([PROMPTS[0][:5]])
        chunked = engine.prefill([PROMPTS[0][5:]], start=[5])[0].copy()
        assert_close(chunked, one_shot, 1e-5, 1e-5, f"{model_type}: chunked prefill logits")
