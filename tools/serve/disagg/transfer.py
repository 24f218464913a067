"""A hand-off's KV block in POSIX shared memory, between two worker processes of one machine.

    ref, nbytes = put(handoff, name)   # prefill worker: segment `name` holds the block's data
    handoff = take(ref)                # decode worker: a Handoff whose block is a view on it
    release(ref)                       # unlink the name (the mapping lives while views do)

``ref`` is small plain data (the segment's name, the hand-off's header, the data's crc32): it
travels over the control pipe; the KV never does. ``take`` checks the data against the crc32 and
raises KVBlockError for a segment that is missing, of the wrong size or corrupted; the decode
scheduler's import then checks the block's fingerprint (a foreign block: KVBlockError).

Segments are files of ``/dev/shm`` (Linux) created and mapped directly, outside
``multiprocessing``'s resource tracker: their life is the router's business (unlinked by the
decode worker after the take, or by the router for a sequence cancelled or a worker that died).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.runtime.kv.block import DTYPES, KVBlockError
from kvforge.runtime.kv.handoff import Handoff

SHM_DIR = Path("/dev/shm")


def put(handoff: Handoff, name: str) -> tuple[dict[str, Any], int]:
    """Write ``handoff``'s block data into a new segment ``name`` (one copy); returns its ref and
    the bytes of KV it holds."""
    data = np.ascontiguousarray(handoff.block.data)
    size = max(data.nbytes, 1)  # mmap refuses an empty mapping
    fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as segment:
            view = np.ndarray(data.shape, data.dtype, buffer=segment)
            view[...] = data
            crc = zlib.crc32(view)
            del view  # the mapping cannot close while a view exports it
    except BaseException:
        os.close(fd)
        release({"name": name})
        raise
    os.close(fd)
    return {"name": name, "header": handoff.header(), "crc32": crc, "nbytes": data.nbytes}, data.nbytes


def take(ref: dict[str, Any]) -> Handoff:
    """The hand-off of ``ref``, its block's data a read-only view on the segment (no copy); the
    mapping stays while the view lives. KVBlockError when the segment is gone, has another size
    than the header says, or its data fails the crc32 check."""
    name, header = ref["name"], ref["header"]
    shape, dtype = tuple(header["block"]["shape"]), np.dtype(DTYPES.get(header["block"]["dtype"], "float32"))
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
    except FileNotFoundError as e:
        raise KVBlockError(
            f"the KV block's shared-memory segment {name} is gone (its sender died or it was taken)"
        ) from e
    try:
        size = os.fstat(fd).st_size
        want = int(np.prod(shape)) * dtype.itemsize
        if size < max(want, 1):
            raise KVBlockError(f"the KV block's segment {name} holds {size} bytes; its header says {want}")
        segment = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    data = np.ndarray(shape, dtype, buffer=segment)
    if zlib.crc32(data) != ref["crc32"]:
        raise KVBlockError(
            f"the KV block in segment {name} fails its crc32 check: it was corrupted after the prefill worker "
            "wrote it; refusing to import it (the request fails; retry it)"
        )
    return Handoff.from_parts(header, data)


def release(ref: dict[str, Any]) -> None:
    """Unlink ``ref``'s segment (no error when it is already gone)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / ref["name"])


def exists(ref: dict[str, Any]) -> bool:
    return (SHM_DIR / ref["name"]).exists()


def segment_name(ref: dict[str, Any]) -> str:
    return ref["name"]
