"""The architecture table: lookups, errors that list what is supported, and the mirrored test table."""

from __future__ import annotations

import pytest

from kvforge.graphs import architectures

# Mirror of architectures.ARCHITECTURES: every entry needs a tiny test config (see tests/conftest.py).
TESTED = {"LlamaForCausalLM"}


def test_every_entry_has_a_test_config():
    assert set(architectures.ARCHITECTURES) == TESTED


def test_unknown_architecture_lists_supported():
    with pytest.raises(architectures.UnsupportedArchitectureError) as err:
        architectures.lookup("BertForMaskedLM")
    assert "'BertForMaskedLM' is not supported" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)
