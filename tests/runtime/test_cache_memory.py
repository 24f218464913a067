"""Memory of the CPU engine: the KV cache's pages become resident as positions are written (a write
into one row leaves the other rows' pages out of memory, where numpy's huge pages would take 2 MiB
at the first byte), the buffer starts as zeros and is writable; ``Engine.load(mem_pattern=...)``
sets ONNX Runtime's memory pattern on the sessions (off by default)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from kvforge.runtime import Engine
from kvforge.runtime.cache import zeroed_pages


def resident_pages(array: np.ndarray) -> int:
    """Pages of ``array``'s memory (contiguous) that are in RAM (Linux ``mincore``)."""
    assert array.flags.c_contiguous
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = array.ctypes.data - array.ctypes.data % mmap.PAGESIZE
    pages = -(-(array.ctypes.data + array.nbytes - start) // mmap.PAGESIZE)
    status = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, status) == 0, ctypes.get_errno()
    return sum(s & 1 for s in status)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore residency is read on Linux")
def test_cache_pages_become_resident_as_positions_are_written():
    cache = zeroed_pages((2, 2, 4, 2, 1024, 64), np.float32)  # [L, 2, B, H, S, D]: 16 MiB, 2 MiB per row
    assert cache.flags.c_contiguous and cache.flags.writeable and cache.dtype == np.float32
    assert resident_pages(cache) == 0
    cache[:, :, 0, :, :16] = 1.0  # 16 positions of row 0 in every layer, key and value
    row_bytes = cache[0, 0, 0].nbytes
    assert all(resident_pages(layer[1:]) == 0 for layer in cache.reshape(-1, *cache.shape[2:]))  # other rows: none
    assert resident_pages(cache) <= 8 * (16 * 64 * 4 // mmap.PAGESIZE + 1) < 8 * row_bytes // mmap.PAGESIZE
    assert not cache[:, :, 1:].any() and cache[:, :, 0, :, :16].all()


def test_zero_sized_buffer():
    assert zeroed_pages((0, 3), np.float16).shape == (0, 3)


def test_mem_pattern_flag_sets_the_session_option(llama_artifact):
    for flag in (False, True):
        kwargs = {} if flag is False else {"mem_pattern": True}
        with Engine.load(llama_artifact, threads=1, **kwargs) as engine:
            session = engine.backend.session("prefill")
            assert session.get_session_options().enable_mem_pattern is flag
            assert engine.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids  # it runs
