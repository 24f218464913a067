"""A hand-off's KV in POSIX shared memory between processes of one machine: one segment per block.

    alloc = SegmentAllocator()                        # prefill worker
    sched = engine.scheduler(block_alloc=alloc)       # hand-offs export straight into new segments
    ref = alloc.put(handle.result().handoff)          # small, picklable/JSON-able: send it on a pipe
    handoff = take(ref)                               # decode worker: a view on the segment, unlinked
    decode_sched.resume(handoff)                      # import_kv copies it into the cache row

Copies. The prefill side's export writes the cache row straight into the segment (``block_alloc``);
the decode side maps the segment and ``import_kv`` copies it into its cache: two copies in all, the
export and the import. Nothing is pickled but the header (:meth:`Handoff.header`: the prompt ids
and a few fields).

Integrity. :meth:`SegmentAllocator.put` hashes the data (xxh3-64 with the ``xxhash`` package of the
``serve`` extra, ~25 GB/s; else zlib's crc32, ~2 GB/s; sha256 runs at ~1 GB/s, too slow for a
60 MB block, see benchmarks/handoff.py) and the ref carries the digest; :func:`take` checks it and
the artifact's fingerprint before anything is returned: a corrupted or foreign block is a
:class:`KVBlockError`, never imported.

Segments. Named ``kvforge-<pid>-<n>-<random>`` after the creating process, in ``/dev/shm`` (Linux's
POSIX shared memory: what ``shm_open`` and ``multiprocessing.shared_memory`` use). Opened with
``os.open`` rather than ``SharedMemory`` because Python 3.11's resource tracker would unlink a
segment when its creator exits (or warn about one the other side unlinked) and its ``close`` fails
while numpy views exist. :func:`take` unlinks the segment as soon as it is mapped (the memory lives
until the last view goes); a segment whose ref is never taken stays until :func:`discard`,
:meth:`SegmentAllocator.close`, or :func:`unlink_segments` (a supervisor cleaning up after a dead
worker by its pid).
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.runtime.kv.block import DTYPES, KVBlockError
from kvforge.runtime.kv.handoff import Handoff

SHM_DIR = Path("/dev/shm")
PREFIX = "kvforge-"

try:
    import xxhash
except ImportError:  # the serve extra brings it; crc32 is the slower fallback
    xxhash = None


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of the segments created by process ``pid`` (default: this one)."""
    return f"{PREFIX}{os.getpid() if pid is None else int(pid)}-"


def checksum(data: np.ndarray | memoryview, algorithm: str | None = None) -> str:
    """``"algorithm:hex digest"`` of ``data``'s bytes (C-contiguous); algorithm ``xxh3_64`` (when
    ``xxhash`` is installed, the default then) or ``crc32``."""
    algorithm = algorithm or ("xxh3_64" if xxhash is not None else "crc32")
    raw = memoryview(data).cast("B")
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise KVBlockError(
                "this KV hand-off was hashed with xxh3_64, but the xxhash package is not installed here: "
                "pip install 'kvforge[serve]' on every worker"
            )
        return f"xxh3_64:{xxhash.xxh3_64_hexdigest(raw)}"
    if algorithm == "crc32":
        return f"crc32:{zlib.crc32(raw):08x}"
    raise KVBlockError(f"unknown checksum algorithm {algorithm!r}: expected xxh3_64 or crc32")


@dataclass(frozen=True)
class ShmRef:
    """Where a hand-off's KV is (segment ``name``, ``nbytes``), its ``checksum`` and the hand-off's
    ``header`` (:meth:`Handoff.header`). Plain data: pickle it or send :meth:`to_dict` as JSON."""

    name: str
    nbytes: int
    checksum: str
    header: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShmRef:
        return cls(str(d["name"]), int(d["nbytes"]), str(d["checksum"]), dict(d["header"]))


def _create(name: str, nbytes: int) -> np.ndarray:
    """A new segment ``name`` of ``nbytes`` bytes mapped writable, as a uint8 array that owns the mapping."""
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        pages = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
        os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)
    return np.frombuffer(pages, dtype=np.uint8, count=nbytes)


class SegmentAllocator:
    """Creates this process's segments: a scheduler's ``block_alloc`` (``nbytes -> writable
    buffer``) and :meth:`put`, which turns a hand-off whose data is in one of them into a ref.
    Thread-safe (the scheduler's thread allocates, a worker's thread puts)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, str] = {}  # data address -> name of the segments allocated, not yet put
        self._count = itertools.count()

    def _new_name(self) -> str:
        return f"{segment_prefix()}{next(self._count)}-{secrets.token_hex(4)}"

    def __call__(self, nbytes: int) -> np.ndarray:
        name = self._new_name()
        buf = _create(name, nbytes)
        with self._lock:
            self._open[buf.ctypes.data] = name
        return buf

    def put(self, handoff: Handoff) -> ShmRef:
        """The ref of ``handoff``: its data where it already is (exported into one of this
        allocator's segments: no copy), else copied into a new segment. The data is hashed here."""
        data = handoff.block.data
        with self._lock:
            name = self._open.pop(data.ctypes.data, None) if data.flags.c_contiguous else None
        if name is None:
            name = self._new_name()
            np.copyto(_create(name, data.nbytes).view(data.dtype).reshape(data.shape), data)
        return ShmRef(name, data.nbytes, checksum(data), handoff.header())

    def close(self) -> None:
        """Unlink the segments allocated and never put (a hand-off that failed or was dropped)."""
        with self._lock:
            names, self._open = list(self._open.values()), {}
        for name in names:
            _unlink(name)


_default = SegmentAllocator()


def put(handoff: Handoff) -> ShmRef:
    """``handoff``'s ref, its data copied into a new segment unless it was exported into one of
    this process's (:class:`SegmentAllocator`)."""
    return _default.put(handoff)


def take(ref: ShmRef, fingerprint: dict[str, Any] | None = None) -> Handoff:
    """The hand-off of ``ref``, its block's data a read-only view on the segment, which is
    unlinked (taken once; the memory stays until the view is dropped). KVBlockError when the
    segment is gone or shorter than the ref says, the data does not match its checksum, or (with
    ``fingerprint``, the importing engine's ``kv_fingerprint``) it comes from another artifact."""
    path = SHM_DIR / ref.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise KVBlockError(
            f"the shared-memory segment {ref.name} of this KV hand-off is gone (taken already, or its prefill "
            "worker died and its segments were cleaned up): run the request again"
        ) from None
    try:
        os.unlink(path)
        size = os.fstat(fd).st_size
        if size < ref.nbytes:
            raise KVBlockError(
                f"the shared-memory segment {ref.name} holds {size} bytes, the hand-off needs {ref.nbytes}: "
                "it is truncated; run the request again"
            )
        pages = mmap.mmap(fd, max(ref.nbytes, 1), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    b = ref.header["block"]
    dtype = np.dtype(DTYPES.get(b["dtype"], b["dtype"]))
    raw = np.frombuffer(pages, dtype=np.uint8, count=ref.nbytes)
    handoff = Handoff.from_parts(ref.header, raw.view(dtype).reshape(b["shape"]))  # reads no data
    if fingerprint is not None:
        handoff.block.check_compatible(fingerprint)
    algorithm = ref.checksum.partition(":")[0]
    if checksum(raw, algorithm) != ref.checksum:
        raise KVBlockError(
            f"the KV hand-off in shared-memory segment {ref.name} does not match its {algorithm} checksum: "
            "the data was corrupted or overwritten; it is not imported (run the request again)"
        )
    return handoff


def _unlink(name: str) -> bool:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True


def discard(ref: ShmRef) -> bool:
    """Unlink ``ref``'s segment without reading it (a request cancelled in transit); False when it
    was gone already."""
    return _unlink(ref.name)


def segments(pid: int | None = None) -> list[str]:
    """Names of the kvforge segments that exist now, of process ``pid`` (None: every process's)."""
    prefix = PREFIX if pid is None else segment_prefix(pid)
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))


def unlink_segments(pid: int) -> list[str]:
    """Unlink every segment created by process ``pid`` (a worker that died: its hand-offs not yet
    taken); returns their names."""
    return [name for name in segments(pid) if _unlink(name)]
