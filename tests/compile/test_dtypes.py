"""--dtype float16 and bfloat16: what compiles, what runs on ORT's CPU provider, and what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvforge.compile import compile_model
from kvforge.runtime import ArtifactError, Engine


def test_float16_compiles_and_runs_on_cpu(llama_dir, tmp_path):
    out = tmp_path / "fp16"
    manifest = compile_model(llama_dir, out, dtype="float16", max_batch=1, max_seq=32, progress=None)
    assert manifest.dtype == "float16" and manifest.kv_cache["dtype"] == "float16"
    # fp16 against transformers' fp16: rounding-level differences only.
    assert manifest.parity["prefill_max_abs_diff"] < 5e-3 and manifest.parity["decode_max_abs_diff"] < 5e-3
    with Engine.load(out) as engine:
        assert engine.cache.buffer.dtype == np.float16
        [result] = engine.generate([[0, 5, 9]], max_new_tokens=5)
    assert len(result.token_ids) == 5
    graph_inputs = json.loads((out / "manifest.json").read_text())["graphs"]["decode"]["inputs"]
    assert {i["dtype"] for i in graph_inputs if i["name"].startswith("past")} == {"float16"}


def test_bfloat16_compiles_but_cpu_refuses_it(llama_dir, tmp_path):
    out = tmp_path / "bf16"
    manifest = compile_model(llama_dir, out, dtype="bfloat16", max_batch=1, max_seq=32, progress=None)
    assert manifest.dtype == "bfloat16"
    assert "cannot run" in manifest.parity["skipped"]
    with pytest.raises(ArtifactError, match="bfloat16.*recompile with --dtype float32"):
        Engine.load(out)
