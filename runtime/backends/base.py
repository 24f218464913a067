"""The backend interface, and what the two GPU backends share.

Interface (what :class:`kvforge.runtime.engine.StepEngine` calls; ORT CPU's
:class:`kvforge.runtime.ort_backend.OrtBackend` has it too):

- ``allocate_cache(manifest)`` -> the KV cache the engine binds (``.views(batch)``,
  ``.buffer.dtype``, ``.nbytes``), allocated once and owned by the backend;
- ``input_names(graph)`` / ``output_names(graph)``: the graph's I/O, checked against the contract;
- ``bind(graph, inputs, outputs)`` -> a reusable binding: ``inputs`` and ``outputs`` are the
  engine's host arrays by name (the step tensors; ``logits`` is written back into the given array)
  and the cache's views;
- ``run(binding)``; ``close()``.

:class:`GpuBackend` holds the device side both GPU backends need: the binding plan
(:mod:`.binding_plan`), one (or, alternating, two) cache allocations and the ``io`` buffer on the
device, a pinned staging copy of the step inputs, one stream, and a count of the bytes copied
each way per step. Subclasses say how to bind and execute (TensorRT contexts, ORT IOBinding).
**Not yet run on a GPU.**
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs import manifest as mf
from kvforge.runtime.backends import binding_plan as bp
from kvforge.runtime.cache import needs_row_copy

STEP_INPUTS = (contract.INPUT_IDS, contract.POSITION_IDS, contract.WRITE_INDICES, contract.INPUT_LENGTHS)


@dataclass(frozen=True)
class DeviceView:
    """A cache view the engine passes back to ``bind``: rows ``[first, first + shape[0])`` of one
    layer's key or value cache, by name; a place in the binding plan, not memory."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    first: int = 0


@dataclass(frozen=True)
class DeviceArrayInfo:
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int


class DeviceCache:
    """The engine's view of a device cache: same surface as :class:`kvforge.runtime.cache.KVCache`
    (``views``, ``buffer.dtype``, ``nbytes``), the memory itself owned by the backend."""

    def __init__(self, layout: bp.CacheLayout, copies: int, backend: GpuBackend | None = None) -> None:
        self.layout = layout
        self.backend = backend  # does the device copies of copy_row
        self.copies = copies  # 1 (alias) or 2 (alternate)
        self.num_layers, self.max_batch, self.max_seq = layout.num_layers, layout.max_batch, layout.max_seq
        shape = contract.cache_shape(
            layout.num_layers, layout.max_batch, layout.num_kv_heads, layout.max_seq, layout.head_dim
        )
        self.buffer = DeviceArrayInfo(np.dtype(layout.dtype), shape, layout.nbytes)
        self.shape = shape

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes * self.copies

    def views(self, batch: int, first: int = 0) -> dict[str, DeviceView]:
        """Rows ``[first, first + batch)`` of every layer's cache, by past-input name (as
        :meth:`kvforge.runtime.cache.KVCache.views`)."""
        return {
            name: DeviceView(name, s.shape, np.dtype(s.dtype), first)
            for name, s in self.layout.slices(batch, first=first).items()
        }

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of cache row ``src`` into row ``dst``, every layer,
        key and value, on the device (as :meth:`kvforge.runtime.cache.KVCache.copy_row`)."""
        if needs_row_copy(src, dst, length, self.max_batch, self.max_seq):
            self.backend.copy_rows(src, dst, length)


@dataclass
class TransferStats:
    """Bytes copied host->device and device->host, and steps run (``bench`` reports them)."""

    steps: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"h2d_bytes_per_step": self.h2d_bytes / n, "d2h_bytes_per_step": self.d2h_bytes / n}


@dataclass
class GpuBinding:
    """One reusable binding: the engine's arrays and the binding plan of each cache parity."""

    graph: str
    plans: dict[int, bp.BindingPlan]  # by parity: {0: ...} in alias mode, {0: ..., 1: ...} alternating
    host_inputs: dict[str, np.ndarray]  # the engine's step arrays, staged and copied each run
    logits: np.ndarray  # the engine's host logits array, written back after each run
    batch: int
    seq: int
    first: int = 0  # the first cache row of the views
    tensors: dict[str, object] = field(default_factory=dict)  # what Engine reads: {"logits": host array}
    read_logits: bool = True  # False: greedy reads next_token_ids only (4 bytes a row)


class GpuBackend:
    """Device memory and transfers shared by the TensorRT and ORT CUDA backends."""

    name = "gpu"
    device_argmax = False  # TensorRT sets it when its plan has the next_token_ids output
    device = "cuda"

    def __init__(self, manifest: mf.Manifest, mode: str) -> None:
        from kvforge.runtime import device

        self.manifest = manifest
        self.mode = mode
        m, limits = manifest.model, manifest.limits
        if manifest.dtype not in ("float32", "float16"):
            raise mf.ArtifactError(
                f"the GPU runtime hands logits to numpy, which has no {manifest.dtype}; "
                "recompile with --dtype float16 (bfloat16 on the GPU is not supported yet)"
            )
        self.layout = bp.CacheLayout(
            m.num_layers, limits.max_batch, m.num_kv_heads, limits.max_seq, m.head_dim, manifest.dtype
        )
        self.io = bp.io_layout(limits.max_batch, limits.max_prompt, m.vocab_size, manifest.dtype)
        self.stream = device.Stream()
        self.buffers = {bp.CACHE: device.DeviceBuffer(self.layout.nbytes), bp.IO: device.DeviceBuffer(self.io.nbytes)}
        if mode == bp.ALTERNATE:
            self.buffers[bp.CACHE_B] = device.DeviceBuffer(self.layout.nbytes)
        self.staging = device.PinnedBuffer(self.io.nbytes)  # host mirror of the io buffer
        self.parity = 0  # alternate mode: which cache holds the latest rows (0: "cache")
        self.stats = TransferStats()
        self.message = bp.load_message(mode, self.layout, self.name)

    # ------------------------------------------------------------ interface pieces

    def allocate_cache(self, manifest: mf.Manifest) -> DeviceCache:
        return DeviceCache(self.layout, 2 if self.mode == bp.ALTERNATE else 1, self)

    def row_copies(self, src: int, dst: int, length: int) -> list[tuple[int, int, int, int]]:
        """The 2-D copies that move ``length`` positions of cache row ``src`` to row ``dst``: per
        layer slot, ``(dst_offset, src_offset, width_bytes, height)``: ``height = H_kv`` rows of
        ``width_bytes``, at a pitch of ``S_max * D * itemsize`` bytes (one head's sequence)."""
        width = length * self.layout.head_dim * bp.ITEMSIZE[self.layout.dtype]
        out = []
        for slot in range(2 * self.layout.num_layers):
            base = slot * self.layout.slot_bytes
            row = self.layout.row_bytes
            out.append((base + dst * row, base + src * row, width, self.layout.num_kv_heads))
        return out

    def copy_rows(self, src: int, dst: int, length: int) -> None:
        """Run :meth:`row_copies` on the device, in the cache that holds the latest rows."""
        buffer = self.buffers[bp.CACHE_B if self.parity else bp.CACHE]
        pitch = self.layout.max_seq * self.layout.head_dim * bp.ITEMSIZE[self.layout.dtype]
        for dst_off, src_off, width, height in self.row_copies(src, dst, length):
            self.stream.copy_2d_on_device(buffer.ptr + dst_off, buffer.ptr + src_off, pitch, width, height)
        self.stream.synchronize()

    def address(self, s: bp.Slice) -> int:
        return self.buffers[s.buffer].ptr + s.offset

    def plans(
        self, graph_inputs: list[str], graph_outputs: list[str], batch: int, seq: int, first: int = 0
    ) -> dict[int, bp.BindingPlan]:
        """The binding plan of each cache parity this backend's mode uses, for cache rows
        ``[first, first + batch)``."""
        parities = (0, 1) if self.mode == bp.ALTERNATE else (0,)
        return {
            p: bp.plan_bindings(
                self.layout,
                self.io,
                graph_inputs=graph_inputs,
                graph_outputs=graph_outputs,
                batch=batch,
                seq=seq,
                mode=self.mode,
                parity=p,
                first=first,
            )
            for p in parities
        }

    def advance(self, binding: GpuBinding) -> None:
        """After a run: alternating caches swap (the one just written holds the latest rows)."""
        if self.mode == bp.ALTERNATE:
            self.parity ^= 1

    def check_prompt(self, seq: int) -> None:
        if seq > self.manifest.limits.max_prompt:
            raise ValueError(
                f"a prefill of {seq} tokens exceeds this artifact's max_prompt={self.manifest.limits.max_prompt} "
                "(the TensorRT prefill profile); recompile with a larger --max-prompt, or prefill in chunks"
            )

    def current(self, binding: GpuBinding) -> bp.BindingPlan:
        """The binding plan of the coming run (the cache parity the backend is at)."""
        return binding.plans[self.parity]

    def upload(self, binding: GpuBinding) -> None:
        """Stage the engine's step inputs in pinned memory and copy them to their device slices."""
        for name, array in binding.host_inputs.items():
            s = binding.plans[0].inputs[name]  # step tensors sit at the same io offsets in every parity
            staged = self.staging.view(s.offset, array.shape, array.dtype)
            staged[...] = array
            self.stream.copy_to_device(self.address(s), self.staging.ptr + s.offset, array.nbytes)
            self.stats.h2d_bytes += array.nbytes

    def download(self, binding: GpuBinding) -> None:
        """Copy back what the engine reads: the logits (``[B, V]``), or only ``next_token_ids``."""
        name = contract.LOGITS if binding.read_logits else bp.NEXT_TOKEN_IDS
        s = binding.plans[0].outputs[name]
        if binding.read_logits:
            self.stream.copy_to_host(binding.logits.ctypes.data, self.address(s), binding.logits.nbytes)
            self.stats.d2h_bytes += binding.logits.nbytes
        else:
            self.stream.copy_to_host(self.staging.ptr + s.offset, self.address(s), s.nbytes)
            self.stats.d2h_bytes += s.nbytes
        self.stream.synchronize()
        self.stats.steps += 1

    def next_token_ids(self, binding: GpuBinding) -> np.ndarray:
        """The ``[B]`` int32 argmax the TensorRT plan computes (after a run with ``read_logits=False``)."""
        s = binding.plans[0].outputs[bp.NEXT_TOKEN_IDS]
        return self.staging.view(s.offset, s.shape, np.int32)

    def step_arrays(
        self, inputs: dict[str, object], outputs: dict[str, object]
    ) -> tuple[dict, np.ndarray, int, int, int]:
        """Split the engine's arrays: host step inputs, the host logits array, batch, seq and the
        first cache row of the views."""
        host = {k: v for k, v in inputs.items() if k in STEP_INPUTS}
        logits = outputs[contract.LOGITS]
        if not isinstance(logits, np.ndarray) or logits.ndim != 2:
            raise ValueError("the GPU backends return last-token logits [B, V] only (no score graph on the GPU yet)")
        firsts = {v.first for v in inputs.values() if isinstance(v, DeviceView)}
        if len(firsts) != 1:
            raise ValueError("bind the cache views of one row range (the engine's cache.views(batch, first))")
        ids = host[contract.INPUT_IDS]
        return host, logits, int(ids.shape[0]), int(ids.shape[1]), firsts.pop()

    def close(self) -> None:
        for b in self.buffers.values():
            b.close()
        self.buffers.clear()
        self.staging.close()
        self.stream.close()
