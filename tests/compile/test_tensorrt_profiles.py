"""TensorRT optimization profiles from the limits (compile/tensorrt.py), as data: prefill takes
batch 1..max_batch x tokens 1..max_prompt, decode batch 1..max_batch x 1 token, cache inputs at full
capacity [B, H_kv, S_max, D] with B following the batch; the opt values; refusals of artifacts
TensorRT cannot build (gqa lowering, quantized)."""

from __future__ import annotations

import dataclasses

import pytest

from kvforge.compile import tensorrt as trt_stage
from kvforge.graphs import contract
from kvforge.graphs import manifest as mf


def _profiles(max_prompt=96):
    return trt_stage.profiles(
        num_layers=2, num_kv_heads=4, head_dim=16, max_batch=8, max_seq=128, max_prompt=max_prompt
    )


def test_prefill_profile_shapes():
    prefill, _ = _profiles()
    assert (prefill.name, prefill.index) == ("prefill", 0)
    assert prefill.shapes["input_ids"] == ((1, 1), (1, 96), (8, 96))
    assert prefill.shapes["position_ids"] == ((1, 1), (1, 96), (8, 96))
    assert prefill.shapes["write_indices"] == ((1,), (1,), (8,))
    assert prefill.shapes["input_lengths"] == ((1,), (1,), (8,))
    assert prefill.shapes["past_key_values.1.value"] == ((1, 4, 128, 16), (1, 4, 128, 16), (8, 4, 128, 16))


def test_decode_profile_shapes():
    _, decode = _profiles()
    assert (decode.name, decode.index) == ("decode", 1)
    assert decode.shapes["input_ids"] == ((1, 1), (8, 1), (8, 1))
    assert decode.shapes["input_lengths"] == ((1,), (8,), (8,))  # the plan is the prefill graph: lengths = 1
    assert decode.shapes["past_key_values.0.key"] == ((1, 4, 128, 16), (8, 4, 128, 16), (8, 4, 128, 16))


def test_every_prefill_input_has_a_shape_in_both_profiles():
    for p in _profiles():
        assert sorted(p.shapes) == sorted(contract.prefill_input_names(2))


def test_profiles_refuse_bad_limits():
    with pytest.raises(ValueError, match="max_prompt must lie in 1..max_seq=128, got 129"):
        _profiles(max_prompt=129)


def test_profile_record_round_trips_through_json_lists():
    record = _profiles()[1].to_record()
    assert record == mf.EngineProfile("decode", 1, record.shapes)
    assert record.shapes["input_ids"] == [[1, 1], [8, 1], [8, 1]]


def test_profiles_for_a_manifest_follow_its_limits(llama_onnx_artifact):
    manifest = mf.read(llama_onnx_artifact, verify=False)
    prefill, decode = trt_stage.profiles_for(manifest)
    m = manifest.model
    assert prefill.shapes["input_ids"][2] == (4, manifest.limits.max_prompt)
    assert decode.shapes["past_key_values.0.key"][2] == (4, m.num_kv_heads, 96, m.head_dim)


def test_only_the_onnx_lowering_is_buildable(llama_onnx_artifact):
    manifest = mf.read(llama_onnx_artifact, verify=False)
    trt_stage.check_buildable(manifest)
    with pytest.raises(
        ValueError, match="gqa lowering, which TensorRT cannot parse; recompile with .*--target tensorrt"
    ):
        trt_stage.check_buildable(dataclasses.replace(manifest, lowering="gqa"))
    with pytest.raises(ValueError, match="quantized .* ORT-only"):
        trt_stage.check_buildable(dataclasses.replace(manifest, quantization={"scheme": "int4"}))


def test_parse_version():
    assert trt_stage.parse_version("10.15.1.29") == (10, 15, 1, 29)
    assert trt_stage.parse_version("11.0.0rc1") == (11, 0, 0)
