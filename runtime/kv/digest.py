"""Checksums of a KV hand-off's data, computed as it is copied (disaggregated prefill/decode).

    digest = Digest()                       # xxh3_64 with the xxhash package, else zlib's crc32
    engine.export_kv(row, ids, out=buf, digest=digest)   # hashed piece by piece as it is copied
    digest.value()                          # "xxh3_64:<hex>": the checksum of the whole block
    engine.import_kv(block, row, checksum=digest.value())  # checked as it is copied: KVBlockError

A hand-off exported by copy is two copies (the export and the import), and a separate pass over
the block for the checksum on each side would read it from memory once more: each side hashes
each contiguous piece right after it copies it (the import: the piece as its cache now holds it),
while it is in the CPU's cache.
A lent row (:mod:`kvforge.runtime.kv.shm`) is one copy: the prefill side hashes the row in place
(one read pass, no copy), the import hashes as it copies. Hashed in the order of its bytes (a
strided view of a cache row piece by contiguous piece, per head), the streaming digest is the
digest of the whole contiguous block: the same value as :func:`checksum` of the data in one call.

Algorithms: ``xxh3_64`` (the ``xxhash`` package of the ``serve`` extra, ~25 GB/s) or ``crc32``
(zlib, ~2 GB/s; the fallback). A checksum names its algorithm, so the taker checks with the
producer's.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np

from kvforge.runtime.kv.block import KVBlockError

try:
    import xxhash
except ImportError:  # the serve extra brings it; crc32 is the slower fallback
    xxhash = None

ALGORITHMS = ("xxh3_64", "crc32")


def default_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


class Digest:
    """A streaming checksum: :meth:`update` with consecutive pieces of the data, in order, then
    :meth:`value` (``"algorithm:hex digest"``)."""

    def __init__(self, algorithm: str | None = None) -> None:
        self.algorithm = algorithm = algorithm or default_algorithm()
        if algorithm == "xxh3_64":
            if xxhash is None:
                raise KVBlockError(
                    "this KV hand-off was hashed with xxh3_64, but the xxhash package is not installed here: "
                    "pip install 'kvforge[serve]' on every worker"
                )
            self._xxh = xxhash.xxh3_64()
        elif algorithm == "crc32":
            self._crc = 0
        else:
            raise KVBlockError(f"unknown checksum algorithm {algorithm!r}: expected one of {', '.join(ALGORITHMS)}")

    def update(self, piece: np.ndarray | memoryview) -> None:
        """Hash the bytes of ``piece``, the next part of the data, in C order: a strided array (a
        cache row's ``[H_kv, n, D]`` positions) piece by contiguous piece, which gives the digest of
        its C-contiguous copy."""
        if isinstance(piece, np.ndarray) and not piece.flags.c_contiguous:
            lead = _strided_axes(piece)  # the pieces over the leading axes are contiguous (a head's [n, D])
            for index in itertools.product(*map(range, piece.shape[:lead])):
                self._update(piece[index])
            return
        self._update(piece)

    def _update(self, piece: np.ndarray | memoryview) -> None:
        raw = memoryview(piece).cast("B")
        if self.algorithm == "xxh3_64":
            self._xxh.update(raw)
        else:
            self._crc = zlib.crc32(raw, self._crc)

    def value(self) -> str:
        if self.algorithm == "xxh3_64":
            return f"xxh3_64:{self._xxh.hexdigest()}"
        return f"crc32:{self._crc:08x}"


def _strided_axes(array: np.ndarray) -> int:
    """How many leading axes of ``array`` to index for every sub-array to be C-contiguous."""
    expected = array.itemsize
    for axis in range(array.ndim - 1, -1, -1):
        if array.shape[axis] != 1 and array.strides[axis] != expected:
            return axis + 1
        expected *= array.shape[axis]
    return 0


def checksum(data: np.ndarray | memoryview, algorithm: str | None = None) -> str:
    """``"algorithm:hex digest"`` of ``data``'s bytes in C order, in one call (a strided array
    piece by contiguous piece: the checksum of its contiguous copy)."""
    digest = Digest(algorithm)
    digest.update(data)
    return digest.value()


def algorithm_of(value: str) -> str:
    """The algorithm a checksum ``"algorithm:hex"`` names."""
    return value.partition(":")[0]
