"""A KV cache's buffer in POSIX shared memory, whose rows a prefill worker lends to a decode
worker's import: a disaggregated hand-off in one copy.

    engine = Engine.load(out, kv_shared=True)         # KVCache(shared=True): its buffer is a SharedCache's
    sched = engine.scheduler(lend_rows=True)          # a hand-off lends its row: no copy, hashed in place
    ref = engine.cache.segment.put(handle.result().handoff)   # an shm.ShmRef: the row, lending id, checksum
    handoff = shm.take(ref, fingerprint, verify=False)        # decode worker: the row's strided view

A :class:`SharedCache` is a cache's buffer after a header page of one state word per
row (0: the batch loop's; else the id of the lending), as an arena slot's. The lending scheduler
neither binds nor writes a lent row (its active rows stay a contiguous run of rows not lent) and
reads the state words before it admits anyone: the taker's release, or :func:`discard`, gives the
row back with no message. While every row is lent, new work waits. The taker maps the cache's
segment once (its pages as they are read, not populated: a cache is mostly unwritten) and keeps
it; a dead prefill worker's cache segment is unlinked like its arena, and a taker that mapped it
still reads the row.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
from collections.abc import Callable

import numpy as np

from kvforge.runtime.kv.digest import checksum
from kvforge.runtime.kv.handoff import Handoff
from kvforge.runtime.kv.shm import FREE, SHM_DIR, SLOT_HEADER, ShmRef, map_segment, put, segment_prefix, unlink


class SharedCache:
    """A KV cache's buffer ``[L, 2, B, H_kv, S, D]`` in a named segment of this process
    (``kvforge-<pid>-cache-<hex>``, zero-filled, ordinary pages, resident as they are written), after
    a header page of one state word per row: 0 while the row is its batch loop's, else the id of
    the row's lending. ``KVCache(manifest, shared=True)`` makes one (``Engine.load(...,
    kv_shared=True)``); a lending scheduler (``engine.scheduler(lend_rows=True)``) hands a request
    off by lending its row: the block's data is a read-only view of the row's positions ``[0, n)``,
    hashed in place, and the loop neither binds nor writes the row until its state word is 0
    again (set by the taker's ``release``, by :func:`discard`, or here by the hand-off's own
    ``release`` when it never left this process). :meth:`put` turns such a hand-off into a ref.
    Thread-safe (the scheduler's thread lends, a worker's thread puts)."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        dtype = np.dtype(dtype)
        self.rows = int(shape[2])
        self.offset = -(-8 * self.rows // SLOT_HEADER) * SLOT_HEADER  # the state words' pages, then the buffer
        count = int(np.prod(shape, dtype=np.int64))
        nbytes, stat = self.offset + count * dtype.itemsize, os.statvfs(SHM_DIR)
        if nbytes > stat.f_bavail * stat.f_frsize:  # a write past a full tmpfs is a SIGBUS, not an error
            raise OSError(
                f"the KV cache in shared memory needs {nbytes / 2**20:.0f} MiB, but {SHM_DIR} has "
                f"{stat.f_bavail * stat.f_frsize / 2**20:.0f} MiB free: enlarge it (e.g. docker run --shm-size), "
                "compile with a smaller --max-batch or --max-seq, or keep the cache private (kv_shared=False; "
                "kvforge serve --no-lend-rows)"
            )
        self.name = f"{segment_prefix()}cache-{secrets.token_hex(4)}"
        pages = map_segment(self.name, nbytes, create=True, populate=False)
        self.state = np.frombuffer(pages, dtype=np.uint64, count=self.rows)
        self.buffer = np.frombuffer(pages, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self._lock = threading.Lock()
        self._lent: dict[int, tuple[int, int]] = {}  # data address -> (row, lending id): lent, not put
        self._count = itertools.count(1)

    def lent(self, row: int) -> bool:
        """Whether ``row`` is lent (its taker has not freed it yet)."""
        return int(self.state[row]) != FREE

    def lend(self, row: int, data: np.ndarray) -> Callable[[], None]:
        """Mark ``row`` lent, ``data`` (a view of its positions ``[0, n)``) the block lent; returns
        the hook that frees it again while the block has not been :meth:`put` (the hand-off's
        ``on_release``: a hand-off taken in this process frees the row once it is imported)."""
        address = data.ctypes.data
        with self._lock:
            lending = next(self._count)
            self.state[row] = lending
            self._lent[address] = (row, lending)

        def release() -> None:
            with self._lock:
                if self._lent.get(address) == (row, lending):
                    del self._lent[address]
                if int(self.state[row]) == lending:
                    self.state[row] = FREE

        return release

    def put(self, handoff: Handoff) -> ShmRef:
        """The ref of ``handoff``, whose data is a row lent by this cache (no copy; its taker
        frees the row), else (a hand-off exported by copy) its data copied into a segment of its
        own (:func:`put`)."""
        data = handoff.block.data
        with self._lock:
            where = self._lent.pop(data.ctypes.data, None)
        if where is None or int(self.state[where[0]]) != where[1]:
            return put(handoff)
        row, lending = where
        handoff.on_release = None  # the row is the taker's to free now
        digest = handoff.checksum or checksum(data)  # the lending's, hashed in place by the scheduler
        shape = list(self.buffer.shape)
        return ShmRef(self.name, data.nbytes, digest, handoff.header(), self.offset, 8 * row, lending, shape, row)

    def close(self) -> None:
        """Unlink the segment (the buffer and views already mapped, here or by takers, stay valid)."""
        unlink(self.name)
