"""The generic path: a family outside the table compiles when its parity check passes, and is
refused, naming the verified families, when it fails or cannot take the path at all."""

from __future__ import annotations

import json

import pytest

from kvforge.compile import compile_model
from kvforge.graphs.architectures import UnsupportedArchitectureError
from kvforge.runtime import Engine
from tests import families


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


def test_unlisted_family_failing_parity_is_refused(tmp_path):
    # Cohere multiplies its logits by config.logit_scale, which the generic path does not know.
    model = families.build(tmp_path / "m", "CohereForCausalLM", "CohereConfig", {"logit_scale": 0.25})
    with pytest.raises(UnsupportedArchitectureError, match=r"failed its parity check .*kvforge verifies: .*Llama"):
        compile_model(model, tmp_path / "out", max_batch=1, max_seq=32, progress=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("architecture", "model_type", "message"),
    [
        ("FalconForCausalLM", "falcon", "do not dispatch attention through AttentionInterface"),
        ("BertForMaskedLM", "bert", "not a decoder-only causal LM that transformers .* knows"),
    ],
)
def test_families_that_cannot_take_the_generic_path(tmp_path, architecture, model_type, message):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": [architecture], "model_type": model_type}))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match=f"{message}; kvforge verifies: .*MistralForCausalLM"):
        compile_model(tmp_path / "m", tmp_path / "out", progress=None)
