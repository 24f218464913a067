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


def test_float16_with_float32_norm_weights_compiles_and_matches(tmp_path):
    # GPT-OSS keeps its RMSNorm weights in float32 in a float16 model (_keep_in_fp32_modules);
    # onnxscript fuses them into norms ONNX Runtime would refuse (float16 input, float32 scale)
    # unless compile casts the scale (kvforge.compile.optimize.cast_norm_scales).
    import onnx

    from tests import families

    [case] = [c for c in families.CASES if c[0] == "gpt-oss-sinks-window"]
    model = families.build(tmp_path / "m", *case[1:])
    out = tmp_path / "fp16"
    manifest = compile_model(model, out, dtype="float16", max_batch=1, max_seq=32, score_graph=False, progress=None)
    assert manifest.parity["greedy_match"]
    assert manifest.parity["prefill_max_abs_diff"] < 5e-3 and manifest.parity["decode_max_abs_diff"] < 5e-3
    graph = onnx.load(str(out / "prefill.ort.onnx"), load_external_data=False).graph
    # the fused norms stayed (their scales' casts folded into float16 initializers by ORT)
    assert sum(n.op_type.endswith("SimplifiedLayerNormalization") for n in graph.node) >= 2
