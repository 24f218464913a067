"""``KVBlock``: cache positions ``[start, start + n)`` of one sequence as an object of its own.

    block = engine.export_kv(row, token_ids)          # positions [0, n) of cache row `row`
    block.save("turn3.kvb"); block = KVBlock.load("turn3.kvb")
    engine.import_kv(block, row)                      # refused for another artifact

Data. ``data`` is one C-contiguous array ``[L, 2, H_kv, n, D]`` in the artifact's dtype (every
layer's keys ``[l, 0]`` and values ``[l, 1]``), i.e. the cache's ``[L, 2, B, H_kv, S, D]`` with the
row picked and positions ``[start, start + n)`` kept: one strided copy from the cache, one back.
Keys are stored after RoPE, so a block is only valid at the positions it came from: ``start`` is
part of the block and import writes it there.

Layers that keep a state (a hybrid artifact, manifest schema 3). ``L`` is then the layers that
attend (``manifest.layout.attention``), and a block may carry ``state``: the row's state tensors
at the block's end position ``stop`` (by past-input name, ``past_state.{l}.{part}``, each the
row's ``[*shape]`` in its own dtype), since a state is valid at exactly one position. A block
without ``state`` restores KV only: on a hybrid it can only be followed by one that carries the
state at the row's end (the prefix pool's chain of whole blocks, then a snapshot).

8-bit KV (``--kv-dtype int8``): ``data`` is int8 and ``scales`` ``[L, 2, H_kv, n]`` float32 holds
each position's scale per layer, key/value and head (None for a float cache); the fingerprint then
has ``kv_dtype`` "int8", and an engine refuses a block of the other KV dtype. Saved as format
version 2 (the scales follow the data); a float block without state is still version 1.

Header. ``fingerprint`` (:func:`fingerprint`: the source model's config and weights hashes, the
dtype, layers, KV heads, head size and attention lowering, and on a hybrid its layout: which
layers attend and each state tensor's layer, kind, shape and dtype: what makes two artifacts'
KV and state interchangeable), ``start``, ``n``, the ``token_ids`` those positions hold, and
``meta`` (a small JSON dict for the caller; a saved session keeps its not-yet-cached tokens
there); version 2 adds ``state``: each state tensor's name, shape and dtype, in data order.

File (``save``/``load``)::

    b"KVFBLOCK"  u32 version  u64 header length  header (UTF-8 JSON)  data (n·L·2·H_kv·D values)
    [version 2: 8-bit KV's scales (n·L·2·H_kv float32), then each state tensor's values, in the
    header's order]
    sha256 of everything before it (32 bytes)

A block without state is written as version 1 (readable by a kvforge without state support),
one with state as version 2; ``load`` reads both. It refuses a file whose magic, version,
lengths or checksum are wrong (truncated or corrupted: the checksum covers the state too) with
:class:`KVBlockError`, before any of it is used.
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

from kvforge.graphs.contract import past_state_name
from kvforge.graphs.manifest import Manifest

MAGIC = b"KVFBLOCK"
VERSION = 2  # 2: a block may carry 8-bit KV's scales or its row's state; a block with neither is written as 1
VERSIONS = (1, 2)
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
    found = {
        "config_sha256": manifest.source.get("config_sha256"),
        "weights_sha256": manifest.weights.sha256,
        "dtype": manifest.dtype,
        "num_layers": m.num_layers,
        "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "lowering": manifest.lowering,
    }
    layout = manifest.layout
    if layout.has_state:  # a hybrid: which layers' KV a block holds, and the state it carries
        found["attention_layers"] = list(layout.attention)
        found["state"] = [entry.to_dict() for entry in layout.states]
    if manifest.kv_dtype != "float":  # absent for a float cache: blocks saved before 8-bit KV still match
        found["kv_dtype"] = manifest.kv_dtype
    return found


def state_specs(manifest: Manifest) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each state tensor of one row, by past-input name: its shape and dtype (empty for an
    artifact whose every layer attends); the order of a block's state."""
    return {
        past_state_name(entry.layer, t.part): (tuple(t.shape), np.dtype(DTYPES[t.dtype]))
        for entry, t in manifest.layout.state_tensors()
    }


@dataclass(frozen=True)
class KVBlock:
    """Positions ``[start, start + n)`` of one sequence's KV (see the module docstring). ``data``
    ``[L, 2, H_kv, n, D]`` is owned by the block (or a view of another block's, from :meth:`slice`);
    treat it as read-only. ``state`` (a hybrid's): the row's state tensors at position ``stop``,
    by past-input name, each ``[*shape]``; None: KV only."""

    fingerprint: dict[str, Any]
    start: int
    token_ids: tuple[int, ...]
    data: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    state: dict[str, np.ndarray] | None = None
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
        """Bytes of KV data, scales and state."""
        return self.data.nbytes + self.state_nbytes + (0 if self.scales is None else self.scales.nbytes)

    def tail(self) -> list[np.ndarray]:
        """What follows the KV data in the block's bytes, in order (the file's, a hand-off's memory
        and its checksum): 8-bit KV's scales, then each state tensor."""
        return ([] if self.scales is None else [self.scales]) + list((self.state or {}).values())

    @property
    def state_nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values()) if self.state else 0

    def slice(self, start: int, stop: int) -> KVBlock:
        """Positions ``[start, stop)`` (absolute positions inside this block) as a block whose data
        is a view of this one's (no copy); it keeps the state only when it ends where this one does
        (a state is valid at one position)."""
        if not self.start <= start < stop <= self.stop:
            raise ValueError(f"positions [{start}, {stop}) are not inside this block's [{self.start}, {self.stop})")
        a, b = start - self.start, stop - self.start
        state = self.state if stop == self.stop else None
        scales = None if self.scales is None else self.scales[:, :, :, a:b]
        return KVBlock(
            self.fingerprint, start, self.token_ids[a:b], self.data[:, :, :, a:b], dict(self.meta), state, scales
        )

    def check_state(self, expected: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        """Refuse (KVBlockError) a block whose state tensors are not ``expected`` (the engine's
        :func:`state_specs`): other names, shapes or dtypes, or a state where the artifact keeps none."""
        if self.state is None:
            return
        got = {name: (tuple(a.shape), a.dtype) for name, a in self.state.items()}
        if got != dict(expected):
            want = {name: (list(shape), dtype.name) for name, (shape, dtype) in expected.items()}
            have = {name: (list(shape), dtype.name) for name, (shape, dtype) in got.items()}
            raise KVBlockError(
                f"this KV block carries the state of another layout ({have or 'none'}); this artifact's rows keep "
                f"{want or 'no state'}: use a block exported by an engine of the same compiled model"
            )

    def check_compatible(self, expected: Mapping[str, Any]) -> None:
        """Refuse (KVBlockError) a block whose fingerprint differs from ``expected`` (the engine's),
        naming each field that differs."""
        diff = [
            f"{k}: block {self.fingerprint.get(k)!r}, engine {expected.get(k)!r}"
            for k in expected
            if self.fingerprint.get(k) != expected.get(k)
        ]
        diff += [f"{k}: block {self.fingerprint[k]!r}, engine none" for k in self.fingerprint if k not in expected]
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
        if self.scales is not None:
            header["scales"] = {"shape": list(self.scales.shape), "dtype": "float32"}
            parts.append(memoryview(np.ascontiguousarray(self.scales, dtype=np.float32)).cast("B"))
        if self.state is not None:
            header["state"] = [
                {"name": k, "shape": list(a.shape), "dtype": a.dtype.name} for k, a in self.state.items()
            ]
            parts += [memoryview(np.ascontiguousarray(a)).cast("B") for a in self.state.values()]
        version = VERSION if self.state is not None or self.scales is not None else 1
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
        if version not in VERSIONS:
            raise KVBlockError(f"{where}: format version {version}; this kvforge reads versions {VERSIONS}")
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
        specs = [(s["name"], tuple(s["shape"]), np.dtype(DTYPES[s["dtype"]])) for s in header.get("state", [])]
        kv_bytes = int(np.prod(shape)) * dtype.itemsize
        scale_shape = tuple(header["scales"]["shape"]) if "scales" in header else None
        scale_bytes = 0 if scale_shape is None else int(np.prod(scale_shape)) * 4
        sizes = [int(np.prod(s)) * d.itemsize for _, s, d in specs]
        if len(payload) != kv_bytes + scale_bytes + sum(sizes):
            raise KVBlockError(
                f"{where}: {len(payload)} bytes of KV data, scales and state, the header's shapes need "
                f"{kv_bytes + scale_bytes + sum(sizes)}"
            )
        data = np.frombuffer(payload[:kv_bytes], dtype=dtype).reshape(shape)
        at = kv_bytes
        scales = None
        if scale_shape is not None:
            scales = np.frombuffer(payload[at : at + scale_bytes], dtype=np.float32).reshape(scale_shape)
            at += scale_bytes
        state = None
        if "state" in header:
            state = {}
            for (name, s, d), size in zip(specs, sizes):
                state[name] = np.frombuffer(payload[at : at + size], dtype=d).reshape(s)
                at += size
        token_ids = tuple(header["token_ids"])
        return cls(header["fingerprint"], int(header["start"]), token_ids, data, header["meta"], state, scales)


def token_tuple(token_ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(t) for t in token_ids)
