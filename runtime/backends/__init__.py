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


def open_gpu_backend(root: Path, manifest: mf.Manifest, backend: str):
    """The CUDA backend ``backend`` for an artifact, or a one-line refusal that names what is
    missing (CUDA, TensorRT, ORT's CUDA provider, an engine) and what to run."""
    gpu = environment.cuda_gpu()
    if isinstance(gpu, str):
        raise environment.DeviceUnavailableError(
            f"device='cuda' needs CUDA: {gpu}; on a machine without a GPU use device='cpu' (--device cpu)"
        )
    if backend == "tensorrt":
        from kvforge.runtime.backends.tensorrt import TensorRTBackend

        if mf.engine_record(manifest) is None:
            raise mf.ArtifactError(f"this artifact has no TensorRT engine: {environment.BUILD_HINT}")
        return TensorRTBackend(root, manifest)
    from kvforge.runtime.backends.ort_cuda import OrtCudaBackend

    if manifest.lowering != "gqa":
        print("[kvforge] ORT CUDA runs the onnx lowering through ORT's standard Attention (slower than gqa)")
    return OrtCudaBackend(root, manifest)
