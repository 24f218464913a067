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
