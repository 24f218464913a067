"""GGUF files (llama.cpp's format) -> a Hugging Face model directory, and the file's quantized blocks.

Two jobs, both reading one ``.gguf`` file:

* :func:`convert` writes an ordinary HF directory (``config.json``, ``model.safetensors`` in
  float32, tokenizer files with the chat template, ``generation_config.json``) through
  transformers' own GGUF reader, which dequantizes every tensor with the ``gguf`` package. The
  compile pipeline then runs on that directory as on any other.
* :class:`GGUFBlocks` keeps the tensors whose blocks ONNX Runtime's ``MatMulNBits`` computes
  exactly (:data:`EXACT_TYPES`: Q4_0, Q8_0, Q4_1; 32 weights a block) and finds, for a weight
  matrix of a graph, the GGUF rows it was dequantized from. It matches rows by their values, not
  by names: transformers renames, permutes (q and k of a Llama) and ties tensors, and kvforge
  packs and transposes them, but each output row of a projection is still one GGUF row
  dequantized. A match is confirmed by dequantizing the blocks found and comparing every value.

Needs the ``gguf`` extra (``pip install "kvforge[gguf]"``: the ``gguf`` and ``accelerate`` packages).
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32  # weights per block of every exact type
# GGUF type -> (MatMulNBits bits, bytes per block)
EXACT_TYPES = {"Q4_0": (4, 18), "Q8_0": (8, 34), "Q4_1": (4, 20)}
EXTRA_HINT = 'GGUF files need the gguf extra: pip install "kvforge[gguf]" (the gguf and accelerate packages)'


class GGUFError(ValueError):
    """A GGUF file that cannot be read or converted; the message says what to do."""


def _import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise GGUFError(EXTRA_HINT) from e
    return gguf


def is_gguf(path: Path) -> bool:
    """True for a file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def convert(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write ``gguf_file`` as a Hugging Face directory ``out_dir`` (created; float32 weights, the
    tokenizer with its chat template); returns ``out_dir``. Raises :class:`GGUFError`."""
    import torch

    gguf_file, out = Path(gguf_file), Path(out_dir)
    _import_gguf()
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs it)
    except ImportError as e:
        raise GGUFError(EXTRA_HINT) from e
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_file.parent), gguf_file.name
    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except (ValueError, KeyError, NotImplementedError, OSError) as e:
            raise GGUFError(
                f"transformers cannot read {str(gguf_file)!r} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                "compile reads the GGUF architectures transformers' GGUF loader supports"
            ) from e
        # save_pretrained refuses a model that carries GGUF's quantization_config: the same
        # architecture built from the config without it takes the (already dequantized) tensors.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
        model.tie_weights()
        del gguf_model
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        generation = GenerationConfig.from_model_config(config)
        generation.save_pretrained(out)
    return out


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' GGUF loader draws progress bars; hidden for the conversion, then restored.
    The ``Loading weights`` bar obeys transformers' own switch; the ``Converting and de-quantizing
    GGUF tensors`` bar is a bare ``tqdm`` on ``sys.stderr``, so stderr is collected for the block
    and written back without the bars' lines (tqdm redraws with ``\r``; a warning has none)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    collected = io.StringIO()
    try:
        with contextlib.redirect_stderr(collected):
            yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
        kept = [line for line in collected.getvalue().split("\n") if line and "\r" not in line]
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")


@dataclass(frozen=True)
class BlockRows:
    """GGUF blocks of the rows of one weight matrix ``W [N, K]`` (``y = x @ W^T``), in W's row order."""

    qtype: str  # "Q4_0" | "Q8_0" | "Q4_1"
    blocks: np.ndarray  # [N, K/32, bytes per block] uint8, GGUF's own block bytes
    tensors: tuple[str, ...]  # the GGUF tensors the rows come from, in order of first use


class GGUFBlocks:
    """The exact-type tensors of a GGUF file, indexed by the values of their dequantized rows.

    The file is memory-mapped; the index holds one 64-bit fingerprint per row (SmolLM2-135M:
    ~200k rows). ``types`` gives every tensor's GGUF type, ``exact`` the names of the tensors
    :meth:`match` can return rows of."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.types: dict[str, str] = {}
        self._names: list[str] = []
        self._qtypes: list[str] = []
        self._blocks: list[np.ndarray] = []  # [N, K/32, bytes per block] views of the mapped file
        self._index: dict[tuple[int, int], tuple[int, int]] = {}  # (K, fingerprint) -> (tensor, row)
        data = np.memmap(self.path, np.uint8, mode="r")
        for name, qtype, shape, offset in read_tensor_infos(self.path):
            self.types[name] = qtype
            if qtype not in EXACT_TYPES or len(shape) != 2:
                continue
            k, n = shape  # GGUF lists dims innermost first
            size = n * (k // BLOCK) * EXACT_TYPES[qtype][1]
            blocks = data[offset : offset + size].reshape(n, k // BLOCK, EXACT_TYPES[qtype][1])
            which = len(self._names)
            self._names.append(name)
            self._qtypes.append(qtype)
            self._blocks.append(blocks)
            for row, fingerprint in enumerate(_fingerprints(dequantize(blocks, qtype)).tolist()):
                self._index.setdefault((k, fingerprint), (which, row))

    @property
    def exact(self) -> list[str]:
        return list(self._names)

    def match(self, weight: np.ndarray) -> BlockRows | None:
        """The GGUF blocks that dequantize to exactly ``weight`` ``[N, K]`` (float32), or None when
        some row is not a dequantized row of an exact-type tensor, or the rows mix GGUF types."""
        if weight.dtype != np.float32 or weight.ndim != 2 or weight.shape[1] % BLOCK:
            return None
        k = weight.shape[1]
        found = [self._index.get((k, fp)) for fp in _fingerprints(weight).tolist()]
        if any(f is None for f in found):
            return None
        qtypes = {self._qtypes[t] for t, _ in found}
        if len(qtypes) != 1:
            return None
        [qtype] = qtypes
        which = np.array([t for t, _ in found])
        rows = np.array([r for _, r in found])
        blocks = np.empty((len(found), k // BLOCK, EXACT_TYPES[qtype][1]), np.uint8)
        for t in np.unique(which):
            at = which == t
            blocks[at] = self._blocks[t][rows[at]]
        if not np.array_equal(dequantize(blocks, qtype), weight):
            return None  # a fingerprint collision: the values decide
        order = dict.fromkeys(self._names[t] for t in which.tolist())
        return BlockRows(qtype, blocks, tuple(order))


# GGUF metadata value types (the format's spec): fixed sizes; 8 is a string, 9 an array
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def read_tensor_infos(path: Path) -> list[tuple[str, str, tuple[int, ...], int]]:
    """``(name, GGUF type name, dims innermost first, absolute byte offset)`` of every tensor of a
    GGUF file (version 2 or 3, little-endian), from its header alone. ``gguf.GGUFReader`` builds
    numpy views of every metadata field (SmolLM2's 49k-token vocabulary: ~10 s); this reads only the
    lengths it must skip."""
    import mmap
    import struct

    gguf = _import_gguf()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise GGUFError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        version, tensors, kvs = struct.unpack_from("<IQQ", m, 4)
        if version not in (2, 3):
            raise GGUFError(f"{str(path)!r} is GGUF version {version}; kvforge reads versions 2 and 3")
        pos, alignment = 24, 32

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", m, at)
            return m[at + 8 : at + 8 + length].decode("utf-8", "replace"), at + 8 + length

        def skip(kind: int, at: int) -> int:
            if kind in _SCALARS:
                return at + _SCALARS[kind]
            if kind == _STRING:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == _ARRAY:
                item, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in _SCALARS:
                    return at + count * _SCALARS[item]
                for _ in range(count):
                    at = skip(item, at)
                return at
            raise GGUFError(f"{str(path)!r}: unknown GGUF metadata type {kind}; the file is corrupted")

        for _ in range(kvs):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            if key == "general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", m, pos + 4)
            pos = skip(kind, pos + 4)
        infos = []
        for _ in range(tensors):
            name, pos = string(pos)
            (dims,) = struct.unpack_from("<I", m, pos)
            shape = struct.unpack_from(f"<{dims}Q", m, pos + 4)
            kind, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            infos.append((name, gguf.GGMLQuantizationType(kind).name, tuple(shape), offset))
        start = pos + (-pos % alignment)
    return [(name, kind, shape, start + offset) for name, kind, shape, offset in infos]


_COEFFICIENTS = np.random.default_rng(20261201).integers(1, 2**63, size=1 << 16, dtype=np.uint64) | np.uint64(1)


def _fingerprints(rows: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """A 64-bit fingerprint of each float32 row's bytes ``[N]`` uint64 (a random linear hash of
    its 32-bit words, wrapping): equal rows give equal fingerprints; a match is confirmed by values."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    k = rows.shape[1]
    if k > len(_COEFFICIENTS):
        raise GGUFError(f"rows of {k} weights are longer than kvforge's GGUF index supports ({len(_COEFFICIENTS)})")
    words = rows.view(np.uint32)
    out = np.empty(rows.shape[0], np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, rows.shape[0], chunk):
            out[start : start + chunk] = (words[start : start + chunk].astype(np.uint64) * _COEFFICIENTS[:k]).sum(
                axis=1, dtype=np.uint64
            )
    return out


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """``[N, K/32, bytes per block]`` blocks of an exact type -> ``[N, K]`` float32: the ``gguf``
    package's formulas (``d·(q − 8)``, ``d·q``, ``d·q + m``, in float32, in its order of
    operations), over whole tensors at once; equal to ``gguf.quants.dequantize`` bit for bit
    (tests/compile/test_gguf.py), several times faster."""
    n, nb, _ = blocks.shape
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [N, nb, 1]
    if qtype == "Q8_0":
        return (blocks[..., 2:].view(np.int8).astype(np.float32) * d).reshape(n, nb * BLOCK)
    qs = blocks[..., 2:] if qtype == "Q4_0" else blocks[..., 4:]  # byte j: weights j (low), j + 16 (high)
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    if qtype == "Q4_0":
        return (d * (q.astype(np.int8) - np.int8(8)).astype(np.float32)).reshape(n, nb * BLOCK)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    return ((d * q.astype(np.float32)) + m).reshape(n, nb * BLOCK)
