"""Engine.load's device/backend choice without a GPU: unknown names and TensorRT on the CPU are
refused with what to use; device="cuda" without CUDA is one DeviceUnavailableError line naming
what is missing; the CPU path is unchanged (device="cpu", backend="ort" is the default)."""

from __future__ import annotations

import pytest

from kvforge.graphs import environment
from kvforge.runtime import Engine


def test_bad_choices_are_refused(llama_artifact):
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of cpu, cuda"):
        Engine.load(llama_artifact, device="tpu")
    with pytest.raises(ValueError, match="unknown backend 'vllm'; choose one of ort, tensorrt"):
        Engine.load(llama_artifact, backend="vllm")
    with pytest.raises(ValueError, match="TensorRT runs on CUDA only: use device='cuda'"):
        Engine.load(llama_artifact, backend="tensorrt")


@pytest.mark.skipif(not isinstance(environment.cuda_gpu(), str), reason="this machine has CUDA")
@pytest.mark.parametrize("backend", ["ort", "tensorrt"])
def test_cuda_without_cuda_is_one_line(llama_artifact, backend):
    with pytest.raises(environment.DeviceUnavailableError) as e:
        Engine.load(llama_artifact, device="cuda", backend=backend)
    message = str(e.value)
    assert message.startswith("device='cuda' needs CUDA: ") and "\n" not in message
    assert message.endswith("on a machine without a GPU use device='cpu' (--device cpu)")


def test_cpu_default_still_binds_a_host_cache(llama_artifact):
    with Engine.load(llama_artifact, device="cpu", backend="ort") as engine:
        assert type(engine.cache).__name__ == "KVCache" and engine.cache.buffer.shape[2] == 4
        [r] = engine.generate([[3, 17, 201]], max_new_tokens=3)
        assert len(r.token_ids) == 3


def test_build_refusal_messages():
    assert environment.build_refusal("cuda-python is not installed (x)", "TensorRT is not installed (y)") == (
        "cannot build TensorRT engines here: cuda-python is not installed (x); TensorRT is not installed (y); "
        "run `kvforge build OUT` on the target GPU"
    )
    assert environment.build_refusal(environment.Gpu(0, "G", "9.0", 1, 1), object()) is None


def test_load_refuses_an_artifact_that_does_not_fit(llama_artifact):
    import dataclasses

    from kvforge.graphs import manifest as mf
    from kvforge.runtime import backends

    manifest = mf.read(llama_artifact, verify=False)
    parts = backends.device_bytes(manifest, "ort")
    assert parts == {"weights": manifest.weights.bytes, "kv_cache": manifest.kv_cache["bytes"], "activations": 0}
    need = sum(parts.values())
    backends.check_fits(manifest, "ort", need, "GPU")  # exactly enough
    with pytest.raises(environment.DeviceUnavailableError) as e:
        backends.check_fits(manifest, "ort", need - 1, "Tiny GPU")
    assert "free: recompile with a smaller --max-seq (now 96) or --max-batch (now 4)" in str(e.value)
    assert "on the GPU (weights " in str(e.value) and "Tiny GPU has " in str(e.value)
    with pytest.raises(environment.DeviceUnavailableError, match="recompile with a smaller --dtype or a larger GPU"):
        backends.check_fits(manifest, "ort", manifest.weights.bytes // 2, "Tiny GPU")
    # TensorRT: the plan's bytes, its activation figure, and two caches when it does not alias.
    record = {"plan_file": "engine.plan", "plan_sha256": "0", "plan_bytes": 1000, "source_graph": "prefill",
              "tensorrt_version": "10.15", "gpu_name": "G", "compute_capability": "9.0", "profiles": [],
              "timing_cache_file": None, "strongly_typed": True, "workspace_bytes": None,
              "device_memory_bytes": 500, "cache_aliased": False}  # fmt: skip
    trt = dataclasses.replace(manifest, engines={"tensorrt": record})
    assert backends.device_bytes(trt, "tensorrt") == {
        "weights": 1000,
        "kv_cache": 2 * manifest.kv_cache["bytes"],
        "activations": 500,
    }
