"""The memory plan (compile/plan.py), without a GPU: weights from safetensors headers or the
artifact, KV cache L*2*B*H_kv*S*D*bytes (x2 when the engine does not alias), the activation
estimate's formula, the total against a --gpu-memory budget, and the limit to lower when it does
not fit; sizes such as 70GiB."""

from __future__ import annotations

import pytest

from kvforge.compile import plan as mp
from kvforge.graphs.architectures import Dims

GIB = 2**30


def test_parse_bytes():
    assert mp.parse_bytes("70GiB") == 70 * GIB
    assert mp.parse_bytes("80GB") == 80 * 10**9
    assert mp.parse_bytes("512 MiB") == 512 * 2**20
    assert mp.parse_bytes("1.5GiB") == int(1.5 * GIB)
    assert mp.parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="cannot read '70 gigs' as a memory size; write it like 70GiB"):
        mp.parse_bytes("70 gigs")


def test_kv_cache_formula():
    # Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128, fp16; batch 4 x 8192 tokens = 4 GiB.
    assert mp.kv_cache_bytes(32, 4, 8, 8192, 128, 2) == 32 * 2 * 4 * 8 * 8192 * 128 * 2 == 4 * GIB


def test_activation_formula():
    got = mp.activation_bytes(
        max_batch=2,
        max_prompt=10,
        max_seq=16,
        hidden_size=8,
        intermediate_size=20,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        vocab_size=50,
        itemsize=2,
    )
    # T = 20 tokens x (4*8 + 2*20 + (4 + 4)*2 = 88) + scores 2*4*10*16 = 1280 + logits 2*50 = 100
    assert got == 2 * (20 * 88 + 1280 + 100)


def test_weights_from_the_safetensors_headers(llama_dir):
    from safetensors import safe_open

    with safe_open(llama_dir / "model.safetensors", "np") as f:
        numel = sum(f.get_tensor(k).size for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)
    shape = mp.model_shape_from_dir(llama_dir, "float16")
    assert shape.weights_bytes == 2 * numel
    assert mp.model_shape_from_dir(llama_dir, "float32").weights_bytes == 4 * numel


def _shape(weights=14 * GIB):  # an 8B-like model in fp16
    return mp.ModelShape(Dims(32, 32, 8, 128, 4096, 128256), 14336, weights, "test")


def test_plan_that_fits():
    plan = mp.make_plan(
        _shape(),
        source="m",
        dtype="float16",
        max_batch=4,
        max_seq=8192,
        max_prompt=2048,
        budget_bytes=70 * GIB,
        budget_source="--gpu-memory",
    )
    assert plan.kv_cache_bytes == 4 * GIB
    assert plan.activation_bytes == mp.activation_bytes(
        max_batch=4,
        max_prompt=2048,
        max_seq=8192,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        itemsize=2,
    )
    assert plan.total_bytes == 14 * GIB + 4 * GIB + plan.activation_bytes + mp.RESERVE_BYTES
    assert plan.fits and plan.advice is None
    text = mp.format_plan(plan)
    assert "KV cache" in text and "4.00 GiB" in text and "budget 70.00 GiB (--gpu-memory): fits" in text


def test_alternating_caches_double_the_kv_bytes():
    one = mp.make_plan(_shape(), source="m", dtype="float16", max_batch=4, max_seq=8192, aliased=True)
    two = mp.make_plan(_shape(), source="m", dtype="float16", max_batch=4, max_seq=8192, aliased=False)
    assert two.kv_cache_bytes == 2 * one.kv_cache_bytes
    assert "two caches, alternated each step" in mp.format_plan(two)
    assert one.fits is None and "give --gpu-memory 70GiB to check a fit" in mp.format_plan(one)


def test_plan_that_does_not_fit_names_the_limits_to_lower():
    plan = mp.make_plan(
        _shape(),
        source="m",
        dtype="float16",
        max_batch=16,
        max_seq=32768,
        max_prompt=512,
        budget_bytes=40 * GIB,
        budget_source="--gpu-memory",
        engine_activation_bytes=GIB,
    )
    # 14 + 64 (KV) + 1 + 0.5 GiB > 40 GiB. KV per (row, token) = 32*2*8*128*2 = 128 KiB.
    assert plan.fits is False
    left = 40 * GIB - 14 * GIB - GIB - mp.RESERVE_BYTES
    best_seq = left // (16 * 128 * 1024)
    best_batch = left // (32768 * 128 * 1024)
    assert plan.advice == f"does not fit: lower --max-seq {best_seq} or --max-batch {best_batch}"
    assert "DOES NOT FIT" in mp.format_plan(plan) and plan.advice in mp.format_plan(plan)


def test_weights_alone_too_large_never_suggests_the_dtype_in_use():
    plan = mp.make_plan(
        _shape(weights=90 * GIB), source="m", dtype="float16", max_batch=1, max_seq=64, budget_bytes=80 * GIB
    )
    assert plan.advice == (
        "the weights and the CUDA reserve alone need 90.50 GiB of 80.00 GiB: "
        "use a smaller or quantized model, or a GPU with more memory"
    )
    for dtype in ("bfloat16", "float16"):  # already the smallest dtype: no --dtype advice
        plan = mp.make_plan(_shape(), source="m", dtype=dtype, max_batch=1, max_seq=64, budget_bytes=GIB)
        assert "--dtype" not in plan.advice, plan.advice
    plan = mp.make_plan(_shape(), source="m", dtype="float32", max_batch=1, max_seq=64, budget_bytes=GIB)
    assert plan.advice.endswith(": use --dtype float16, a smaller or quantized model, or a GPU with more memory")


def test_plan_for_an_artifact_uses_its_dtype_limits_and_weights(llama_onnx_artifact):
    from kvforge.graphs import manifest as mf

    manifest = mf.read(llama_onnx_artifact, verify=False)
    plan = mp.plan_for(llama_onnx_artifact, gpu_memory="1GiB")
    assert (plan.dtype, plan.max_batch, plan.max_seq) == ("float32", 4, 96)
    assert plan.weights_bytes == manifest.weights.bytes
    assert plan.kv_cache_bytes == manifest.kv_cache["bytes"]
    assert plan.fits is True and plan.budget_source == "--gpu-memory"
    with pytest.raises(ValueError, match="the artifact is float32; --dtype applies to model directories only"):
        mp.plan_for(llama_onnx_artifact, dtype="float16")


def test_plan_for_a_model_dir_defaults(llama_dir):
    plan = mp.plan_for(llama_dir)
    assert (plan.dtype, plan.max_batch, plan.max_seq, plan.max_prompt) == ("float16", 4, 512, 512)
    assert plan.budget_bytes is None and plan.fits is None
    with pytest.raises(ValueError, match="does not exist"):
        mp.plan_for(llama_dir / "nope")


def test_plan_for_a_hybrid_model_dir_counts_its_state(lfm2_dir, lfm2_artifact):
    """The tiny LFM2's directory (three conv layers, one attention layer): KV for the attention
    layer only and each row's conv states, as the plan of its compiled artifact says."""
    plan = mp.plan_for(lfm2_dir, dtype="float32", max_batch=2, max_seq=48)
    assert plan.kv_cache_bytes == 1 * 2 * 2 * 2 * 48 * 16 * 4  # [1 attention layer, 2, B, H_kv, S, D] fp32
    assert plan.state_bytes == 2 * 3 * 64 * 2 * 4  # B rows x three conv layers' [C, K-1] fp32
    artifact = mp.plan_for(lfm2_artifact)
    assert (plan.kv_cache_bytes, plan.state_bytes) == (artifact.kv_cache_bytes, artifact.state_bytes)
    half = mp.plan_for(lfm2_dir, max_batch=2, max_seq=48)  # float16 by default: half of each
    assert (half.kv_cache_bytes, half.state_bytes) == (plan.kv_cache_bytes // 2, plan.state_bytes // 2)
    assert "model state" in mp.format_plan(plan)
