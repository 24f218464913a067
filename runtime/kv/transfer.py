"""KV export and import of :class:`~kvforge.runtime.engine.StepEngine`: a cache row's positions as a
:class:`~kvforge.runtime.kv.KVBlock` and back (the prefix cache, saved sessions and the
disaggregated hand-off all move KV through these four calls).

``Engine`` inherits this class, as it inherits the generation facade; it is not used alone. What
it reads of the engine: the manifest, the cache (``read_positions``/``view_positions``/
``write_positions``), the row lengths, the lock, ``max_batch``/``max_seq``/``vocab_size``, the
artifact's ``kv_fingerprint`` and the backend's name.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runtime import validate as check
from kvforge.runtime.kv.block import KVBlock, KVBlockError
from kvforge.runtime.kv.digest import Digest, algorithm_of


class KVTransfer:
    """``Engine``'s KV block calls (see the module docstring)."""

    def kv_nbytes(self, positions: int) -> int:
        """Bytes of a :class:`KVBlock` of ``positions`` positions (``L × 2 × H_kv × n × D`` values; an
        8-bit cache's block also holds ``L × 2 × H_kv × n`` float32 scales)."""
        m = self.manifest.model
        values = m.num_layers * 2 * m.num_kv_heads * int(positions) * m.head_dim * self.cache.buffer.dtype.itemsize
        if getattr(self.cache, "scales", None) is not None:
            values += m.num_layers * 2 * m.num_kv_heads * int(positions) * 4
        return values

    def export_kv(
        self, row: int, token_ids: Sequence[int], start: int = 0, out=None, digest=None, view: bool = False
    ) -> KVBlock:
        """Cache row ``row``'s positions ``[start, start + n)`` as a :class:`KVBlock` (``n =
        len(token_ids)``, the tokens those positions hold, which the caller knows: the engine keeps
        lengths, not tokens). One strided copy into the block's own contiguous buffer, or into
        ``out``: a writable buffer of at least :meth:`kv_nbytes` ``(n)`` bytes (e.g. shared memory),
        which the block's data is then a view of. ``digest``: a :class:`~kvforge.runtime.kv.digest.Digest`
        fed the block's data as it is copied, layer by layer (its value is then the data's
        checksum). ``view``: no copy; the block's data is a read-only strided view of the row's
        positions (hashed in place when ``digest`` is given), valid while the row is not written
        (a lent row). ValueError when the row does not hold those positions."""
        ids = check.token_ids("token_ids", token_ids, vocab_size=self.vocab_size)
        self._refuse_state("export_kv")
        if not hasattr(self.cache, "read_positions"):
            raise RuntimeError(f"the {self.backend.name} backend's cache has no KV export yet; use the CPU backend")
        scaled = getattr(self.cache, "scales", None) is not None
        if scaled and (out is not None or view):
            raise ValueError(
                "export_kv: this artifact's KV cache is 8-bit with per-row scales (--kv-dtype int8), and an export "
                "into caller memory (out=) or as a view of the row (view=True: shared-memory hand-offs, lent rows) "
                "does not carry the scales yet; export by copy (neither), or recompile with --kv-dtype float"
            )
        if out is not None:
            m, nbytes = self.manifest.model, self.kv_nbytes(len(ids))
            if memoryview(out).nbytes < nbytes or memoryview(out).readonly:
                raise ValueError(f"out must be a writable buffer of at least {nbytes} bytes for {len(ids)} positions")
            shape = (m.num_layers, 2, m.num_kv_heads, len(ids), m.head_dim)
            out = np.frombuffer(out, dtype=self.cache.buffer.dtype, count=nbytes // self.cache.buffer.dtype.itemsize)
            out = out.reshape(shape)
        with self._lock:
            self._check_cache_row(row)
            held = int(self.lengths[row])
            if start < 0 or start + len(ids) > held:
                raise ValueError(
                    f"positions [{start}, {start + len(ids)}) are not in cache row {row}, which holds [0, {held}): "
                    "export at most the positions a prefill or decode wrote"
                )
            if view:
                data = self.cache.view_positions(row, start, start + len(ids))
                if digest is not None:
                    digest.update(data)  # in place, per head: one read pass
            else:
                each = None if digest is None else digest.update
                data = self.cache.read_positions(row, start, start + len(ids), out=out, each=each)
            scales = self.cache.read_scales(row, start, start + len(ids)) if scaled else None
            if scales is not None and digest is not None:
                digest.update(scales)  # after the data: what import_kv's checksum reads in the same order
        return KVBlock(self.kv_fingerprint, int(start), tuple(ids), data, scales=scales)

    def check_kv(self, block: KVBlock) -> None:
        """Raise :class:`~kvforge.runtime.kv.KVBlockError` when ``block`` cannot be imported into
        this engine's cache: another artifact or dtype, or longer than a row."""
        self._refuse_state("import_kv")
        ours = self.manifest.kv_dtype
        if block.kv_dtype != ours or block.fingerprint.get("kv_dtype", "float") != ours:
            theirs = "8-bit (int8 with per-row scales)" if block.kv_dtype == "int8" else "float"
            raise KVBlockError(
                f"this KV block holds {theirs} KV, and this artifact's KV cache is "
                f"{'8-bit (--kv-dtype int8)' if ours == 'int8' else 'float (--kv-dtype float)'}: a block is "
                "imported only into an engine of the same compiled model and KV dtype; prefill the tokens instead"
            )
        block.check_compatible(self.kv_fingerprint)
        m = self.manifest.model
        want = (m.num_layers, 2, m.num_kv_heads, block.n, m.head_dim)
        if block.data.shape != want or block.data.dtype != self.cache.buffer.dtype:
            raise KVBlockError(
                f"the KV block's data is {block.data.dtype} {block.data.shape}; this artifact's cache needs "
                f"{self.cache.buffer.dtype} {want} ([layers, 2, kv heads, positions, head dim])"
            )
        if block.stop > self.max_seq:
            raise KVBlockError(
                f"the KV block holds positions [{block.start}, {block.stop}), longer than a cache row of this "
                f"artifact (max_seq={self.max_seq}); recompile with a larger --max-seq"
            )

    def import_kv(self, block: KVBlock, row: int, checksum: str | None = None) -> None:
        """Write ``block`` into cache row ``row`` at its positions ``[block.start, block.stop)``
        (one strided copy) and make the row hold ``[0, block.stop)``. The caller owns the row (a
        session's, or its batch loop's) and its positions before ``block.start``. Raises
        :class:`~kvforge.runtime.kv.KVBlockError` for a block of another artifact or dtype, or one
        that does not fit the row (:meth:`check_kv`). ``checksum`` (``"algorithm:hex"``, e.g. a
        hand-off's): the data is hashed layer by layer as it is copied, and a mismatch raises
        KVBlockError with the row left as it was held (its length unchanged: nothing imported)."""
        self.check_kv(block)
        digest = None if checksum is None else Digest(algorithm_of(checksum))
        if not hasattr(self.cache, "write_positions"):
            raise RuntimeError(f"the {self.backend.name} backend's cache has no KV import yet; use the CPU backend")
        with self._lock:
            self._check_cache_row(row)
            if block.start > self.lengths[row]:
                raise ValueError(
                    f"the KV block starts at position {block.start}, but cache row {row} holds only "
                    f"[0, {int(self.lengths[row])}): import the blocks before it first"
                )
            self.cache.write_positions(row, block.start, block.data, each=None if digest is None else digest.update)
            if block.scales is not None:
                self.cache.write_scales(row, block.start, block.scales)
                if digest is not None:
                    digest.update(block.scales)
            if digest is not None and digest.value() != checksum:
                raise KVBlockError(
                    f"the KV block does not match its {digest.algorithm} checksum: the data was corrupted or "
                    "overwritten on its way; it is not imported (run the request again)"
                )
            self.lengths[row] = block.stop

    def _refuse_state(self, call: str) -> None:
        """A KV block carries KV positions only: refused (ValueError, before anything is read or
        written) for an artifact whose layers also keep a state, valid at one position."""
        layout = self.manifest.layout
        if layout.has_state:
            raise ValueError(
                f"{call}: this artifact's layers {[e.layer for e in layout.states]} keep a "
                f"{'/'.join(sorted({e.kind for e in layout.states}))} state beside the KV cache, and KV blocks "
                "(the prefix cache, saved sessions, the disaggregated hand-off) do not carry states yet; "
                "run such a model without them"
            )

    def _check_cache_row(self, row: object) -> None:
        if not (check.is_int(row) and 0 <= row < self.max_batch):
            raise ValueError(f"row={row!r} is not a cache row: rows are 0..{self.max_batch - 1}")
