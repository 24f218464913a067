"""The KV cache: one allocation per engine, bound in place to every graph.

``KVCache.buffer`` is a numpy array ``[L, 2, B_max, H_kv, S_max, D]`` in the artifact's dtype,
owned by the cache and allocated once. Its per-layer views are what the backend binds to the
``past_key_values.*`` inputs and, with the same pointer, to the ``present.*`` outputs.

The runtime holds host memory as numpy arrays, not torch tensors: ONNX Runtime's CPU provider
needs nothing more, and importing torch would add about 200 MiB to the resident set of a process
that never runs a torch op.

Memory. The buffer's pages become resident as positions are written, not at allocation: a cache
of ``max_seq`` 512 that holds 192 positions per row costs 192/512 of its size. numpy asks the
kernel for transparent huge pages on large arrays, so the first write into a 2 MiB region would
make all of it resident (every row and position of a layer's cache at once, for small models);
the cache is therefore mapped by :func:`zeroed_pages`, in ordinary pages.

Shared (``KVCache(manifest, shared=True)``, ``Engine.load(..., kv_shared=True)``): the buffer
lives in a named POSIX shared-memory segment (:class:`kvforge.runtime.kv.lend.SharedCache`, also
zero-filled, ordinary pages, resident as written) with a state word per row, so that a prefill
worker can lend a row's KV to a decode worker's import instead of copying it out (disaggregated
prefill/decode).

Model state (contract schema 3: a hybrid family). ``buffer`` holds KV only for the layers that
attend (``[L_attn, 2, B_max, H_kv, S_max, D]`` over ``manifest.layout.attention``), and
``states`` holds one zeroed allocation ``[B_max, *shape]`` per state tensor of every other layer,
in its own dtype, by past-input name. :meth:`views` gives both; the engine binds each past input
and its present output to the same view, so the graph updates a state in place, and
:meth:`copy_row` moves a row's states with its KV (in-flight batching's compaction). A state is
valid at its row's length only: the KV block paths (:meth:`read_positions` and co.) carry KV,
and the engine's export adds a row's ``states`` to a block that ends at the row's length
(:mod:`kvforge.runtime.kv.transfer`).

8-bit KV (``--kv-dtype int8``): ``buffer`` is int8 and ``scales`` one more allocation
``[L, 2, B_max, H_kv, S_max]`` float32 (a scale per cached row and head,
:mod:`kvforge.graphs.contract`); :meth:`views` adds each layer's ``[batch, H_kv, S_max, 1]`` scale
views (a free reshape), bound in place like the KV, :meth:`copy_row` moves them with the rows, and
:meth:`read_scales` / :meth:`write_scales` are the block paths' scale side.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np

from kvforge.graphs import contract
from kvforge.graphs.manifest import ArtifactError, Manifest

NP_DTYPES = {"float32": np.float32, "float16": np.float16}


class KVCache:
    def __init__(self, manifest: Manifest, shared: bool = False) -> None:
        m, limits = manifest.model, manifest.limits
        if manifest.dtype not in NP_DTYPES:
            raise ArtifactError(f"the CPU runtime has no {manifest.dtype} buffers; recompile with --dtype float32")
        self.layout = manifest.layout
        if self.layout.quantized_kv and shared:
            raise ArtifactError(
                "kv_shared=True lends KV rows to another process, and this artifact's KV cache is 8-bit with "
                "per-row scales (--kv-dtype int8), which lent rows do not carry yet; load it without kv_shared"
            )
        self.model_dtype = np.dtype(NP_DTYPES[manifest.dtype])  # the activations' and logits' dtype
        kv_dtype = np.int8 if self.layout.quantized_kv else self.model_dtype
        self.attention_layers = self.layout.attention  # the layers whose KV buffer[i] holds, in order
        self.shape = contract.cache_shape(
            len(self.attention_layers), limits.max_batch, m.num_kv_heads, limits.max_seq, m.head_dim
        )
        self.num_layers = len(self.attention_layers)  # KV layers: the buffer's first axis
        self.max_batch = limits.max_batch
        self.max_seq = limits.max_seq
        # Zeros, not empty: rows past a sequence's length are masked, but NaN garbage times a zero
        # attention weight would still be NaN.
        self.segment = None  # a SharedCache when shared: the buffer's segment and its rows' state words
        if shared:
            from kvforge.runtime.kv.lend import SharedCache

            self.segment = SharedCache(self.shape, kv_dtype)
            self.buffer = self.segment.buffer
        else:
            self.buffer = zeroed_pages(self.shape, kv_dtype)
        # 8-bit KV: [L, 2, B_max, H_kv, S_max] float32, a scale per cached row and head; None: float KV
        self.scales: np.ndarray | None = None
        if self.layout.quantized_kv:
            scale_shape = contract.scale_shape(self.num_layers, limits.max_batch, m.num_kv_heads, limits.max_seq)
            self.scales = zeroed_pages(scale_shape, np.float32)
        if shared and self.layout.has_state:
            raise ArtifactError(
                "kv_shared=True lends KV rows to another process, and this artifact's layers also keep a "
                "state (a hybrid family), which lent rows do not carry; load it without kv_shared"
            )
        # One allocation per state tensor, [B_max, *shape], by past-input name (zeros: a new row's
        # state is zeros; the graph also masks the state of rows that start at position 0).
        self.states: dict[str, np.ndarray] = {}
        for entry, tensor in self.layout.state_tensors():
            if tensor.dtype not in NP_DTYPES:
                raise ArtifactError(f"the CPU runtime has no {tensor.dtype} buffers; recompile with --dtype float32")
            name = contract.past_state_name(entry.layer, tensor.part)
            self.states[name] = zeroed_pages(contract.state_shape(self.max_batch, tensor), NP_DTYPES[tensor.dtype])
        # past-input name -> present-output name, every cache tensor (KV, then states)
        self.present_of = dict(zip(contract.past_names(self.layout), contract.present_names(self.layout)))

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.state_nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the state allocations (0 for a model whose every layer attends)."""
        return sum(a.nbytes for a in self.states.values())

    def views(self, batch: int, first: int = 0) -> dict[str, np.ndarray]:
        """Rows ``[first, first + batch)`` of every layer's key and value cache, by past-input name.

        Each view ``[batch, H_kv, S_max, D]`` is contiguous (a range of whole rows of the
        ``[B_max, H_kv, S_max, D]`` layer cache) and aliases ``buffer``: no copy.
        """
        if not 1 <= batch <= self.max_batch or not 0 <= first <= self.max_batch - batch:
            raise ValueError(
                f"cache rows [{first}, {first + batch}) are outside [0, {self.max_batch}) (the artifact's max_batch)"
            )
        views = {}
        for i, layer in enumerate(self.attention_layers):
            views[contract.past_key_name(layer)] = self.buffer[i, 0, first : first + batch]
            views[contract.past_value_name(layer)] = self.buffer[i, 1, first : first + batch]
        for name, state in self.states.items():  # [batch, *shape], contiguous rows
            views[name] = state[first : first + batch]
        if self.scales is not None:  # [batch, H_kv, S_max, 1]: contiguous rows, a trailing unit axis
            for i, layer in enumerate(self.attention_layers):
                views[contract.past_scale_name(layer, "key")] = self.scales[i, 0, first : first + batch, ..., None]
                views[contract.past_scale_name(layer, "value")] = self.scales[i, 1, first : first + batch, ..., None]
        return views

    def present_views(self, batch: int, first: int = 0) -> dict[str, np.ndarray]:
        """:meth:`views` by present-output name: each present shares its past input's buffer."""
        return {self.present_of[name]: view for name, view in self.views(batch, first).items()}

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of cache row ``src`` into row ``dst`` (every layer,
        key and value), in place: ``buffer[:, :, dst, :, :length] = buffer[:, :, src, :, :length]``.
        Positions ``>= length`` of ``dst`` keep stale values, which attention masks. Each state of
        row ``src`` (valid at ``length``) moves to ``dst`` whole."""
        if needs_row_copy(src, dst, length, self.max_batch, self.max_seq):
            self.buffer[:, :, dst, :, :length] = self.buffer[:, :, src, :, :length]
            if self.scales is not None:
                self.scales[:, :, dst, :, :length] = self.scales[:, :, src, :, :length]
            for state in self.states.values():
                state[dst] = state[src]

    def read_positions(
        self, row: int, start: int, stop: int, out: np.ndarray | None = None, each: Callable | None = None
    ) -> np.ndarray:
        """Positions ``[start, stop)`` of cache row ``row``, every layer's keys and values, as a
        C-contiguous array ``[L, 2, H_kv, stop - start, D]`` (new, or ``out``): one strided copy
        (a KV block's data). ``each``: called with each ``[H_kv, n, D]`` piece of the result, in
        order, right after it is copied (a checksum computed while the piece is in the CPU's cache)."""
        if out is None and each is None:
            return np.ascontiguousarray(self.buffer[:, :, row, :, start:stop])
        if out is None:
            out = np.empty(self.buffer[:, :, row, :, start:stop].shape, self.buffer.dtype)
        if each is None:
            np.copyto(out, self.buffer[:, :, row, :, start:stop])
            return out
        for layer in range(out.shape[0]):
            for kv in range(2):
                np.copyto(out[layer, kv], self.buffer[layer, kv, row, :, start:stop])
                each(out[layer, kv])
        return out

    def view_positions(self, row: int, start: int, stop: int) -> np.ndarray:
        """Positions ``[start, stop)`` of cache row ``row`` as a read-only strided view
        ``[L, 2, H_kv, stop - start, D]`` of the buffer (no copy; valid while the row is not
        written: a lent row, :mod:`kvforge.runtime.kv.shm`)."""
        view = self.buffer[:, :, row, :, start:stop]
        view.flags.writeable = False
        return view

    def write_positions(self, row: int, start: int, data: np.ndarray, each: Callable | None = None) -> None:
        """Write ``data`` ``[L, 2, H_kv, n, D]`` (contiguous, or a strided view such as another
        cache's row) into positions ``[start, start + n)`` of cache row ``row``: one strided copy
        (the inverse of :meth:`read_positions`). ``each``: called with each head's ``[n, D]``
        piece as this cache holds it, in order, right after it is copied (a checksum of what was
        written, computed while the piece is in the CPU's cache)."""
        stop = start + data.shape[3]
        if each is None:
            self.buffer[:, :, row, :, start:stop] = data
            return
        for layer in range(data.shape[0]):
            for kv in range(2):
                for head in range(data.shape[2]):
                    piece = self.buffer[layer, kv, row, head, start:stop]
                    np.copyto(piece, data[layer, kv, head])
                    each(piece)

    def read_scales(self, row: int, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray | None:
        """8-bit KV: the scales of positions ``[start, stop)`` of cache row ``row`` as a new
        contiguous ``[L, 2, H_kv, stop - start]`` float32 array (a block's scales), or copied into
        ``out`` (that shape) and returned; None for a float cache."""
        if self.scales is None:
            return None
        if out is None:
            return np.ascontiguousarray(self.scales[:, :, row, :, start:stop])
        np.copyto(out, self.scales[:, :, row, :, start:stop])
        return out

    def write_scales(self, row: int, start: int, scales: np.ndarray) -> None:
        """Write ``scales`` ``[L, 2, H_kv, n]`` into positions ``[start, start + n)`` of cache row
        ``row`` (the inverse of :meth:`read_scales`)."""
        self.scales[:, :, row, :, start : start + scales.shape[3]] = scales

    def close(self) -> None:
        """Unlink a shared buffer's segment (views mapped by other processes stay valid)."""
        if self.segment is not None:
            self.segment.close()


def zeroed_pages(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero-filled C-contiguous array of ``shape`` and ``dtype`` in an anonymous private mapping of
    its own, in ordinary (not huge) pages: a page becomes resident when first written, so memory
    grows with the positions in use. The array owns the mapping (it is released with the array)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux: also when the system's THP policy is "always"
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, dtype=dtype).reshape(shape)


def needs_row_copy(src: int, dst: int, length: int, max_batch: int, max_seq: int) -> bool:
    """Check a ``copy_row(src, dst, length)`` against the cache's bounds (ValueError when outside);
    False when there is nothing to copy (the same row, or no positions). Shared by every cache."""
    if src == dst or length == 0:
        return False
    for row in (src, dst):
        if not 0 <= row < max_batch:
            raise ValueError(f"cache row {row} is outside [0, {max_batch})")
    if not 0 <= length <= max_seq:
        raise ValueError(f"length {length} is outside [0, {max_seq}]")
    return True
