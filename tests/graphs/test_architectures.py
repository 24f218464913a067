"""The architecture table: lookups, errors that list what is supported, and the mirrored test table."""

from __future__ import annotations

import pytest

from kvforge.graphs import architectures
from tests.families import CASES


def test_every_entry_has_a_tiny_test_config():
    tested = {arch for _, arch, _, _ in CASES}
    missing = set(architectures.ARCHITECTURES) - tested
    assert not missing, f"architecture entries without a tiny test config in tests/families.py: {sorted(missing)}"
    assert tested <= set(architectures.ARCHITECTURES)


def test_unknown_architecture_lists_supported():
    with pytest.raises(architectures.UnsupportedArchitectureError) as err:
        architectures.lookup("BertForMaskedLM")
    assert "'BertForMaskedLM' is not supported" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen3MoeForCausalLM" in str(err.value)


def test_generic_spec_is_unverified():
    spec = architectures.lookup("StarcoderForCausalLM", generic=True)
    assert not spec.verified and spec.architecture == "StarcoderForCausalLM"
    assert architectures.lookup("LlamaForCausalLM", generic=True).verified


def test_logit_fields_read_the_config():
    class Config:
        final_logit_softcapping = 30.0
        logits_scaling = 4.0

    assert architectures.ARCHITECTURES["Gemma2ForCausalLM"].final_logit_softcap(Config) == 30.0
    assert architectures.ARCHITECTURES["GraniteForCausalLM"].logit_scale(Config) == 0.25
    assert architectures.ARCHITECTURES["LlamaForCausalLM"].logit_scale(Config) == 1.0
