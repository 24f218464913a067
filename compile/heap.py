"""The garbage collector during compile: long-lived objects are frozen, so that the full
collections Python starts on its own do not walk them again and again.

The libraries' modules and, after the trace, torch's, sympy's and the exporter's caches are ~700k
long-lived objects. Each full (generation 2) collection walks all of them: on the SmolLM-135M shape
13 full collections took ~2.8 s of a 16 s compile (the two that Python started during the ORT
optimization 0.85 s). :func:`freeze_survivors` (``gc.freeze``) moves every object alive at that
point out of the collector's reach; objects made after it are collected as before.
:func:`unfreeze` gives them back (``gc.unfreeze``), so a frozen object that became garbage in the
meantime (the general graph, a cycle of small ONNX IR objects) is still freed later.

Compile freezes at its start (the libraries), after the transformers reference (the loaded model
too: the trace's collections skip it) and after the weights file holds every tensor; it unfreezes
before the torch model is dropped (a model in a reference cycle must be collectable, or it would
keep the checkpoint's memory map for the rest of compile) and at its end.

Compile's own full collections (:func:`collect`) run only where what it just dropped is large: each
walks every object alive, and a process that has run others' work holds many (a test worker:
37.6 s in 62 calls of 238.7 s for 30 family tests of tiny models, two collections a compile, three
where the reference loads a second model; the whole suite took 1091 s with them and 779 s
without), while a model of a few MiB left to Python's own collections costs nothing that matters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

_frozen_here = False
# Below this many bytes dropped, compile's explicit full collection is skipped (:func:`collect`).
COLLECT_BYTES = 64 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def map_large_allocations() -> None:
    """glibc: every allocation of :data:`MMAP_THRESHOLD` bytes or more gets pages of its own
    (mmap), returned to the system when freed. By default glibc raises that threshold up to 32 MiB
    as large blocks are freed, so the weight tensors compile reads and drops one at a time (a
    layer's projections, each under 32 MiB) come from the heap, whose freed space is not
    returned: on a 0.5B Llama the parity reference, which loads and drops each layer, grew RSS by
    ~1 GiB. Process-wide and permanent (a fixed threshold); nothing where the C library is not glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def trim() -> None:
    """glibc: return the heap's free pages to the system (``malloc_trim(0)``); nothing elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def freeze_survivors() -> None:
    """``gc.freeze()`` (again, adding what is alive now, when this module froze before), unless
    the caller froze objects of its own (its freeze is left alone and none is added)."""
    global _frozen_here
    if _frozen_here or gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen_here = True


def collect(dropped_bytes: int) -> bool:
    """A full collection (``gc.collect()``) when the caller has just dropped ``dropped_bytes`` of
    at least :data:`COLLECT_BYTES` (a model's weights): returned to the system before the next stage
    allocates, which bounds compile's peak memory. Smaller drops are left to Python's own
    collections. True if it collected."""
    if dropped_bytes < COLLECT_BYTES:
        return False
    gc.collect()
    return True


def unfreeze() -> None:
    """``gc.unfreeze()`` if :func:`freeze_survivors` froze; else nothing."""
    global _frozen_here
    if _frozen_here:
        gc.unfreeze()
        _frozen_here = False
