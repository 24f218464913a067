"""A hand-off's KV in POSIX shared memory between processes of one machine.

    alloc = SegmentAllocator()                        # prefill worker: its arena, populated once
    sched = engine.scheduler(block_alloc=alloc)       # hand-offs export straight into arena slots
    ref = alloc.put(handle.result().handoff)          # small, picklable/JSON-able: send it on a pipe
    handoff = take(ref)                               # decode worker: a read-only view, checked
    decode_sched.resume(handoff)                      # import_kv copies it in, then frees the slot

Lent rows: one copy (what the disaggregated server's prefill workers do by default)::

    engine = Engine.load(out, kv_shared=True)         # prefill worker: its cache is a segment (lend.SharedCache)
    sched = engine.scheduler(lend_rows=True)          # a hand-off lends its row: no copy, hashed in place
    ref = engine.cache.segment.put(handle.result().handoff)   # the row, its lending id, checksum, header
    handoff = take(ref, fingerprint, verify=False)    # decode worker: the row's strided read-only view
    decode_sched.resume(handoff)                      # import_kv copies it (the one copy), frees the row

Copies. Lent, the block's data never leaves the prefill worker's cache row until the decode
side's ``import_kv`` copies it into its own cache: one copy; the prefill side reads the row once
to hash it. Exported into an arena (``block_alloc``), the prefill side's export writes the row
into shared memory and the decode side copies it in: two copies. Nothing is pickled but the
header (:meth:`Handoff.header`: the prompt ids and a few fields) and the ref.

Lending. :class:`kvforge.runtime.kv.lend.SharedCache` is a cache's buffer in a segment, with a
state word per row as an arena slot's; :func:`take` of its ref maps the cache's segment once (its
pages as they are read, not populated: a cache is mostly unwritten) and keeps it, and gives the
row's strided view; release and :func:`discard` set the row's state word back to 0.

Memory. A new tmpfs page costs far more than the copy into it (~60 ms to fault in the pages of a
55 MB block on this machine, against ~9 ms of memcpy; benchmarks/handoff.py), so a
:class:`SegmentAllocator` puts blocks into slots of one arena segment created and populated once
and reused: the taker marks a slot free in the slot's own state word once the block is imported
(``Handoff.release``, which the scheduler calls; no message back), and the allocator's next
allocation reclaims it. The taker maps an arena once and keeps it. A block that does not fit
the arena gets a segment of its own, which its taker unlinks as soon as it is mapped.

Integrity. The scheduler's export hashes the data layer by layer as it copies it (a lent row: in
place, head by head, in the byte order of the contiguous block: the same digest;
:mod:`kvforge.runtime.kv.digest`: xxh3-64 with the ``xxhash`` package of the ``serve`` extra,
~25 GB/s; else zlib's crc32, ~2 GB/s; sha256 runs at ~1 GB/s) and the ref carries the digest
(:meth:`SegmentAllocator.put` hashes a hand-off that comes without one); :func:`take` checks the
artifact's fingerprint and, by default, the digest in a pass of its own; a decode worker takes
with ``verify=False`` and its scheduler's import checks the digest as it copies (each piece
hashed as its cache holds it, right after the copy; no pass of its own on the decode side): a
foreign or corrupted block (a lent row overwritten too) is a :class:`KVBlockError`, never imported.

State (a hybrid artifact). A hand-off's block also carries its row's state: the export writes it
into the same memory right after the KV data (``Engine.kv_nbytes`` counts it), the ref's
``nbytes`` and checksum cover both, and :func:`take` cuts the state's arrays from the bytes after
the KV (:func:`~kvforge.runtime.kv.handoff.split_state`). Such rows are never lent (a lent row is
KV only): a hybrid's prefill worker exports into its arena.

Names. ``kvforge-<pid>-...`` after the creating process, in ``/dev/shm`` (Linux's POSIX shared
memory: what ``shm_open`` and ``multiprocessing.shared_memory`` use). Opened with ``os.open``
rather than ``SharedMemory``: Python 3.11's resource tracker would unlink a segment when its
creator exits (or warn about one the other side unlinked), and its ``close`` fails while numpy
views exist. A supervisor cleans up after a dead worker with :func:`unlink_segments` (its pid);
views already taken stay valid until dropped.
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.runtime.kv.block import DTYPES, KVBlockError
from kvforge.runtime.kv.digest import Digest, algorithm_of, checksum
from kvforge.runtime.kv.handoff import Handoff, split_state

SHM_DIR = Path("/dev/shm")
PREFIX = "kvforge-"
SLOT_HEADER = 4096  # an arena slot: one page holding its state word, then the data (page-aligned)
FREE = 0  # a slot's state word: 0 once free again (set by the taker), else the id of its allocation
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map every page in one call, not a fault each


def segment_prefix(pid: int | None = None) -> str:
    """The name prefix of the segments created by process ``pid`` (default: this one)."""
    return f"{PREFIX}{os.getpid() if pid is None else int(pid)}-"


@dataclass(frozen=True)
class ShmRef:
    """Where a hand-off's KV is (segment ``name``, bytes ``[offset, offset + nbytes)``), its
    ``checksum`` and the hand-off's ``header`` (:meth:`Handoff.header`); ``slot``: the offset of
    its slot's state word in an arena (None: a segment of its own), which holds ``slot_id`` until
    the slot is freed. A lent cache row (:class:`kvforge.runtime.kv.lend.SharedCache`): ``name`` is the cache's segment,
    ``cache`` the cache's shape ``[L, 2, B, H_kv, S, D]`` (its buffer at ``offset``, in the
    header's dtype), ``row`` the row whose first ``n`` positions are the block (``nbytes`` its
    bytes), ``slot`` the row's state word. Plain data: pickle it or send :meth:`to_dict` as JSON."""

    name: str
    nbytes: int
    checksum: str
    header: dict[str, Any]
    offset: int = 0
    slot: int | None = None
    slot_id: int = 0
    cache: list[int] | None = None
    row: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShmRef:
        slot = d.get("slot")
        return cls(
            str(d["name"]),
            int(d["nbytes"]),
            str(d["checksum"]),
            dict(d["header"]),
            int(d.get("offset", 0)),
            None if slot is None else int(slot),
            int(d.get("slot_id", 0)),
            None if d.get("cache") is None else [int(x) for x in d["cache"]],
            int(d.get("row", 0)),
        )


def map_segment(
    name: str, nbytes: int = 0, create: bool = False, writable: bool = True, populate: bool = True
) -> mmap.mmap:
    """Segment ``name`` mapped whole (created with ``nbytes`` bytes when ``create``), its pages
    populated at once (``populate``; else each is mapped at its first touch: a KV cache's, whose
    pages become resident as positions are written)."""
    fd = os.open(
        SHM_DIR / name, (os.O_RDWR if writable else os.O_RDONLY) | (os.O_CREAT | os.O_EXCL if create else 0), 0o600
    )
    try:
        if create:
            os.ftruncate(fd, max(nbytes, 1))
        size = os.fstat(fd).st_size
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        pages = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0), prot=prot)
        if not populate and hasattr(mmap, "MADV_NOHUGEPAGE"):  # as cache.zeroed_pages: ordinary pages
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        return pages
    except BaseException:
        if create:
            os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)


class SegmentAllocator:
    """This process's shared memory for hand-offs (module docstring): a scheduler's
    ``block_alloc`` (``nbytes -> writable buffer``) and :meth:`put`, which turns a hand-off whose
    data is in it into a ref. ``arena_bytes``: the arena's size (0: no arena, a segment per
    block). Thread-safe (the scheduler's thread allocates, a worker's thread puts)."""

    def __init__(self, arena_bytes: int = 256 * 2**20) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, tuple[str, int | None]] = {}  # data address -> (segment, slot): allocated, not put
        self._slots: dict[int, int] = {}  # slot offset -> bytes (its header page included) of the used slots
        self._count = itertools.count(1)
        self.arena_name: str | None = None
        self._arena: np.ndarray | None = None
        if arena_bytes:
            self.arena_name = f"{segment_prefix()}arena-{secrets.token_hex(4)}"
            self._arena = np.frombuffer(map_segment(self.arena_name, arena_bytes, create=True), dtype=np.uint8)

    def __call__(self, nbytes: int) -> np.ndarray:
        with self._lock:
            slot = self._reserve(SLOT_HEADER + nbytes)
            if slot is not None:
                self._state(slot)[0] = next(self._count)
                buf = self._arena[slot + SLOT_HEADER : slot + SLOT_HEADER + nbytes]
                self._open[buf.ctypes.data] = (self.arena_name, slot)
                return buf
        name = f"{segment_prefix()}{next(self._count)}-{secrets.token_hex(4)}"
        buf = np.frombuffer(map_segment(name, nbytes, create=True), dtype=np.uint8, count=nbytes)
        with self._lock:
            self._open[buf.ctypes.data] = (name, None)
        return buf

    def _state(self, slot: int) -> np.ndarray:
        return self._arena[slot : slot + 8].view(np.uint64)

    def _reserve(self, size: int) -> int | None:
        """First fit in the arena, after reclaiming the slots their takers freed; None: no room."""
        if self._arena is None:
            return None
        size = -(-size // SLOT_HEADER) * SLOT_HEADER
        allocated = {slot for _, slot in self._open.values()}
        for slot in [s for s in self._slots if self._state(s)[0] == FREE and s not in allocated]:
            del self._slots[slot]
        at = 0
        for slot in sorted(self._slots):
            if slot - at >= size:
                break
            at = slot + self._slots[slot]
        if at + size > len(self._arena):
            return None
        self._slots[at] = size
        return at

    def put(self, handoff: Handoff) -> ShmRef:
        """The ref of ``handoff``: its data where it is when it was exported into this allocator's
        memory (no copy), else copied into new memory of it. Its checksum is ``handoff.checksum``
        (the scheduler's export computes it as it copies), else the data is hashed here."""
        block = handoff.block
        data, nbytes = block.data, handoff.nbytes  # a hybrid's state follows the KV data in the memory
        with self._lock:
            where = self._open.pop(data.ctypes.data, None) if data.flags.c_contiguous else None
        if where is not None and block.tail() and not _follows(data, block.tail()):
            with self._lock:  # exported elsewhere, then cut apart: copied below, like any other
                self._open[data.ctypes.data] = where
            where = None
        if where is None:
            buf = self(nbytes)
            np.copyto(buf[: data.nbytes].view(data.dtype).reshape(data.shape), data)
            at = data.nbytes
            for value in block.tail():
                np.copyto(buf[at : at + value.nbytes].view(value.dtype).reshape(value.shape), value)
                at += value.nbytes
            with self._lock:
                where = self._open.pop(buf.ctypes.data)
        name, slot = where
        digest = handoff.checksum or block_checksum(block)  # the export's, hashed as it copied (the scheduler's)
        if slot is None:
            return ShmRef(name, nbytes, digest, handoff.header())
        slot_id = int(self._state(slot)[0])
        return ShmRef(name, nbytes, digest, handoff.header(), slot + SLOT_HEADER, slot, slot_id)

    def close(self) -> None:
        """Unlink the arena (views taken stay valid until dropped) and the segments allocated and
        never put (a hand-off that failed or was dropped)."""
        with self._lock:
            names = [name for name, slot in self._open.values() if slot is None]
            self._open, self._slots = {}, {}
        for name in [*names, *([self.arena_name] if self.arena_name else [])]:
            unlink(name)


def _follows(data: np.ndarray, tail: list[np.ndarray]) -> bool:
    """Whether the ``tail`` arrays lie right after ``data`` in memory, in order (an export into
    one buffer: the KV data, then 8-bit KV's scales and each state tensor)."""
    at = data.ctypes.data + data.nbytes
    for value in tail:
        if value.ctypes.data != at or not value.flags.c_contiguous:
            return False
        at += value.nbytes
    return True


def block_checksum(block) -> str:
    """The checksum of a hand-off block's bytes: its KV data, then 8-bit KV's scales and its state
    (a hybrid's)."""
    digest = Digest()
    digest.update(block.data)
    for value in block.tail():
        digest.update(value)
    return digest.value()


_segments = SegmentAllocator(arena_bytes=0)
_arenas: dict[str, np.ndarray] = {}  # the arenas this process took from: mapped once, kept
_lock = threading.Lock()


def put(handoff: Handoff) -> ShmRef:
    """``handoff``'s ref, its data copied into a segment of its own (unlinked by its taker); a
    worker that hands off many blocks uses a :class:`SegmentAllocator` (an arena, no new pages)."""
    return _segments.put(handoff)


def _gone(ref: ShmRef) -> KVBlockError:
    return KVBlockError(
        f"the shared-memory segment {ref.name} of this KV hand-off is gone (taken already, or its prefill "
        "worker died and its segments were cleaned up): run the request again"
    )


def _arena(ref: ShmRef) -> np.ndarray:
    """``ref``'s arena, mapped at its first take (the mappings of arenas unlinked since, their
    workers gone, are dropped then)."""
    with _lock:
        arena = _arenas.get(ref.name)
        if arena is None:
            for name in [n for n in _arenas if not (SHM_DIR / n).exists()]:
                del _arenas[name]
            try:  # a cache's pages are mapped as they are read (populating would make the whole cache resident)
                pages = map_segment(ref.name, populate=ref.cache is None)
            except FileNotFoundError:
                raise _gone(ref) from None
            arena = _arenas[ref.name] = np.frombuffer(pages, dtype=np.uint8)
    end = ref.offset + (ref.nbytes if ref.cache is None else _cache_nbytes(ref))
    if not (ref.slot is not None and 0 <= ref.slot < ref.offset and end <= len(arena)):
        raise KVBlockError(
            f"this KV hand-off's bytes [{ref.offset}, {end}) are not inside segment {ref.name} "
            f"of {len(arena)} bytes: the ref is corrupted"
        )
    return arena


def _dtype(ref: ShmRef) -> np.dtype:
    name = ref.header["block"]["dtype"]
    return np.dtype(DTYPES.get(name, name))


def _cache_nbytes(ref: ShmRef) -> int:
    return int(np.prod(ref.cache, dtype=np.int64)) * _dtype(ref).itemsize


def _lent_view(ref: ShmRef) -> np.ndarray:
    """The read-only strided view ``[L, 2, H_kv, n, D]`` of the lent row ``ref`` points at."""
    shape, cache = list(ref.header["block"]["shape"]), ref.cache
    fits = len(cache) == 6 and len(shape) == 5 and 0 <= ref.row < cache[2] and ref.slot == 8 * ref.row
    if not (fits and shape[:3] == [cache[0], cache[1], cache[3]] and shape[4] == cache[5] and shape[3] <= cache[4]):
        raise KVBlockError(
            f"this KV hand-off's block {shape} is not positions [0, n) of row {ref.row} of a cache {cache} "
            "([layers, 2, rows, kv heads, positions, head dim]): the ref is corrupted"
        )
    arena = _arena(ref)
    buffer = arena[ref.offset : ref.offset + _cache_nbytes(ref)].view(_dtype(ref)).reshape(cache)
    view = buffer[:, :, ref.row, :, : shape[3]]
    view.flags.writeable = False
    return view


def _slot_state(ref: ShmRef) -> np.ndarray:
    """The state word of ``ref``'s arena slot; KVBlockError when the slot is no longer ``ref``'s."""
    state = _arena(ref)[ref.slot : ref.slot + 8].view(np.uint64)
    if int(state[0]) != ref.slot_id or ref.slot_id == FREE:
        raise KVBlockError(
            f"the {'arena slot' if ref.cache is None else 'lent cache row'} of this KV hand-off in {ref.name} "
            "was freed (taken already, or discarded): "
            "run the request again"
        )
    return state


def take(ref: ShmRef, fingerprint: dict[str, Any] | None = None, verify: bool = True) -> Handoff:
    """The hand-off of ``ref`` (taken once), its block's data a read-only view on shared memory:
    a segment of its own is unlinked at once (its memory stays until the view is dropped), an
    arena slot or a lent cache row (a strided view of the prefill worker's row; its segment is
    mapped once per process) is freed by ``handoff.release()``, which the scheduler calls once the
    block is imported. KVBlockError (the memory freed too) when the memory is gone or shorter than the ref
    says, when (with ``fingerprint``: the importing engine's ``kv_fingerprint``) it comes from
    another artifact, or (``verify``) when the data does not match its checksum. ``verify=False``
    (a decode worker's): the checksum is not computed here but goes with the hand-off
    (``handoff.checksum``), and the scheduler's import checks it as it copies the data, layer by
    layer (a mismatch fails the request with KVBlockError before the row holds anything); a
    caller that reads the data otherwise must verify here."""
    release = None
    if ref.slot is None:
        try:
            pages = map_segment(ref.name, writable=False)
        except FileNotFoundError:
            raise _gone(ref) from None
        finally:
            unlink(ref.name)
        if len(pages) < ref.nbytes:
            raise KVBlockError(
                f"the shared-memory segment {ref.name} holds {len(pages)} bytes, the hand-off needs {ref.nbytes}: "
                "it is truncated; run the request again"
            )
        raw = np.frombuffer(pages, dtype=np.uint8, count=ref.nbytes)
    else:  # an arena slot, or a lent cache row (a strided view)
        state = _slot_state(ref)
        if ref.cache is None:
            raw = _arena(ref)[ref.offset : ref.offset + ref.nbytes]
            raw.flags.writeable = False
        else:
            raw = _lent_view(ref)

        def release() -> None:
            if int(state[0]) == ref.slot_id:  # still this hand-off's
                state[0] = FREE

    try:
        b = ref.header["block"]
        dtype = np.dtype(DTYPES.get(b["dtype"], b["dtype"]))
        row_state = scales = None  # a hybrid's state tensors and 8-bit KV's scales, after the KV data
        if ref.cache is not None:
            data = raw
        else:
            kv = int(np.prod(b["shape"])) * dtype.itemsize
            scales_shape = b.get("scales_shape")
            after = kv + (0 if scales_shape is None else int(np.prod(scales_shape)) * 4)
            if after > raw.nbytes:
                raise KVBlockError(
                    f"this KV hand-off's {raw.nbytes} bytes cannot hold its KV data (and scales) of {after}: the ref "
                    "is corrupted"
                )
            data = raw[:kv].view(dtype).reshape(b["shape"])
            if scales_shape is not None:
                scales = raw[kv:after].view(np.float32).reshape(scales_shape)
            row_state = split_state(ref.header, raw[after:])
        handoff = Handoff.from_parts(ref.header, data, row_state, scales)  # reads no data
        if fingerprint is not None:
            handoff.block.check_compatible(fingerprint)
        algorithm = algorithm_of(ref.checksum)
        Digest(algorithm)  # an algorithm this process has (KVBlockError naming what to install)
        if not verify:
            handoff.checksum = ref.checksum  # checked by the import, as it copies
        elif checksum(raw, algorithm) != ref.checksum:
            raise KVBlockError(
                f"the KV hand-off in shared-memory segment {ref.name} does not match its {algorithm} checksum: "
                "the data was corrupted or overwritten; it is not imported (run the request again)"
            )
    except BaseException:
        if release is not None:
            release()
        raise
    handoff.on_release = release
    return handoff


def unlink(name: str) -> bool:
    """Unlink segment ``name`` (mapped views stay valid); False when it was gone already."""
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return True


def discard(ref: ShmRef) -> bool:
    """Free ``ref``'s memory without reading it (a request cancelled in transit): unlink its own
    segment, or mark its arena slot free; False when it was gone already."""
    if ref.slot is None:
        return unlink(ref.name)
    try:
        _slot_state(ref)[0] = FREE
    except KVBlockError:
        return False
    return True


def pending(ref: ShmRef) -> bool:
    """Whether ``ref``'s block is still there to take (not taken, discarded or cleaned up): e.g.
    to resume a sequence on another decode worker when the one it was sent to died."""
    if ref.slot is None:
        return (SHM_DIR / ref.name).exists()
    try:
        _slot_state(ref)
    except KVBlockError:
        return False
    return True


def segments(pid: int | None = None) -> list[str]:
    """Names of the kvforge segments that exist now, of process ``pid`` (None: every process's)."""
    prefix = PREFIX if pid is None else segment_prefix(pid)
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*"))


def unlink_segments(pid: int) -> list[str]:
    """Unlink every segment created by process ``pid`` (a worker that died: its hand-offs not yet
    taken); returns their names."""
    return [name for name in segments(pid) if unlink(name)]
