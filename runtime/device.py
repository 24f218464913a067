"""The device layer: device memory, pinned host memory, a stream, copies and CUDA graphs, through
``cuda-python`` (``cuda.bindings.runtime``), not torch: the runtime stays torch-free on the GPU.

Every object owns what it allocated and frees it in ``close()`` (context managers, never
``__del__``). Addresses from ``cudaMalloc`` are aligned to at least 256 bytes, which is TensorRT's
rule for bound tensors; :class:`DeviceBuffer` checks it rather than trusting it.

**Not yet run on a GPU**: written against cuda-python's documented runtime API (each call returns
``(cudaError_t, *results)``), exercised by ``tests/gpu`` where a GPU is lent.
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvforge.graphs.environment import DeviceUnavailableError, Gpu, require_cuda

ALIGNMENT = 256


def _cudart():
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        raise DeviceUnavailableError('cuda-python is not installed (pip install "kvforge[gpu]")') from e
    return cudart


def check(result):
    """Unwrap a cuda-python call's ``(err, *values)``; raise with the error's name when it failed."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        cudart = _cudart()
        _, name = cudart.cudaGetErrorName(err)
        raise RuntimeError(f"CUDA call failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def open_device(index: int = 0) -> Gpu:
    """Select CUDA device ``index``; raises DeviceUnavailableError (one line: what, what to do)."""
    return require_cuda(index)


class DeviceBuffer:
    """``nbytes`` of device memory, owned; ``ptr`` is 256-byte aligned."""

    def __init__(self, nbytes: int, zero: bool = True) -> None:
        cudart = _cudart()
        self.nbytes = int(nbytes)
        self.ptr = int(check(cudart.cudaMalloc(max(self.nbytes, 1))))
        if self.ptr % ALIGNMENT:
            check(cudart.cudaFree(self.ptr))
            raise RuntimeError(f"cudaMalloc returned {self.ptr:#x}, not {ALIGNMENT}-byte aligned")
        if zero:  # rows past a sequence's length are masked, but NaN * 0 is still NaN
            check(cudart.cudaMemset(self.ptr, 0, self.nbytes))

    def close(self) -> None:
        if self.ptr:
            check(_cudart().cudaFree(self.ptr))
            self.ptr = 0


class PinnedBuffer:
    """``nbytes`` of page-locked host memory (``cudaMallocHost``), viewable as numpy arrays;
    copies from it to the device are truly asynchronous."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = int(check(_cudart().cudaMallocHost(max(self.nbytes, 1))))
        self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.ptr))

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        return self.bytes[offset : offset + n].view(dtype).reshape(shape)

    def close(self) -> None:
        if self.ptr:
            self.bytes = None
            check(_cudart().cudaFreeHost(self.ptr))
            self.ptr = 0


class Stream:
    """One CUDA stream; every copy and launch of a backend goes through it, in order."""

    def __init__(self) -> None:
        cudart = _cudart()
        self.handle = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking))

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def copy_to_device(self, dst: int, src: int, nbytes: int) -> None:
        cudart = _cudart()
        check(cudart.cudaMemcpyAsync(dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.handle))

    def copy_to_host(self, dst: int, src: int, nbytes: int) -> None:
        cudart = _cudart()
        check(cudart.cudaMemcpyAsync(dst, src, nbytes, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.handle))

    def copy_2d_on_device(self, dst: int, src: int, pitch: int, width: int, height: int) -> None:
        """``height`` rows of ``width`` bytes, ``pitch`` bytes apart in both, device to device."""
        cudart = _cudart()
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        check(cudart.cudaMemcpy2DAsync(dst, pitch, src, pitch, width, height, kind, self.handle))

    def synchronize(self) -> None:
        check(_cudart().cudaStreamSynchronize(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            check(_cudart().cudaStreamDestroy(self.handle))
            self.handle = None


class CudaGraph:
    """A captured sequence of launches on a stream, replayed with one ``cudaGraphLaunch``.

    Usage: ``graph = CudaGraph.capture(stream, lambda: context.execute_async_v3(stream.ptr))``.
    The addresses the launches use are baked in: the caller keeps them fixed (the binding plan
    does) and writes new values into the same buffers before each :meth:`launch`.
    """

    def __init__(self, graph, exec_graph) -> None:
        self.graph, self.exec_graph = graph, exec_graph

    @classmethod
    def capture(cls, stream: Stream, launches) -> CudaGraph:
        cudart = _cudart()
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        check(cudart.cudaStreamBeginCapture(stream.handle, mode))
        try:
            launches()
        finally:
            graph = check(cudart.cudaStreamEndCapture(stream.handle))
        exec_graph = check(cudart.cudaGraphInstantiate(graph, 0))
        return cls(graph, exec_graph)

    def launch(self, stream: Stream) -> None:
        check(_cudart().cudaGraphLaunch(self.exec_graph, stream.handle))

    def close(self) -> None:
        cudart = _cudart()
        if self.exec_graph is not None:
            check(cudart.cudaGraphExecDestroy(self.exec_graph))
            check(cudart.cudaGraphDestroy(self.graph))
            self.exec_graph = self.graph = None


def memory_info() -> tuple[int, int]:
    """``(free, total)`` bytes of the current device."""
    free, total = check(_cudart().cudaMemGetInfo())
    return int(free), int(total)


def measure_copy_bandwidth(nbytes: int = 256 * 2**20, repeat: int = 5) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted once each), the roofline's
    denominator: a decode step cannot read the weights faster than this."""
    import time

    cudart = _cudart()
    src, dst, stream = DeviceBuffer(nbytes), DeviceBuffer(nbytes), Stream()
    try:
        kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        check(cudart.cudaMemcpyAsync(dst.ptr, src.ptr, nbytes, kind, stream.handle))
        stream.synchronize()
        started = time.perf_counter()
        for _ in range(repeat):
            check(cudart.cudaMemcpyAsync(dst.ptr, src.ptr, nbytes, kind, stream.handle))
        stream.synchronize()
        return 2 * nbytes * repeat / (time.perf_counter() - started)
    finally:
        for obj in (stream, dst, src):
            obj.close()
