"""What this machine offers the GPU paths, and the one-line refusals when it offers too little.

Shared by ``compile`` (``kvforge build``), ``runtime`` (``Engine.load(device="cuda")``) and
``tools`` (``kvforge plan``'s free memory), which must not import each other. Every probe imports
its library lazily and turns "not installed" or "no device" into a reason string; nothing here
needs a GPU to import or to test.

The CUDA probe uses ``cuda-python`` (``cuda.bindings.runtime``); it has **not yet run on a GPU**.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SETUP = 'pip install "kvforge[gpu]"'
BUILD_HINT = "run `kvforge build OUT` on the target GPU"


def cache_root() -> Path:
    """kvforge's own files on this machine (the real SmolLM2 of ``make smollm2``, the int8 prefill's
    stored calibrations): ``$KVFORGE_CACHE``, default ``~/.cache/kvforge``."""
    return Path(os.environ.get("KVFORGE_CACHE") or "~/.cache/kvforge").expanduser()


class DeviceUnavailableError(ValueError):
    """A GPU path was asked for on a machine that lacks CUDA, TensorRT or ORT's CUDA provider."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    compute_capability: str  # "9.0"
    total_bytes: int
    free_bytes: int


def cuda_gpu(index: int = 0) -> Gpu | str:
    """The CUDA device ``index``, or the reason there is none (no cuda-python, no driver, no GPU)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return f"cuda-python is not installed ({SETUP})"
    try:
        err, count = cudart.cudaGetDeviceCount()
        if int(err) != 0 or count == 0:
            return f"no CUDA device is visible (cudaGetDeviceCount: {err}, {count if int(err) == 0 else 0} devices)"
        if index >= count:
            return f"CUDA device {index} does not exist ({count} visible)"
        (err,) = cudart.cudaSetDevice(index)
        err, prop = cudart.cudaGetDeviceProperties(index)
        if int(err) != 0:
            return f"cudaGetDeviceProperties failed: {err}"
        err, free, total = cudart.cudaMemGetInfo()
        name = prop.name.decode(errors="replace").rstrip("\0") if isinstance(prop.name, bytes) else str(prop.name)
        return Gpu(index, name, f"{prop.major}.{prop.minor}", int(total), int(free))
    except Exception as e:  # a boundary: a broken driver install is a reason, not a crash
        return f"CUDA is unusable here ({type(e).__name__}: {e})"


def tensorrt_module(minimum: tuple[int, ...] = (10, 15)):
    """The ``tensorrt`` module, or the reason it cannot be used (absent, or older than ``minimum``)."""
    try:
        import tensorrt
    except ImportError:
        return f"TensorRT is not installed ({SETUP}, or pip install tensorrt)"
    version = tuple(int(p) for p in tensorrt.__version__.split(".")[:2] if p.isdigit())
    if version < minimum:
        want = ".".join(map(str, minimum))
        return f"TensorRT {tensorrt.__version__} is older than {want} (pip install 'tensorrt>={want}')"
    return tensorrt


def ort_cuda_provider() -> str | None:
    """None when ONNX Runtime's CUDA provider is available, else the reason."""
    try:
        import onnxruntime
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return (
            "ONNX Runtime's CUDA provider is not available (the CPU package `onnxruntime` is installed; "
            "pip uninstall onnxruntime, then pip install onnxruntime-gpu)"
        )
    return None


def require_cuda(index: int = 0) -> Gpu:
    gpu = cuda_gpu(index)
    if isinstance(gpu, str):
        raise DeviceUnavailableError(f"CUDA is not available: {gpu}")
    return gpu


def require_tensorrt(minimum: tuple[int, ...] = (10, 15)):
    trt = tensorrt_module(minimum)
    if isinstance(trt, str):
        raise DeviceUnavailableError(trt)
    return trt


def build_refusal(gpu: Gpu | str, trt) -> str | None:
    """The one line ``kvforge build`` prints when this machine cannot build engines, else None.

    ``gpu``: :func:`cuda_gpu`'s answer; ``trt``: :func:`tensorrt_module`'s (module or reason)."""
    missing = [reason for reason in (gpu, trt) if isinstance(reason, str)]
    if not missing:
        return None
    return f"cannot build TensorRT engines here: {'; '.join(missing)}; {BUILD_HINT}"
