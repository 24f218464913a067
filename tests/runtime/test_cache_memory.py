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


_DENORMALS_CHILD = r"""
import sys
import numpy as np
from kvforge.runtime import Engine
tiny = np.array([1e-39], np.float32)  # a denormal float32
kwargs = {} if sys.argv[2] == "default" else {"flush_denormals": False}
with Engine.load(sys.argv[1], threads=1, **kwargs) as engine:
    options = engine.backend.session("prefill").get_session_options()
    try:
        entry = options.get_session_config_entry("session.set_denormal_as_zero")
    except RuntimeError:  # ORT: no such entry
        entry = None
    tokens = engine.generate([[1, 2, 3]], max_new_tokens=3)[0].token_ids
    print(entry, float((tiny * np.float32(1.0))[0]), len(tokens))
"""


@pytest.mark.parametrize("mode, entry, product", [("default", "1", 0.0), ("off", None, 1e-39)])
def test_flush_denormals(llama_artifact, mode, entry, product):
    """``flush_denormals`` (on by default) sets ORT's ``session.set_denormal_as_zero``, whose FTZ/DAZ
    flags also stay on the loading thread: there numpy's float32 1e-39 * 1 is then 0. Each mode
    runs in a process of its own (the flag outlives the engine in its thread)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _DENORMALS_CHILD, str(llama_artifact), mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got_entry, got_product, tokens = done.stdout.split()
    assert got_entry == str(entry)
    assert float(got_product) == pytest.approx(product, rel=1e-3, abs=0)
    assert int(tokens) == 3
