"""Stage 3: in-memory graphs -> ``.onnx`` files that all read ONE external weights file.

Input: ``onnx_ir.Model`` graphs (from :mod:`kvforge.compile.export`, and later the optimized ones
from :mod:`kvforge.compile.optimize`). Output: ``<name>.onnx`` for each and ``weights.data`` in
the output directory. Every tensor of
``SHARE_THRESHOLD`` bytes or more is stored once: tensors are keyed by their content (dtype, shape,
bytes), not by name, because the exporter names constant-folded tensors (transposed weights, ...)
differently in each graph. Tensors are aligned to ``ALIGNMENT`` bytes so the file can be memory
mapped.

Each tensor's bytes are hashed once, as they are appended: the file's sha256 (the manifest's) is
kept running, so it is never read back to be hashed. Finding a tensor already stored costs a
digest of a sample of its bytes, then a byte-for-byte comparison with the stored candidate (the
sample only picks candidates; equality is always decided on every byte).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kvforge.graphs.manifest import sha256_file

WEIGHTS_FILE = "weights.data"
SHARE_THRESHOLD = 1024  # smaller tensors (shape constants, scalars) stay inside the graph
ALIGNMENT = 4096


@dataclass
class WeightsReport:
    file: str
    bytes: int  # size of the weights file
    tensors: int  # distinct tensors stored
    references: int  # initializers of all graphs that point into the file


class SharedWeights:
    """The artifact's one weights file. :meth:`externalize` moves the large initializers of a graph
    into it (each distinct tensor once, across every call), one tensor at a time: a tensor's bytes
    are written and its in-memory data released (the graph then points into the file) before the
    next is read, so moving a graph's weights never holds a second copy of them. :meth:`save`
    writes a graph as ``<name>.onnx``; :meth:`add` does both."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / WEIGHTS_FILE
        self.path.write_bytes(b"")
        # (dtype, shape, digest of a sample of the bytes) -> (offset, length) of each stored tensor
        self._by_sample: dict[tuple, list[tuple[int, int]]] = {}
        self._locations: set[tuple[int, int]] = set()
        self._file_hash = hashlib.sha256()  # of the file's bytes so far, alignment padding included
        self._size = 0
        self.references = 0

    def add(self, models: dict[str, ir.Model]) -> None:
        for model in models.values():
            self.externalize(model)
        for name, model in models.items():
            self.save(model, name)

    def externalize(self, model: ir.Model) -> None:
        """Point every initializer of ``model`` of ``SHARE_THRESHOLD`` bytes or more into the weights
        file, writing the tensors it does not hold yet. In place; ``model``'s own tensors are
        dropped as they are written (their memory is freed once nothing else holds them)."""
        with open(self.path, "r+b") as f:
            for value in _initializers(model):
                tensor = value.const_value
                if tensor is None or tensor.nbytes < SHARE_THRESHOLD:
                    continue
                offset, length = self._store(f, tensor)
                value.const_value = ir.ExternalTensor(
                    location=WEIGHTS_FILE,
                    offset=offset,
                    length=length,
                    dtype=tensor.dtype,
                    shape=tensor.shape,
                    name=value.name,
                    base_dir=self.out_dir,
                )
                del tensor
                self.references += 1

    def save(self, model: ir.Model, name: str) -> Path:
        """Write ``model`` (its weights already externalized) as ``<name>.onnx``; returns the path."""
        path = self.out_dir / f"{name}.onnx"
        ir.save(model, path)
        return path

    def _store(self, f, tensor) -> tuple[int, int]:
        if isinstance(tensor, ir.ExternalTensor) and Path(tensor.path).resolve() == self.path.resolve():
            offset = tensor.offset or 0
            if (offset, tensor.length) in self._locations or self._inside_stored(offset, tensor.length):
                return offset, tensor.length  # already in the file (a graph re-saved after a pass, or a view)
        data = _raw_bytes(tensor)
        key = (tensor.dtype, tuple(tensor.shape), _sample_digest(data))
        candidates = self._by_sample.setdefault(key, [])
        for offset, length in candidates:
            if length == len(data) and _same_bytes(f, offset, data):
                return offset, length
        offset = self._size + (-self._size % ALIGNMENT)
        f.seek(offset)
        f.write(data)
        self._file_hash.update(bytes(offset - self._size))  # the alignment gap reads as zeros
        self._file_hash.update(data)
        self._size = offset + len(data)
        candidates.append((offset, len(data)))
        self._locations.add((offset, len(data)))
        return offset, len(data)

    def sha256(self) -> str:
        """The weights file's sha256 (hex), from the bytes as they were written; read back and
        hashed only if the file is not exactly what this object wrote (its size differs)."""
        if self.path.stat().st_size != self._size:
            return sha256_file(self.path)
        return self._file_hash.hexdigest()

    def row_view(self, tensor: ir.ExternalTensor, start: int, stop: int, name: str) -> ir.ExternalTensor:
        """Rows ``[start, stop)`` of a 2-D tensor this file stores, as a tensor of its own that
        points at those bytes (rows are contiguous in a C-order tensor): a second initializer on
        the same data, never a second copy. Raises ValueError for a tensor not stored here."""
        offset = (tensor.offset or 0) if isinstance(tensor, ir.ExternalTensor) else None
        stored = offset is not None and (offset, tensor.length) in self._locations
        if not stored or len(tensor.shape) != 2 or tensor.dtype.bitwidth < 8:
            raise ValueError(f"{name}: a row view needs a 2-D tensor of whole bytes stored in {self.path.name}")
        rows, cols = tensor.shape
        if not 0 <= start < stop <= rows:
            raise ValueError(f"{name}: rows [{start}, {stop}) are outside the tensor's {rows} rows")
        row_bytes = cols * int(tensor.dtype.itemsize)
        return ir.ExternalTensor(
            location=WEIGHTS_FILE,
            offset=offset + start * row_bytes,
            length=(stop - start) * row_bytes,
            dtype=tensor.dtype,
            shape=ir.Shape([stop - start, cols]),
            name=name,
            base_dir=self.out_dir,
        )

    def _inside_stored(self, offset: int, length: int) -> bool:
        return any(start <= offset and offset + length <= start + size for start, size in self._locations)

    def report(self) -> WeightsReport:
        stored = sum(len(locations) for locations in self._by_sample.values())
        return WeightsReport(WEIGHTS_FILE, self.path.stat().st_size, stored, self.references)


_SAMPLES = 64  # 64-byte pieces, spread over the tensor, in a sample digest
_PIECE = 64


def _sample_digest(data: bytes | memoryview) -> bytes:
    """A digest of the first and last 4 KiB of ``data`` and of pieces spread over it: equal
    tensors have equal digests; distinct tensors almost always differ (then the bytes decide)."""
    view = memoryview(data).cast("B")
    n = len(view)
    h = hashlib.sha256(n.to_bytes(8, "little"))
    if n <= 16384:
        h.update(view)
        return h.digest()
    h.update(view[:4096])
    h.update(view[-4096:])
    step = (n - _PIECE) // _SAMPLES
    for i in range(_SAMPLES):
        h.update(view[i * step : i * step + _PIECE])
    return h.digest()


def _same_bytes(f, offset: int, data: bytes | memoryview, chunk: int = 1 << 24) -> bool:
    """Whether the file holds ``data`` at ``offset`` (compared in chunks of ``chunk`` bytes)."""
    expected = np.frombuffer(data, np.uint8)  # numpy compares at memory speed; memoryview's == does not
    f.seek(offset)
    for start in range(0, len(expected), chunk):
        piece = expected[start : start + chunk]
        if not np.array_equal(np.frombuffer(f.read(len(piece)), np.uint8), piece):
            return False
    return True


def _raw_bytes(tensor) -> bytes | memoryview:
    """The tensor's bytes as stored: a view of its own memory where it is contiguous (the
    embedding table of a model is not copied to be written), a copy otherwise (a transposed
    weight, a sub-byte type that ``tobytes`` packs)."""
    if isinstance(tensor, ir.ExternalTensor) or tensor.dtype.bitwidth < 8:
        return tensor.tobytes()
    array = tensor.numpy()
    if not array.flags.c_contiguous or array.nbytes != tensor.nbytes or array.dtype.byteorder == ">":
        return tensor.tobytes()
    return memoryview(array.reshape(-1).view(np.uint8))


def write_shared(models: dict[str, ir.Model], out_dir: Path) -> SharedWeights:
    """Start the artifact's weights file with ``models`` (see :class:`SharedWeights`)."""
    weights = SharedWeights(out_dir)
    weights.add(models)
    return weights


def _initializers(model: ir.Model) -> Iterable[ir.Value]:
    # Subgraphs included: ORT's offline optimizer folds constants inside a Scan or If body into that
    # body's own initializers (written to a file of its own, deleted after), which must move too.
    return [value for graph in model.graphs() for value in graph.initializers.values()]
