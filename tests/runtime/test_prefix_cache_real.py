"""The prefix cache on the real SmolLM2-135M-Instruct (opt-in: ``pytest -m real_model``): the
logits after importing a cached ~1,000-token prefix equal a from-scratch prefill within 1e-5, and a
greedy chat turn is identical with and without the cache.

The artifact: ``$KVFORGE_SMOLLM2_ARTIFACT`` if set, else the ``smollm2_dir`` fixture's directory
(``make smollm2``) compiled here with ``--max-seq 2048`` (a few minutes); skipped where neither exists."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvforge.runtime import Engine

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def artifact(request, tmp_path_factory) -> Path:
    given = os.environ.get("KVFORGE_SMOLLM2_ARTIFACT")
    if given:
        return Path(given)
    source = request.getfixturevalue("smollm2_dir")
    from kvforge.compile import compile_model

    out = tmp_path_factory.mktemp("smollm2") / "out"
    compile_model(source, out, max_seq=2048, progress=None)
    return out


def test_hit_logits_and_greedy_chat_equal_a_full_prefill(artifact):
    rules = " ".join(f"Rule {i}: answer questions about topic {i} briefly and kindly." for i in range(60))
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": "What is rule 7?"}]
    with Engine.load(artifact, prefix_cache=0) as plain, Engine.load(artifact) as cached:
        ids = plain.chat_prompt(messages)
        assert len(ids) > 900
        full = plain.prefill([ids])[0].copy()
        k = len(ids) - 20
        cached.prefill_rows([ids[:k]], [0], first=0)
        block = cached.export_kv(0, ids[:k])
        cached.prefill_rows([ids[:50]], [0], first=1)  # row 1 held something else
        cached.import_kv(block, 1)
        after = cached.prefill_rows([ids[k:]], [k], first=1)[0]
        np.testing.assert_allclose(after, full, atol=1e-5, rtol=0)
        reference = plain.chat(messages, max_new_tokens=24)
        first = cached.chat(messages, max_new_tokens=24)
        again = cached.chat(messages, max_new_tokens=24)
    assert again.cached_tokens >= len(ids) - 16 and first.cached_tokens == 0
    assert first.token_ids == again.token_ids == reference.token_ids
