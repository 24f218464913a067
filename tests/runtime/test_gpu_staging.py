"""The GPU backends' host-side bookkeeping (runtime/backends/base.py), run on CPU with host memory
standing in for device memory (the copies become memmoves; no CUDA call is faked beyond that):
the engine's step arrays land at the binding plan's byte offsets of the io buffer, the logits come
back from theirs, the bytes each way are counted per step, alternating caches swap parity after each
run, the device cache looks to the engine like the CPU one, and the GPU modules import without torch."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf
from kvforge.runtime import device
from kvforge.runtime.backends import binding_plan as bp
from kvforge.runtime.backends.base import DeviceCache, DeviceView, GpuBackend, GpuBinding


class HostBuffer:
    """Host memory in place of device memory, 256-byte aligned like cudaMalloc's."""

    def __init__(self, nbytes: int, zero: bool = True) -> None:
        self._raw = np.zeros(nbytes + 256, dtype=np.uint8)
        start = -self._raw.ctypes.data % 256
        self.bytes = self._raw[start : start + nbytes]
        self.nbytes, self.ptr = nbytes, self.bytes.ctypes.data

    def view(self, offset, shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.bytes[offset : offset + n].view(dtype).reshape(shape)

    def close(self) -> None:
        self.ptr = 0


class HostStream:
    def __init__(self) -> None:
        self.ptr, self.copies = 0, []

    def copy_to_device(self, dst, src, nbytes):
        self.copies.append(("h2d", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def copy_to_host(self, dst, src, nbytes):
        self.copies.append(("d2h", nbytes))
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self):
        pass

    def close(self):
        pass


@pytest.fixture
def host_device(monkeypatch):
    monkeypatch.setattr(device, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(device, "PinnedBuffer", HostBuffer)
    monkeypatch.setattr(device, "Stream", HostStream)


def _backend(llama_artifact, mode):
    manifest = mf.read(llama_artifact, verify=False)
    return GpuBackend(manifest, mode), manifest


def _binding(backend, manifest, batch, seq):
    n = manifest.model.num_layers
    rng = np.random.default_rng(batch * 10 + seq)
    host = {
        contract.INPUT_IDS: rng.integers(0, 100, (batch, seq)),
        contract.POSITION_IDS: rng.integers(0, 100, (batch, seq)),
        contract.WRITE_INDICES: rng.integers(0, 100, (batch,)),
        contract.INPUT_LENGTHS: rng.integers(1, 100, (batch,)),
    }
    cache = backend.allocate_cache(manifest).views(batch)
    logits = np.zeros((batch, manifest.model.vocab_size), dtype=np.float32)
    h, lg, b, s, first = backend.step_arrays({**host, **cache}, {contract.LOGITS: logits})
    assert (b, s, first) == (batch, seq, 0) and lg is logits and sorted(h) == sorted(host)
    plans = backend.plans(contract.prefill_input_names(n), contract.output_names(n), batch, seq)
    return GpuBinding("prefill", plans, h, lg, batch, seq)


def test_device_cache_looks_like_the_cpu_cache(llama_artifact, host_device):
    backend, manifest = _backend(llama_artifact, bp.ALIAS)
    cache = backend.allocate_cache(manifest)
    assert isinstance(cache, DeviceCache) and cache.buffer.dtype == np.float32
    assert cache.shape == tuple(manifest.kv_cache["shape"]) and cache.nbytes == manifest.kv_cache["bytes"]
    view = cache.views(2)["past_key_values.0.value"]
    assert isinstance(view, DeviceView) and view.shape == (2, *manifest.kv_cache["shape"][3:])
    backend2, _ = _backend(llama_artifact, bp.ALTERNATE)
    assert backend2.allocate_cache(manifest).nbytes == 2 * manifest.kv_cache["bytes"]
    assert set(backend2.buffers) == {"cache", "cache_b", "io"}


def test_inputs_land_at_their_offsets_and_logits_come_back(llama_artifact, host_device):
    backend, manifest = _backend(llama_artifact, bp.ALIAS)
    binding = _binding(backend, manifest, batch=3, seq=5)
    backend.upload(binding)
    io = backend.buffers["io"]
    for name, array in binding.host_inputs.items():
        s = backend.current(binding).inputs[name]
        np.testing.assert_array_equal(io.view(s.offset, s.shape, np.int64), array)
    s = backend.current(binding).outputs[contract.LOGITS]
    io.view(s.offset, s.shape, np.float32)[...] = np.arange(3 * manifest.model.vocab_size).reshape(s.shape)
    backend.download(binding)
    np.testing.assert_array_equal(binding.logits, io.view(s.offset, s.shape, np.float32))
    h2d = sum(a.nbytes for a in binding.host_inputs.values())
    assert backend.stats.per_step() == {
        "h2d_bytes_per_step": h2d,
        "d2h_bytes_per_step": 3 * manifest.model.vocab_size * 4,
    }
    assert backend.stats.steps == 1


def test_greedy_readback_is_four_bytes_a_row(llama_artifact, host_device):
    backend, manifest = _backend(llama_artifact, bp.ALIAS)
    n = manifest.model.num_layers
    binding = _binding(backend, manifest, batch=2, seq=1)
    binding.plans = backend.plans(contract.prefill_input_names(n), [*contract.output_names(n), bp.NEXT_TOKEN_IDS], 2, 1)
    s = binding.plans[0].outputs[bp.NEXT_TOKEN_IDS]
    backend.buffers["io"].view(s.offset, (2,), np.int32)[...] = [7, 11]
    binding.read_logits = False
    backend.download(binding)
    assert backend.next_token_ids(binding).tolist() == [7, 11]
    assert backend.stats.d2h_bytes == 8


def test_alternating_caches_swap_after_each_run(llama_artifact, host_device):
    backend, manifest = _backend(llama_artifact, bp.ALTERNATE)
    binding = _binding(backend, manifest, batch=1, seq=1)
    reads = []
    for _ in range(4):
        plan = backend.current(binding)
        reads.append((plan.inputs["past_key_values.0.key"].buffer, plan.outputs["present.0.key"].buffer))
        backend.advance(binding)
    assert reads == [("cache", "cache_b"), ("cache_b", "cache")] * 2
    alias, _ = _backend(llama_artifact, bp.ALIAS)
    alias.advance(binding)
    assert alias.parity == 0


def test_prompt_longer_than_max_prompt_is_refused(llama_artifact, host_device):
    backend, _ = _backend(llama_artifact, bp.ALIAS)
    with pytest.raises(ValueError, match=r"prefill of 97 tokens exceeds this artifact's max_prompt=96"):
        backend.check_prompt(97)


def test_bfloat16_is_refused_on_the_gpu(llama_artifact, host_device):
    import dataclasses

    manifest = dataclasses.replace(mf.read(llama_artifact, verify=False), dtype="bfloat16")
    with pytest.raises(mf.ArtifactError, match="no bfloat16; recompile with --dtype float16"):
        GpuBackend(manifest, bp.ALIAS)


def test_gpu_modules_import_without_torch_or_cuda():
    code = (
        "import sys\n"
        "import kvforge.runtime.backends.tensorrt, kvforge.runtime.backends.ort_cuda, kvforge.runtime.device\n"
        "print('torch' in sys.modules, 'tensorrt' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_row_range_views_and_row_copies(llama_artifact, host_device):
    backend, manifest = _backend(llama_artifact, bp.ALIAS)
    cache = backend.allocate_cache(manifest)
    views = cache.views(2, first=1)
    assert {v.first for v in views.values()} == {1}
    layout = backend.layout
    # Fill the host-memory "device" cache with a known pattern, copy row 2 -> row 0 for 5 positions.
    raw = backend.buffers["cache"].bytes.view(np.float32)
    raw[...] = np.arange(raw.size)
    backend.stream.copy_2d_on_device = lambda dst, src, pitch, width, height: [
        ctypes.memmove(dst + h * pitch, src + h * pitch, width) for h in range(height)
    ]
    shape = (layout.max_batch, layout.num_kv_heads, layout.max_seq, layout.head_dim)
    before = [backend.buffers["cache"].view(layout.offset(0, k), shape, np.float32).copy() for k in (0, 1)]
    cache.copy_row(2, 0, 5)
    for k in (0, 1):
        after = backend.buffers["cache"].view(layout.offset(0, k), shape, np.float32)
        np.testing.assert_array_equal(after[0, :, :5], before[k][2, :, :5])  # copied positions
        np.testing.assert_array_equal(after[0, :, 5:], before[k][0, :, 5:])  # the rest kept
        np.testing.assert_array_equal(after[1:], before[k][1:])  # other rows untouched
    with pytest.raises(ValueError, match=r"cache row 9 is outside \[0, 4\)"):
        cache.copy_row(9, 0, 1)
