"""``KVBlock``: cache positions ``[start, start + n)`` of one sequence as an object of its own.

    block = engine.export_kv(row, token_ids)          # positions [0, n) of cache row `row`
    block.save("turn3.kvb"); block = KVBlock.load("turn3.kvb")
    engine.import_kv(block, row)                      # refused for another artifact

Data. ``data`` is one C-contiguous array ``[L, 2, H_kv, n, D]`` in the artifact's dtype (every
layer's keys ``[l, 0]`` and values ``[l, 1]``), i.e. the cache's ``[L, 2, B, H_kv, S, D]`` with the
row picked and positions ``[start, start + n)`` kept: one strided copy from the cache, one back.
Keys are stored after RoPE, so a block is only valid at the positions it came from: ``start`` is
part of the block and import writes it there.

8-bit KV (``--kv-dtype int8``): ``data`` is int8 and ``scales`` ``[L, 2, H_kv, n]`` float32 holds
each position's scale per layer, key/value and head (None for a float cache); the fingerprint then
has ``kv_dtype`` "int8", and an engine refuses a block of the other KV dtype. Saved as format
version 2 (the scales follow the data); a float block is still version 1.

Header. ``fingerprint`` (:func:`fingerprint`: the source model's config and weights hashes, the
dtype, layers, KV heads, head size and attention lowering: what makes two artifacts' KV
interchangeable), ``start``, ``n``, the ``token_ids`` those positions hold, and ``meta`` (a small
JSON dict for the caller; a saved session keeps its not-yet-cached tokens there).

File (``save``/``load``)::

    b"KVFBLOCK"  u32 version (1; 2 with scales)  u64 header length  header (UTF-8 JSON)
    data (n·L·2·H_kv·D values)  [version 2: scales (n·L·2·H_kv float32)]
    sha256 of everything before it (32 bytes)

``load`` refuses a file whose magic, version, lengths or checksum are wrong (truncated or
corrupted) with :class:`KVBlockError`, before any of it is used.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.graphs.manifest import Manifest

MAGIC = b"KVFBLOCK"
VERSION = 1
SCALED_VERSION = 2  # a block with 8-bit KV's scales
_PREFIX = struct.Struct("<8sIQ")  # magic, version, header length
_DIGEST = 32  # sha256
DTYPES = {"float32": np.float32, "float16": np.float16}


class KVBlockError(ValueError):
    """A KV block that cannot be used here: another artifact, too long for the row, or a file that
    is truncated or corrupted."""


def fingerprint(manifest: Manifest) -> dict[str, Any]:
    """What two artifacts must share for one's KV to be valid in the other's cache: the source
    model (config and compiled weights hashes), dtype, cache dims and attention lowering."""
    m = manifest.model
    record = {
        "config_sha256": manifest.source.get("config_sha256"),
        "weights_sha256": manifest.weights.sha256,
        "dtype": manifest.dtype,
        "num_layers": m.num_layers,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "lowering": manifest.lowering,
    }
    if manifest.kv_dtype != "float":  # absent for a float cache: blocks saved before 8-bit KV still match
        record["kv_dtype"] = manifest.kv_dtype
    return record


@dataclass(frozen=True)
class KVBlock:
    """Positions ``[start, start + n)`` of one sequence's KV (see the module docstring). ``data``
    ``[L, 2, H_kv, n, D]`` is owned by the block (or a view of another block's, from :meth:`slice`);
    treat it as read-only."""

    fingerprint: dict[str, Any]
    start: int
    token_ids: tuple[int, ...]
    data: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    scales: np.ndarray | None = None  # 8-bit KV: [L, 2, H_kv, n] float32; None: a float cache's block

    def __post_init__(self) -> None:
        if self.data.ndim != 5 or self.data.shape[1] != 2 or self.data.shape[3] != len(self.token_ids):
            raise KVBlockError(
                f"KV data of shape {self.data.shape} does not hold {len(self.token_ids)} positions "
                "as [L, 2, H_kv, n, D]"
            )
        if self.scales is not None and self.scales.shape != self.data.shape[:4]:
            raise KVBlockError(
                f"KV scales of shape {self.scales.shape} do not match the data's {self.data.shape[:4]} "
                "([L, 2, H_kv, n])"
            )

    @property
    def kv_dtype(self) -> str:
        """ "int8" for a block of an 8-bit KV cache (it has scales), else "float"."""
        return "float" if self.scales is None else "int8"

    @property
    def n(self) -> int:
        """Positions held."""
        return len(self.token_ids)

    @property
    def stop(self) -> int:
        return self.start + self.n

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def slice(self, start: int, stop: int) -> KVBlock:
        """Positions ``[start, stop)`` (absolute positions inside this block) as a block whose data
        is a view of this one's (no copy)."""
        if not self.start <= start < stop <= self.stop:
            raise ValueError(f"positions [{start}, {stop}) are not inside this block's [{self.start}, {self.stop})")
        a, b = start - self.start, stop - self.start
        scales = None if self.scales is None else self.scales[:, :, :, a:b]
        return KVBlock(self.fingerprint, start, self.token_ids[a:b], self.data[:, :, :, a:b], dict(self.meta), scales)

    def check_compatible(self, expected: Mapping[str, Any]) -> None:
        """Refuse (KVBlockError) a block whose fingerprint differs from ``expected`` (the engine's),
        naming each field that differs."""
        diff = [
            f"{k}: block {self.fingerprint.get(k)!r}, engine {expected.get(k)!r}"
            for k in expected
            if self.fingerprint.get(k) != expected.get(k)
        ]
        if diff:
            raise KVBlockError(
                "this KV block comes from another artifact and cannot be imported ("
                + "; ".join(diff)
                + "): use a block exported by an engine of the same compiled model, or prefill the tokens instead"
            )

    # ------------------------------------------------------------------ file round trip

    def save(self, path: str | Path) -> Path:
        """Write the block to ``path`` (format in the module docstring); returns the path."""
        header = {
            "fingerprint": self.fingerprint,
            "start": self.start,
            "n": self.n,
            "shape": list(self.data.shape),
            "dtype": self.data.dtype.name,
            "token_ids": [int(t) for t in self.token_ids],
            "meta": self.meta,
        }
        parts = [memoryview(np.ascontiguousarray(self.data)).cast("B")]
        version = VERSION
        if self.scales is not None:
            header["scales"] = {"shape": list(self.scales.shape), "dtype": "float32"}
            parts.append(memoryview(np.ascontiguousarray(self.scales, dtype=np.float32)).cast("B"))
            version = SCALED_VERSION
        head = json.dumps(header, separators=(",", ":")).encode()
        digest = hashlib.sha256()
        path = Path(path)
        with path.open("wb") as f:
            for part in (_PREFIX.pack(MAGIC, version, len(head)), head, *parts):
                digest.update(part)
                f.write(part)
            f.write(digest.digest())
        return path

    @classmethod
    def load(cls, path: str | Path) -> KVBlock:
        """Read a block written by :meth:`save`. KVBlockError when the file is not a KV block,
        is truncated or corrupted (checksum), before any of it is used."""
        path = Path(path)
        raw = bytearray(path.stat().st_size)  # read in place: the block's data is a view of it
        with path.open("rb") as f:
            f.readinto(raw)
        where = f"{path} is not a usable KV block file"
        if len(raw) < _PREFIX.size + _DIGEST or raw[:8] != MAGIC:
            raise KVBlockError(f"{where}: it does not start with {MAGIC!r} (not written by KVBlock.save, or truncated)")
        _, version, head_len = _PREFIX.unpack_from(raw)
        if version not in (VERSION, SCALED_VERSION):
            raise KVBlockError(
                f"{where}: format version {version}; this kvforge reads versions {VERSION} and {SCALED_VERSION}"
            )
        body = len(raw) - _DIGEST
        if _PREFIX.size + head_len > body:
            raise KVBlockError(f"{where}: it is truncated ({len(raw)} bytes, the header alone says more)")
        if hashlib.sha256(memoryview(raw)[:body]).digest() != raw[body:]:
            raise KVBlockError(
                f"{where}: its sha256 does not match (the file is truncated or corrupted); save the block again"
            )
        header = json.loads(bytes(raw[_PREFIX.size : _PREFIX.size + head_len]))
        dtype = np.dtype(DTYPES.get(header["dtype"], header["dtype"]))
        shape = tuple(header["shape"])
        payload = memoryview(raw)[_PREFIX.size + head_len : body]
        data_bytes = int(np.prod(shape)) * dtype.itemsize
        scale_shape = tuple(header["scales"]["shape"]) if "scales" in header else None
        scale_bytes = 0 if scale_shape is None else int(np.prod(scale_shape)) * 4
        if len(payload) != data_bytes + scale_bytes:
            raise KVBlockError(f"{where}: {len(payload)} bytes of KV data, the header's shape {shape} needs more")
        data = np.frombuffer(payload[:data_bytes], dtype=dtype).reshape(shape)
        scales = None
        if scale_shape is not None:
            scales = np.frombuffer(payload[data_bytes:], dtype=np.float32).reshape(scale_shape)
        token_ids = tuple(header["token_ids"])
        return cls(header["fingerprint"], int(header["start"]), token_ids, data, header["meta"], scales)


def token_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in token_ids)
