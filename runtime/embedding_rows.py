"""An embedding table read row by row: the rows a run looks up, loaded from ``weights.data`` just
before the run, into anonymous memory whose other pages are never touched.

Why: a model with a tied lm_head reads its embedding table twice per step, once through the
``Gather`` of ``input_ids`` and once, whole, through the lm_head's ``Gemm``. Compile gives the
Gemm views of the table that ONNX Runtime packs into its own memory
(:func:`kvforge.compile.optimize.alias_tied_gemm_weights`), the fast layout; the ``Gather`` still
reads the table itself. Left to ONNX Runtime, that table is a mapping of ``weights.data``, and the
kernel maps a file's page cache in whole folios (2 MiB here), so a few hundred random lookups make
most of the table resident: the table twice in memory (SmolLM-135M: +113 MiB, peak RSS 1.48x the
checkpoint at batch 4). Here the ``Gather`` reads a buffer of the table's size in which only the
looked-up rows have been written (``pread`` from the file): a 4 KiB page per row or two.

The rows a process has looked up stay resident up to ``budget`` bytes; past it the buffer is
emptied (``MADV_DONTNEED``) and refilled by the lookups that follow, so a long-running server that
sees most of the vocabulary does not end up holding the table twice.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np


class EmbeddingRows:
    """A ``[rows, ...]`` table stored at ``offset`` of ``path``, filled on demand (:meth:`ensure`).

    ``array`` is the table as the ``Gather`` reads it: rows not yet loaded read as zeros, so every
    run must call :meth:`ensure` with its ids first. :class:`kvforge.runtime.ort_backend.OrtBackend`
    does, and holds one lock from the call to the end of the run, so the buffer is not emptied
    (:meth:`reset`) under another run's ``Gather``."""

    def __init__(
        self, path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype, budget: int | None = None
    ) -> None:
        self.path = Path(path)
        self.offset = offset
        self.rows = shape[0]
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
        size = self.rows * self.row_bytes
        held = os.path.getsize(self.path)
        if held < offset + size:
            raise ValueError(f"{self.path.name} holds {held} bytes, fewer than the table's end {offset + size}")
        self.budget = max(size // 8, 16 * 2**20) if budget is None else budget
        # Private anonymous memory: a page not written is never resident, and MADV_DONTNEED gives
        # pages back (a shared mapping, Python's default, would keep them in shmem).
        self._buffer = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self._buffer.madvise(mmap.MADV_NOHUGEPAGE)  # a row, not a 2 MiB huge page, per lookup
        self.array = np.frombuffer(self._buffer, dtype=dtype, count=int(np.prod(shape))).reshape(shape)
        self.loaded = np.zeros(self.rows, dtype=bool)
        self._seen = np.zeros(64, dtype=bool)  # the decode fast path's scratch (up to 64 ids a run)
        self.loaded_count = 0
        self.resets = 0
        self.value = None  # the OrtValue over array, set by whoever hands it to a session
        self._fd = os.open(self.path, os.O_RDONLY)

    def ensure(self, ids: np.ndarray) -> int:
        """Load every row of ``ids`` (any shape; negative ids count from the end, as ``Gather``'s do)
        not loaded yet; returns how many were read. No run may be reading :attr:`array` meanwhile."""
        ids = np.asarray(ids).ravel()
        if ids.size == 0:
            return 0
        if ids.size <= self._seen.size:  # a decode step's usual case: all loaded, checked without allocating
            seen = self._seen[: ids.size]
            np.take(self.loaded, ids, out=seen, mode="wrap")  # wrap: negative ids count from the end
            if seen.all():
                return 0
        ids = np.where(ids < 0, ids + self.rows, ids)
        ids = ids[(ids >= 0) & (ids < self.rows)]  # out of range: the Gather itself refuses them
        missing = np.unique(ids[~self.loaded[ids]])
        if missing.size == 0:
            return 0
        if (self.loaded_count + missing.size) * self.row_bytes > self.budget:
            self.reset()
            missing = np.unique(ids)
        view = memoryview(self._buffer)
        for row in missing.tolist():
            start = row * self.row_bytes
            target = view[start : start + self.row_bytes]
            done = 0
            while done < self.row_bytes:  # pread may return short reads
                n = os.preadv(self._fd, [target[done:]], self.offset + start + done)
                if n <= 0:
                    raise OSError(f"{self.path.name}: could not read embedding row {row}")
                done += n
        self.loaded[missing] = True
        self.loaded_count += int(missing.size)
        return int(missing.size)

    def reset(self) -> None:
        """Empty the buffer: its pages go back to the kernel and read as zeros until loaded again."""
        self._buffer.madvise(mmap.MADV_DONTNEED)
        self.loaded[:] = False
        self.loaded_count = 0
        self.resets += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def gather_only_tables(graph, input_name: str) -> list:
    """The initializers of ``graph`` (an ``onnx.ModelProto``'s graph) that are read only as the data
    of ``Gather`` nodes on axis 0 whose indices are the graph input ``input_name``, and stored
    externally: the tables :class:`EmbeddingRows` can hold. Returns their ``TensorProto``s."""
    import onnx

    readers: dict[str, list] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, index))
    for sub in _subgraph_inputs(graph):
        readers.setdefault(sub, []).append((None, -1))  # read inside a subgraph: not ours to judge
    tables = []
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL or len(init.dims) < 2:
            continue
        uses = readers.get(init.name, [])
        if uses and all(
            node is not None
            and node.op_type == "Gather"
            and node.domain in ("", "ai.onnx")
            and index == 0
            and node.input[1] == input_name
            and all(a.name != "axis" or a.i == 0 for a in node.attribute)
            for node, index in uses
        ):
            tables.append(init)
    return tables


def _subgraph_inputs(graph) -> set[str]:
    """Names read by nodes of subgraphs (If/Loop/Scan bodies) anywhere below ``graph``."""
    import onnx

    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                for inner in sub.node:
                    names.update(inner.input)
                names |= _subgraph_inputs(sub)
    return names
