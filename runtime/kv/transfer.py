"""KV export and import of :class:`~kvforge.runtime.engine.StepEngine`: a cache row's positions as a
:class:`~kvforge.runtime.kv.KVBlock` and back (the prefix cache, saved sessions and the
disaggregated hand-off all move KV through these four calls).

``Engine`` inherits this class, as it inherits the generation facade; it is not used alone. What
it reads of the engine: the manifest, the cache (``read_positions``/``view_positions``/
``write_positions``, ``states``), the row lengths, the lock, ``max_batch``/``max_seq``/``vocab_size``,
the artifact's ``kv_fingerprint`` and the backend's name.

Layers that keep a state (a hybrid artifact). A block's KV holds the attention layers only, and a
block that ends at its row's length carries the row's state (valid at that position only; one
copy of each state tensor's row out, one back in). Importing a block that carries a state
writes it into the row's state buffers; a block without one leaves the row's state invalid, so
on a hybrid it is refused unless the caller imports the block that carries it next
(``state_follows=True``: the prefix pool's whole blocks before its snapshot) or it holds no
position (a saved session with nothing cached).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runtime import validate as check
from kvforge.runtime.kv.block import KVBlock, KVBlockError, state_specs
from kvforge.runtime.kv.digest import Digest, algorithm_of


class KVTransfer:
    """``Engine``'s KV block calls (see the module docstring)."""

    def kv_nbytes(self, positions: int) -> int:
        """Bytes of a :class:`KVBlock` of ``positions`` positions (``L × 2 × H_kv × n × D`` values,
        ``L`` the layers that attend; an 8-bit cache's block also holds ``L × 2 × H_kv × n`` float32
        scales) with, on a hybrid, the row's state it may carry."""
        m = self.manifest.model
        layers = len(self.manifest.layout.attention)
        kv = layers * 2 * m.num_kv_heads * int(positions) * m.head_dim * self.cache.buffer.dtype.itemsize
        if getattr(self.cache, "scales", None) is not None:
            kv += layers * 2 * m.num_kv_heads * int(positions) * 4
        return kv + self.manifest.layout.state_row_bytes()

    def _kv_shape(self, positions: int) -> tuple[int, ...]:
        m = self.manifest.model
        return (len(self.manifest.layout.attention), 2, m.num_kv_heads, int(positions), m.head_dim)

    def export_kv(
        self,
        row: int,
        token_ids: Sequence[int],
        start: int = 0,
        out=None,
        digest=None,
        view: bool = False,
        with_state: bool | None = None,
    ) -> KVBlock:
        """Cache row ``row``'s positions ``[start, start + n)`` as a :class:`KVBlock` (``n =
        len(token_ids)``, the tokens those positions hold, which the caller knows: the engine keeps
        lengths, not tokens). One strided copy into the block's own contiguous buffer, or into
        ``out``: a writable buffer of at least :meth:`kv_nbytes` ``(n)`` bytes (e.g. shared memory),
        which the block's data (then its state) is a view of. ``digest``: a
        :class:`~kvforge.runtime.kv.digest.Digest` fed the block's data as it is copied, layer by
        layer, then its state (its value is then the checksum of the block's bytes in that order).
        ``view``: no copy; the block's data is a read-only strided view of the row's positions
        (hashed in place when ``digest`` is given), valid while the row is not written (a lent row;
        KV only). ``with_state`` (a hybrid's): the block carries the row's state when it ends at the
        row's length (None, the default; True refuses a block that does not), never (False).
        ValueError when the row does not hold those positions."""
        ids = check.token_ids("token_ids", token_ids, vocab_size=self.vocab_size)
        if not hasattr(self.cache, "read_positions"):
            raise RuntimeError(f"the {self.backend.name} backend's cache has no KV export yet; use the CPU backend")
        states = getattr(self.cache, "states", {})
        if view and states:
            raise ValueError("export_kv(view=True) lends KV positions only; this artifact's rows also keep a state")
        scaled = getattr(self.cache, "scales", None) is not None
        if scaled and view:
            raise ValueError(
                "export_kv(view=True) lends a row's KV positions only, and this artifact's KV cache is 8-bit with "
                "per-row scales (--kv-dtype int8) that a view does not carry; export by copy (into out= for shared "
                "memory)"
            )
        nbytes = self.kv_nbytes(len(ids))
        if out is not None:
            if memoryview(out).nbytes < nbytes or memoryview(out).readonly:
                raise ValueError(f"out must be a writable buffer of at least {nbytes} bytes for {len(ids)} positions")
            out = np.frombuffer(out, dtype=np.uint8, count=nbytes)
        with self._lock:
            self._check_cache_row(row)
            held, stop = int(self.lengths[row]), start + len(ids)
            if start < 0 or stop > held:
                raise ValueError(
                    f"positions [{start}, {stop}) are not in cache row {row}, which holds [0, {held}): "
                    "export at most the positions a prefill or decode wrote"
                )
            carry = bool(states) and with_state is not False and stop == held
            if with_state and not carry:
                raise ValueError(
                    f"positions [{start}, {stop}) of cache row {row} cannot carry its state, which is valid at "
                    f"position {held} only" + ("" if states else " (this artifact keeps no state)")
                )
            # out's bytes: the KV data, 8-bit KV's scales, then the state (KVBlock.tail's order)
            kv_out = scales_out = None
            if out is not None:
                shape = self._kv_shape(len(ids))
                kv_bytes = int(np.prod(shape)) * self.cache.buffer.dtype.itemsize
                kv_out = out[:kv_bytes].view(self.cache.buffer.dtype).reshape(shape)
                if scaled:
                    scales_out = out[kv_bytes : kv_bytes + int(np.prod(shape[:4])) * 4].view(np.float32)
                    scales_out = scales_out.reshape(shape[:4])
            if view:
                data = self.cache.view_positions(row, start, stop)
                if digest is not None:
                    digest.update(data)  # in place, per head: one read pass
            else:
                each = None if digest is None else digest.update
                data = self.cache.read_positions(row, start, stop, out=kv_out, each=each)
            scales = self.cache.read_scales(row, start, stop, out=scales_out) if scaled else None
            if scales is not None and digest is not None:
                digest.update(scales)  # after the data, before the state: the order import_kv's checksum reads
            state = None
            if carry:
                state, at = {}, data.nbytes + (0 if scales is None else scales.nbytes)
                for name, buffer in states.items():
                    piece = buffer[row]
                    if out is None:
                        state[name] = piece.copy()
                    else:
                        state[name] = out[at : at + piece.nbytes].view(piece.dtype).reshape(piece.shape)
                        np.copyto(state[name], piece)
                        at += piece.nbytes
                    if digest is not None:
                        digest.update(state[name])
        return KVBlock(self.kv_fingerprint, int(start), tuple(ids), data, state=state, scales=scales)

    def check_kv(self, block: KVBlock, state_follows: bool = False) -> None:
        """Raise :class:`~kvforge.runtime.kv.KVBlockError` when ``block`` cannot be imported into
        this engine's cache: another artifact or dtype, a state of another layout, longer than a
        row, or (a hybrid's) a block of KV without the state of its end position, unless
        ``state_follows`` (see the module docstring)."""
        ours = self.manifest.kv_dtype
        if block.kv_dtype != ours or block.fingerprint.get("kv_dtype", "float") != ours:
            theirs = "8-bit (int8 with per-row scales)" if block.kv_dtype == "int8" else "float"
            raise KVBlockError(
                f"this KV block holds {theirs} KV, and this artifact's KV cache is "
                f"{'8-bit (--kv-dtype int8)' if ours == 'int8' else 'float (--kv-dtype float)'}: a block is "
                "imported only into an engine of the same compiled model and KV dtype; prefill the tokens instead"
            )
        block.check_compatible(self.kv_fingerprint)
        want = self._kv_shape(block.n)
        if block.data.shape != want or block.data.dtype != self.cache.buffer.dtype:
            raise KVBlockError(
                f"the KV block's data is {block.data.dtype} {block.data.shape}; this artifact's cache needs "
                f"{self.cache.buffer.dtype} {want} ([attention layers, 2, kv heads, positions, head dim])"
            )
        specs = state_specs(self.manifest)
        block.check_state(specs)
        if specs and block.state is None and not state_follows and block.stop > 0:
            raise KVBlockError(
                f"this KV block holds positions [{block.start}, {block.stop}) without the row's state at position "
                f"{block.stop}, and this artifact's layers {[e.layer for e in self.manifest.layout.states]} keep a "
                "state beside the KV cache: import a block exported at its row's length (it carries the state), "
                "or prefill the tokens"
            )
        if block.stop > self.max_seq:
            raise KVBlockError(
                f"the KV block holds positions [{block.start}, {block.stop}), longer than a cache row of this "
                f"artifact (max_seq={self.max_seq}); recompile with a larger --max-seq"
            )

    def import_kv(self, block: KVBlock, row: int, checksum: str | None = None, state_follows: bool = False) -> None:
        """Write ``block`` into cache row ``row`` at its positions ``[block.start, block.stop)``
        (one strided copy), its state (a hybrid's) into the row's state buffers, and make the row
        hold ``[0, block.stop)``. The caller owns the row (a session's, or its batch loop's) and its
        positions before ``block.start``. Raises :class:`~kvforge.runtime.kv.KVBlockError` before
        anything is written for a block of another artifact, dtype or state layout, one that does
        not fit the row, or one without the state a hybrid's row needs (:meth:`check_kv`).
        ``checksum`` (``"algorithm:hex"``, e.g. a hand-off's): the data is hashed layer by layer as it
        is copied, then the state before it is copied, and a mismatch raises KVBlockError with the
        row left as it was held (its length and state unchanged: nothing imported)."""
        self.check_kv(block, state_follows)
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
            if digest is not None:
                for value in (block.state or {}).values():  # hashed before it is copied: a mismatch writes none
                    digest.update(value)
                if digest.value() != checksum:
                    raise KVBlockError(
                        f"the KV block does not match its {digest.algorithm} checksum: the data was corrupted or "
                        "overwritten on its way; it is not imported (run the request again)"
                    )
            for name, value in (block.state or {}).items():
                np.copyto(self.cache.states[name][row], value)
            self.lengths[row] = block.stop

    def _check_cache_row(self, row: object) -> None:
        if not (check.is_int(row) and 0 <= row < self.max_batch):
            raise ValueError(f"row={row!r} is not a cache row: rows are 0..{self.max_batch - 1}")
