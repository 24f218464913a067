"""The device layer (runtime/device.py) and the GPU backends' one cache allocation, on a real GPU.

Proves: device buffers are 256-byte aligned and zeroed; host -> device -> host copies through
pinned memory return the bytes sent; a 2-D device copy moves exactly the rows asked for; a captured
CUDA graph replays its copy on new data; the copy-bandwidth probe reports a device's bandwidth;
the ORT CUDA backend makes one cache allocation whose per-layer slices are 256-byte aligned, and
its bindings put every ``present.*`` output on its ``past.*`` input's address.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_buffers_are_aligned_and_zeroed():
    from kvforge.runtime import device

    with_stream = device.Stream()
    bufs = [device.DeviceBuffer(n) for n in (1, 255, 4097, 3 * 2**20 + 7)]
    try:
        for b in bufs:
            assert b.ptr % device.ALIGNMENT == 0
        host = device.PinnedBuffer(bufs[-1].nbytes)
        host.bytes[:] = 0xAB
        with_stream.copy_to_host(host.ptr, bufs[-1].ptr, bufs[-1].nbytes)
        with_stream.synchronize()
        assert not host.bytes.any()
        host.close()
    finally:
        for b in bufs:
            b.close()
        with_stream.close()


def test_round_trip_and_2d_copy():
    from kvforge.runtime import device

    rows, pitch, width = 8, 1024, 384
    stream = device.Stream()
    dev = device.DeviceBuffer(2 * rows * pitch)
    host = device.PinnedBuffer(3 * rows * pitch)
    try:
        sent = np.random.default_rng(0).integers(0, 255, rows * pitch, dtype=np.uint8)
        host.bytes[: rows * pitch] = sent
        stream.copy_to_device(dev.ptr, host.ptr, rows * pitch)
        stream.copy_2d_on_device(dev.ptr + rows * pitch, dev.ptr, pitch, width, rows)
        stream.copy_to_host(host.ptr + rows * pitch, dev.ptr, 2 * rows * pitch)
        stream.synchronize()
        back = host.bytes[rows * pitch :]
        np.testing.assert_array_equal(back[: rows * pitch], sent)
        copied = back[rows * pitch :].reshape(rows, pitch)
        np.testing.assert_array_equal(copied[:, :width], sent.reshape(rows, pitch)[:, :width])
        assert not copied[:, width:].any()  # outside the width: untouched (zeroed at allocation)
    finally:
        host.close()
        dev.close()
        stream.close()


def test_cuda_graph_replays_a_copy_on_new_data():
    from kvforge.runtime import device

    n = 4096
    stream = device.Stream()
    src, dst, host = device.DeviceBuffer(n), device.DeviceBuffer(n), device.PinnedBuffer(2 * n)
    graph = None
    try:
        graph = device.CudaGraph.capture(stream, lambda: stream.copy_2d_on_device(dst.ptr, src.ptr, n, n, 1))
        for value in (7, 42):
            host.bytes[:n] = value
            stream.copy_to_device(src.ptr, host.ptr, n)
            graph.launch(stream)
            stream.copy_to_host(host.ptr + n, dst.ptr, n)
            stream.synchronize()
            assert (host.bytes[n:] == value).all()
    finally:
        if graph is not None:
            graph.close()
        for obj in (host, dst, src, stream):
            obj.close()


def test_memory_info_and_copy_bandwidth():
    from kvforge.runtime import device

    free, total = device.memory_info()
    assert 0 < free <= total
    assert device.measure_copy_bandwidth(64 * 2**20, repeat=3) > 1e10  # > 10 GB/s on any CUDA GPU


@pytest.mark.gpu("ort")
def test_ort_cuda_cache_is_one_aligned_allocation_bound_in_place(llama_dir, tmp_path):
    from kvforge.compile import compile_model
    from kvforge.graphs import contract
    from kvforge.runtime import Engine
    from kvforge.runtime.backends import binding_plan as bp

    out = tmp_path / "ort"
    compile_model(
        llama_dir,
        out,
        target="cuda",
        dtype="float32",
        max_batch=2,
        max_seq=64,
        max_prompt=16,
        score_graph=False,
        progress=None,
    )
    with Engine.load(out, device="cuda", backend="ort") as engine:
        backend = engine.backend
        cache = backend.buffers[bp.CACHE]
        assert set(backend.buffers) == {bp.CACHE, bp.IO}  # one cache allocation (in place: alias mode)
        assert cache.nbytes == backend.layout.nbytes
        slices = backend.layout.slices(2)
        assert len(slices) == 2 * backend.layout.num_layers
        for s in slices.values():
            assert (cache.ptr + s.offset) % device_alignment() == 0
        plan = backend.plans(backend.input_names("prefill"), backend.output_names("prefill"), 2, 1)[0]
        n = backend.layout.num_layers
        pairs = [(contract.present_key_name(i), contract.past_key_name(i)) for i in range(n)]
        pairs += [(contract.present_value_name(i), contract.past_value_name(i)) for i in range(n)]
        for present, past in pairs:
            assert backend.address(plan.outputs[present]) == backend.address(plan.inputs[past])


def device_alignment() -> int:
    from kvforge.runtime import device

    return device.ALIGNMENT
