"""Backends behind one small interface (see :mod:`kvforge.runtime.backends.base`).

``ort`` on the CPU is :class:`kvforge.runtime.ort_backend.OrtBackend` (numpy buffers);
``ort`` on CUDA is :mod:`.ort_cuda`, ``tensorrt`` is :mod:`.tensorrt`. The GPU backends import
their libraries lazily, so this package imports on any machine.
"""

from __future__ import annotations

from pathlib import Path

from kvforge.graphs import environment
from kvforge.graphs import manifest as mf

DEVICES = ("cpu", "cuda")
BACKENDS = ("ort", "tensorrt")


def check_choice(device: str, backend: str) -> None:
    """``device`` x ``backend`` must be one kvforge has: cpu/ort, cuda/ort, cuda/tensorrt."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if device == "cpu" and backend == "tensorrt":
        raise ValueError("TensorRT runs on CUDA only: use device='cuda' (--device cuda) with backend='tensorrt'")


def device_bytes(manifest: mf.Manifest, backend: str) -> dict[str, int]:
    """What loading needs on the device, by part: the weights (the TensorRT plan, or the weights
    file), the KV cache (twice when the engine does not alias it) and TensorRT's activation figure
    (0 for ORT, which allocates as it runs)."""
    record = mf.engine_record(manifest) if backend == "tensorrt" else None
    copies = 2 if record is not None and record.cache_aliased is False else 1
    return {
        "weights": record.plan_bytes if record else manifest.weights.bytes,
        "kv_cache": int(manifest.kv_cache["bytes"]) * copies,
        "activations": record.device_memory_bytes if record else 0,
    }


def check_fits(manifest: mf.Manifest, backend: str, free_bytes: int, gpu_name: str) -> None:
    """Refuse an artifact whose weights, cache and activations exceed the GPU's free memory,
    naming the limit to lower (``kvforge plan OUT`` shows the full plan)."""
    parts = device_bytes(manifest, backend)
    need = sum(parts.values())
    if need <= free_bytes:
        return
    gib = 2**30
    detail = ", ".join(f"{k.replace('_', ' ')} {v / gib:.2f} GiB" for k, v in parts.items())
    limits = manifest.limits
    hint = "a smaller --dtype or a larger GPU"
    if parts["kv_cache"] > need - free_bytes:  # shrinking the cache alone would do
        hint = f"a smaller --max-seq (now {limits.max_seq}) or --max-batch (now {limits.max_batch})"
    raise environment.DeviceUnavailableError(
        f"this artifact needs {need / gib:.2f} GiB on the GPU ({detail}) and {gpu_name} has {free_bytes / gib:.2f} GiB "
        f"free: recompile with {hint} (kvforge plan OUT shows the figures)"
    )


def open_gpu_backend(root: Path, manifest: mf.Manifest, backend: str):
    """The CUDA backend ``backend`` for an artifact, or a one-line refusal that names what is
    missing (CUDA, TensorRT, ORT's CUDA provider, an engine) and what to run."""
    gpu = environment.cuda_gpu()
    if isinstance(gpu, str):
        raise environment.DeviceUnavailableError(
            f"device='cuda' needs CUDA: {gpu}; on a machine without a GPU use device='cpu' (--device cpu)"
        )
    if backend == "tensorrt" and mf.engine_record(manifest) is None:
        raise mf.ArtifactError(f"this artifact has no TensorRT engine: {environment.BUILD_HINT}")
    check_fits(manifest, backend, gpu.free_bytes, gpu.name)
    if backend == "tensorrt":
        from kvforge.runtime.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(root, manifest)
    from kvforge.runtime.backends.ort_cuda import OrtCudaBackend

    if manifest.lowering != "gqa":
        print(f"[kvforge] ORT CUDA runs the {manifest.lowering} lowering's standard-op attention (slower than gqa)")
    return OrtCudaBackend(root, manifest)
