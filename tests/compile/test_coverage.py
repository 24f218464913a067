"""The coverage survey's fixed CI sample (benchmarks/coverage.py ``SAMPLE``): one family per
distinct path of the generic compile path, each surveyed as the full survey does (tiny config from
the config class's defaults, a subprocess per family, compile, parity, Engine greedy tokens against
transformers' generate), with its exact result: token-exact for a plain generic family without the
class flag, partial rotary + parallel residual, MoE, a logit scale and a head before the output
embeddings; refused before export for a state-space family and (by the shape probe at load) for one
whose generation cache keeps fewer keys than its attention reads; not a decoder-only LM for an
encoder. Also: the tiny configs keep one layer
per layer type, and the markdown counts what it lists."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def coverage():
    return load_benchmark("coverage")


def test_the_sample_gives_each_family_its_expected_result(coverage, tmp_path):
    results = coverage.survey(list(coverage.SAMPLE), tmp_path, timeout=600, jobs=2, say=lambda _: None)
    got = {r.model_type: (r.result, r.detail) for r in results}
    for model_type, (expected, phrase) in coverage.SAMPLE.items():
        result, detail = got[model_type]
        assert result == expected, f"{model_type}: {result}: {detail}"
        assert phrase in detail, f"{model_type}: {detail!r} does not say {phrase!r}"
    doc = coverage.markdown(results, "python benchmarks/coverage.py --sample", {"transformers": "x"}, 1.0)
    assert "| token-exact | 5 |" in doc and "| refused | 2 |" in doc and "| **total** | 8 |" in doc
    assert "| rwkv | RwkvForCausalLM | refused: " in doc


def test_tiny_configs_keep_one_layer_of_each_type(coverage):
    config = coverage.tiny_config("gemma3_text")  # 5 sliding layers, then 1 full, by default
    assert config.num_hidden_layers == 2 and config.layer_types == ["sliding_attention", "full_attention"]
    assert (config.hidden_size, config.num_attention_heads, config.head_dim, config.vocab_size) == (64, 4, 16, 256)
    llama4 = coverage.tiny_config("llama4_text")  # moe_layers lists layer indices [0..47], not one value per layer
    assert llama4.num_hidden_layers == 2 and llama4.layer_types == ["chunked_attention", "full_attention"]
    assert llama4.moe_layers == [0, 1]
    moe = coverage.tiny_config("deepseek_v2")  # its default num_experts_per_tok is None
    assert moe.num_experts_per_tok == 2 and moe.n_routed_experts == 4 and moe.first_k_dense_replace <= 1


def test_the_readme_counts_are_rewritten_between_their_markers(coverage, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{coverage._COUNTS_START}\nold counts\n{coverage._COUNTS_END}\nrest\n")
    results = [
        coverage.Result("llama", "LlamaForCausalLM", coverage.TOKEN_EXACT),
        coverage.Result("mamba", "MambaForCausalLM", coverage.REFUSED, "recurrent"),
    ]
    coverage.update_readme(readme, results, {"transformers": "5.24.0"})
    text = readme.read_text()
    assert "old counts" not in text and text.startswith("intro\n") and text.endswith("rest\n")
    assert "With transformers 5.24.0: of 2 model types, **1** token-exact, **1** refused, **0** failed" in text
