"""In-flight batching on a range of cache rows: admit, prefill in chunks, decode, retire, compact.

:class:`BatchLoop` drives :class:`~kvforge.runtime.generation.Generation` requests through an
engine's step API on cache rows ``[first, first + rows)``. ``Engine.generate`` and ``stream`` run
it to completion on the caller's thread, a :class:`~kvforge.runtime.scheduler.Scheduler` runs it
step by step on its own thread, and a session runs it on its one row.

One :meth:`BatchLoop.step`:

1. retire cancelled requests (queued ones leave the queue; a running one frees its row);
2. at most ONE prefill call of at most ``chunk`` tokens (``rows × padded length``): either the
   next chunk of the prompt being filled, or the queued prompts that fit whole, together, into
   the free rows and the chunk (one ragged prefill); a longer prompt starts filling, chunk by chunk
   over the following steps. So a joining request delays the running rows by one chunk per step,
   never by its whole prompt;
3. one decode step over the decoding rows, then each row picks its token (a batched argmax for the
   plain-greedy rows, the request's own sampler for the others) and emits its chunk; with
   speculative decoding, rows that draft are verified in that same one call, several tokens each
   (:mod:`kvforge.runtime.speculative.verify`);
4. finished rows are retired at once and the rows compacted (below).

Prefix cache (``engine.prefix_pool``, :mod:`kvforge.runtime.kv.prefix_pool`; None: off). A request
that starts from an empty row looks up the longest cached prefix of its prompt when it is
admitted; the blocks found are imported into its row (``Engine.import_kv``, one copy each) and only
the rest of the prompt, at least its last token, is prefilled (with states, a snapshot at the whole
prompt's end that kept its last position's logits leaves nothing to prefill: the first token is
sampled from them). Such a request is prefilled alone (the ``filling`` path, ``start > 0``: ORT's
GroupQueryAttention continues one row at a time), a request without a hit joins the ragged group
as before. With states, a request's ``cache_points`` (the end of a chat's system prompt) past its
cached prefix make it prefill alone too, in pieces that stop at them, each leaving a snapshot that
later prompts sharing that much resume from. When a request finishes, the positions its
row holds (prompt and generated tokens fed back, not the last sampled one) are offered to the
pool before the row is reused or overwritten by compaction. On an artifact whose layers keep a
state (``pool.needs_state``), a prefix resumes only where a state snapshot ends: each offer keeps
one at the row's length (the block after the last whole block, carrying the row's state), and a
row also offers its prompt right after its prefill, before decoding moves the state on (the
snapshot at the end of the prompt), and a prompt prefilled in chunks each chunk's part (a long
document asked several questions); the import writes the snapshot's state into the row.

Compaction. The decoding requests always sit in the contiguous rows ``[first, first + n)`` (request
``i`` in row ``first + i``), the one being filled right after them. A decode step runs on exactly
those ``n`` rows, so a finished request stops costing decode work at the next step. When a row in
the middle finishes, the request in the highest decoding row moves into it: its filled cache
positions are copied once (``Engine.move_row``, ``len × L × 2 × H_kv × D`` values, less than one
decode step reads) and its decode continues there. The alternative, decoding a fixed range with
holes, would run the graphs on dead rows for the rest of the batch; binding a non-contiguous set of
rows is not possible (a graph takes one contiguous ``[B, H_kv, S_max, D]`` view per layer). The
decode binding of each ``(first, n)`` is made once and reused.

Disaggregated prefill/decode (:mod:`kvforge.runtime.kv.handoff`). A request with ``hand_off`` set
leaves its row right after its first token, unless that token ends it: the KV of its prompt
(positions ``[0, len(prompt))``) is exported first, into memory from ``block_alloc(nbytes)`` when
given (e.g. a shared-memory segment), and the request finishes with a :class:`Handoff` carrying
the data's checksum (hashed layer by layer during that copy, :mod:`kvforge.runtime.kv.digest`).
With a ``lender`` (the engine's shared cache, :class:`kvforge.runtime.kv.lend.SharedCache`: a
lending scheduler), the row is not copied but lent: the block's data is a read-only view of the
row's positions, hashed in place, and the row's state word holds the lending's id until the taker
frees it. The loop never binds nor writes a lent row: its active rows stay a contiguous run of
rows not lent (``[first, first + active)``, ``first`` moving to the longest such run when nothing
runs), so a row is lent only when no running request would be compacted into it (a request still
decoding in a higher row: it is exported by copy then; a prefill worker has none), and each step
looks for freed rows before it admits anyone (no message back). With every row lent, new work
waits in the queue (back-pressure) until a taker frees one. A
resumed request (``Generation.resume_from`` set) is admitted before any prefill of its step: its
block is imported into the next free row (its checksum checked during that copy: a mismatch fails
the request with KVBlockError, nothing imported) and it joins the decoding rows directly, its first token fed at
that step's decode (the request being filled, if any, moves up one row to make room).

Failures. An error while a request picks or accepts its token fails that request alone (its row is
retired); an error inside an engine call fails the requests of that call. The loop goes on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvforge.runtime import validate
from kvforge.runtime.generation import Generation
from kvforge.runtime.kv.digest import Digest
from kvforge.runtime.speculative.verify import Verifier

if TYPE_CHECKING:
    from kvforge.runtime.engine import StepEngine
    from kvforge.runtime.kv.lend import SharedCache


class BatchLoop:
    """Requests on the engine's cache rows ``[first, first + rows)``; the caller holds those rows
    (see ``Engine.own_rows``) and calls :meth:`step` under the engine's lock."""

    def __init__(
        self,
        engine: StepEngine,
        rows: int,
        first: int = 0,
        chunk: int | None = None,
        block_alloc: Callable[[int], object] | None = None,
        lender: SharedCache | None = None,
    ) -> None:
        if rows < 1:
            raise ValueError(f"a batch loop needs at least one cache row, got {rows}")
        self.engine = engine
        self.rows = rows
        self.lo = first  # the loop's rows are [lo, lo + rows)
        self.first = first  # the active rows are [first, first + active): moves only with a lender
        self.lender = lender  # the shared cache whose rows hand-offs are lent from; None: exported by copy
        self._limit = rows  # rows the active ones may use from first on, this step (up to a lent row)
        chunk = validate.optional_count("prefill_chunk", chunk)
        self.chunk = engine.chunk_tokens if chunk is None else min(chunk, engine.chunk_tokens)
        self.waiting: deque[Generation] = deque()
        self.resuming: deque[Generation] = deque()  # handed-off requests, admitted by a KV import
        self.block_alloc = block_alloc  # nbytes -> writable buffer a hand-off's KV is exported into
        self.decoding: list[Generation] = []  # decoding[i] is in cache row first + i
        self.filling: Generation | None = None  # in row first + len(decoding), prompt partly cached
        self._cached_logits: np.ndarray | None = None  # (1, V): the filling prompt's, when the pool held all of it
        self._next = np.zeros(engine.max_batch, dtype=np.int64)
        self.pool = engine.prefix_pool  # automatic prefix caching; None: off
        self._verifier: Verifier | None = None  # made when a request drafts (speculative decoding)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.resuming or self.decoding or self.filling)

    @property
    def active(self) -> int:
        """Rows in use (decoding and filling)."""
        return len(self.decoding) + (self.filling is not None)

    @property
    def stalled(self) -> bool:
        """Requests wait, nothing runs, and every row they could use is lent: the loop can only
        wait for a taker to free one (its caller polls)."""
        return self.active == 0 and not self.idle and self._limit == 0

    def add(self, gen: Generation) -> None:
        (self.resuming if gen.resume_from is not None else self.waiting).append(gen)

    def step(self) -> None:
        """One iteration: cancellations, resumed requests in, at most one prefill chunk, one decode
        step, retirements."""
        self._cancel()
        self._limit = self._room()
        self._resume()
        self._prefill()
        if self.decoding:
            self._decode()

    def fail_all(self, error: BaseException) -> None:
        """Fail every request in the loop (an unexpected error outside any one request)."""
        for gen in [*self.decoding, *([self.filling] if self.filling else []), *self.waiting, *self.resuming]:
            gen.drop_handoff()
            gen.fail(error)
        self.decoding, self.filling = [], None
        self.waiting.clear()
        self.resuming.clear()

    # ------------------------------------------------------------------ steps

    def _room(self) -> int:
        """Rows the active requests may use from ``first`` on: up to the lowest lent row above
        them (freed rows count again: their state words are read here). With nothing active,
        ``first`` first moves to the longest run of rows not lent (nothing to copy)."""
        if self.lender is None:
            return self.rows
        end = self.lo + self.rows
        free = [not self.lender.lent(r) for r in range(self.lo, end)]
        if self.active == 0:
            best, at, run = 0, self.first, 0
            for i, ok in enumerate(free):
                run = run + 1 if ok else 0
                if run > best:
                    best, at = run, self.lo + i - run + 1
            self.first = at
        stop = next((r for r in range(self.first, end) if not free[r - self.lo]), end)
        return stop - self.first

    def _cancel(self) -> None:
        for queued in (self.waiting, self.resuming):
            if any(g.cancel_requested for g in queued):
                for g in [g for g in queued if g.cancel_requested]:
                    queued.remove(g)
                    g.drop_handoff()
                    g.finish_cancelled()
        if self.filling is not None and self.filling.cancel_requested:
            self.filling.finish_cancelled()
            self.filling = None
        cancelled = [g for g in self.decoding if g.cancel_requested]
        for g in cancelled:
            g.finish_cancelled()
        if cancelled:
            self._retire()

    def _resume(self) -> None:
        """Resumed requests into free rows: import each one's prompt KV, join the decoding rows."""
        while self.resuming and self.active < self._limit:
            g = self.resuming.popleft()
            row = self.first + len(self.decoding)
            if self.filling is not None:
                self.engine.move_row(row, row + 1)  # the request being filled stays right after the decoding rows
            g.admit()
            try:
                handoff = g.resume_from  # its checksum is checked as the import copies it
                self.engine.import_kv(handoff.block, row, checksum=handoff.checksum)
            except Exception as error:
                g.fail(error)
                if self.filling is not None:
                    self.engine.move_row(row + 1, row)
                continue
            finally:
                g.drop_handoff()  # the block's data may be a view on shared memory: let it go
            g.state = "decoding"
            g.first_token = g.admitted  # on this side, the first token is ready once its KV is in
            self.decoding.append(g)

    def _prefill(self) -> None:
        if self.filling is None:
            group = self._take_group()
            if group:
                self._prefill_group(group)
                return
            if self.waiting and len(self.decoding) < self._limit:
                self.filling = self.waiting.popleft()
                self.filling.admit()
                self._import_prefix(self.filling, self.first + len(self.decoding))
        if self.filling is not None:
            self._prefill_chunk(self.filling)

    def _take_group(self) -> list[Generation]:
        """Queued requests whose whole remaining prompts fit, together, in the free rows and in one
        chunk (``count × longest ≤ chunk``), in arrival order."""
        free = self._limit - len(self.decoding)
        group: list[Generation] = []
        longest = 0
        while self.waiting and len(group) < free:
            cached = self._cached_prefix(self.waiting[0])
            if cached or self._next_point(self.waiting[0], cached) is not None:
                break  # prefilled alone after its import, or stopping at a cache point (module docstring)
            need = self.waiting[0].remaining_prompt
            if max(longest, need) * (len(group) + 1) > self.chunk:
                break
            longest = max(longest, need)
            group.append(self.waiting.popleft())
        for j, g in enumerate(group):
            g.admit()
            self._import_prefix(g, self.first + len(self.decoding) + j, whole=False)  # a miss, counted (hits go alone)
        return group

    def _cached_prefix(self, gen: Generation) -> int:
        """Prompt tokens of ``gen`` the prefix pool holds now (0 when off, or for a session turn
        that continues its own row)."""
        if self.pool is None or gen.prefilled > 0:
            return 0
        return self.pool.match_length(gen.prompt_ids, whole=True)

    def _next_point(self, gen: Generation, after: int) -> int | None:
        """The first of ``gen``'s cache points past position ``after`` where its prefill must stop
        to leave a state snapshot (None: none, or no pool of states to leave it in)."""
        if self.pool is None or not self.pool.needs_state:
            return None
        return next((p for p in gen.cache_points if p > after), None)

    def _import_prefix(self, gen: Generation, row: int, whole: bool = True) -> None:
        """Import the longest cached prefix of ``gen``'s prompt into ``row`` (its blocks pinned
        while they are copied); ``gen`` then prefills only the rest. ``whole``: the prefix may be
        the whole prompt, with its logits (``_cached_logits``; only for the filling request, which
        then prefills nothing)."""
        if self.pool is None or gen.prefilled > 0:
            return
        if whole:
            hit = self.pool.acquire(gen.prompt_ids, whole=True)
        else:
            hit = self.pool.acquire(gen.prompt_ids, limit=len(gen.prompt_ids) - 1)
        try:
            last = len(hit.blocks) - 1  # with states, the snapshot: it carries the row's state at hit.tokens
            for i, block in enumerate(hit.blocks):
                self.engine.import_kv(block, row, state_follows=i < last)
        finally:
            self.pool.release(hit)
        gen.prefilled = gen.cached_tokens = hit.tokens
        self._cached_logits = None if hit.logits is None else hit.logits[None]  # (1, V): the whole prompt was cached

    def _offer(self, gen: Generation, row: int) -> None:
        """Offer the KV of a finished request's ``row`` to the prefix pool: the positions it
        holds, prompt and the generated tokens fed back (the last sampled one never was)."""
        if self.pool is None or gen.error is not None:
            return
        ids = [*gen.prompt_ids, *gen.token_ids]
        self._offer_row(ids[: min(int(self.engine.lengths[row]), len(ids) - 1)], row)

    def _offer_prompt(self, gens: list[Generation], row0: int, logits: np.ndarray) -> None:
        """With states (``pool.needs_state``): offer the prefilled part of each prompt of ``gens``
        (in rows ``row0, row0 + 1, ...``) with the snapshot of its end, before the next chunk or
        decoding moves the state on (a whole prompt, or a long one after each of its chunks); a
        whole prompt's with ``logits[j]``, its last position's (the same prompt again then hits
        whole and prefills nothing)."""
        if self.pool is None or not self.pool.needs_state:
            return
        for j, g in enumerate(gens):
            if g.error is None and 0 < g.prefilled <= len(g.prompt_ids):
                whole = g.prefilled == len(g.prompt_ids)
                self._offer_row(g.prompt_ids[: g.prefilled], row0 + j, logits[j] if whole else None)

    def _offer_row(self, ids: list[int], row: int, logits: np.ndarray | None = None) -> None:
        """Offer positions ``[0, len(ids))`` of ``row`` (which hold ``ids``) to the prefix pool;
        with states, the snapshot at ``len(ids)`` too when the row's state is there (with
        ``logits``, its last position's, at a prompt's end)."""
        engine = self.engine

        def export(start: int, stop: int):
            return engine.export_kv(row, ids[start:stop], start=start, with_state=False)

        def snapshot(start: int):
            if int(engine.lengths[row]) != len(ids):
                return None  # the row's state is not at the end of ids
            return engine.export_kv(row, ids[start:], start=start, with_state=True)

        self.pool.offer(ids, export, snapshot if self.pool.needs_state else None, logits)

    def _prefill_group(self, group: list[Generation]) -> None:
        first = self.first + len(self.decoding)
        rows = [g.prompt_ids[g.prefilled :] for g in group]
        try:
            logits = self.engine.prefill_rows(rows, [g.prefilled for g in group], first)
        except Exception as error:  # the engine call failed: these requests fail, the others go on
            for g in group:
                g.fail(error)
            return
        for g in group:
            g.prefilled = len(g.prompt_ids)
        self._offer_prompt(group, first, logits)
        self.decoding.extend(group)
        self._pick(logits, group, len(self.decoding) - len(group))

    def _prefill_chunk(self, gen: Generation) -> None:
        """The next chunk of ``gen``'s prompt, in the row after the decoding ones."""
        row = self.first + len(self.decoding)
        if gen.remaining_prompt == 0:  # the whole prompt came from the prefix pool, its logits with it
            logits, self._cached_logits = self._cached_logits, None
        else:
            stop = gen.prefilled + self.chunk
            point = self._next_point(gen, gen.prefilled)
            piece = gen.prompt_ids[gen.prefilled : stop if point is None else min(stop, point)]
            try:
                logits = self.engine.prefill_rows([piece], [gen.prefilled], row)
            except Exception as error:
                gen.fail(error)
                self.filling = None
                return
            gen.prefilled += len(piece)
            self._offer_prompt([gen], row, logits)  # with states: a snapshot at each chunk's end (a long document)
        if gen.remaining_prompt == 0:
            self.filling = None
            self.decoding.append(gen)
            self._pick(logits, [gen], len(self.decoding) - 1)

    def _decode(self) -> None:
        if any(g.drafting is not None for g in self.decoding):  # speculative: drafts verified in one call
            if self._verifier is None:
                self._verifier = Verifier(self.engine)
            if self._verifier.step(self.decoding, self.first):
                self._retire()
                return
        n = len(self.decoding)
        ids = self.engine.decode_ids(n)
        for i, g in enumerate(self.decoding):
            ids[i] = g.token_ids[-1]
        # Every row greedy and an argmax on the device (TensorRT): read back n token ids, not [n, V] logits.
        on_device = self.engine.device_argmax and all(g.sampler.plain_greedy for g in self.decoding)
        try:
            if on_device:
                greedy = self.engine.decode_rows_argmax(n, self.first)
            else:
                logits = self.engine.decode_rows(n, self.first)
        except Exception as error:
            for g in self.decoding:
                g.fail(error)
            self._retire()
            return
        if on_device:
            self._pick(None, self.decoding, 0, greedy)
        else:
            self._pick(logits, self.decoding, 0)

    def _pick(
        self, logits: np.ndarray | None, gens: list[Generation], row0: int, greedy: np.ndarray | None = None
    ) -> None:
        """Each of ``gens`` (in decoding rows ``row0, row0 + 1, ...``; ``logits[j]`` is ``gens[j]``'s
        row) picks and accepts its token; then finished rows are retired. ``greedy``: the rows'
        argmax computed on the device (then every row is plain greedy and ``logits`` is None)."""
        if greedy is None and any(g.sampler.plain_greedy for g in gens):
            greedy = self._next[: len(gens)]
            np.argmax(logits, axis=-1, out=greedy)
        lengths, max_seq = self.engine.lengths, self.engine.max_seq
        handing: list[tuple[Generation, int]] = []
        for j, g in enumerate(gens):
            try:
                token = g.pick(None if logits is None else logits[j], None if greedy is None else int(greedy[j]))
                g.accept(token, room=bool(lengths[self.first + row0 + j] < max_seq))
            except Exception as error:  # this request alone fails
                g.fail(error)
            if g.handing_off:
                handing.append((g, row0 + j))
        if handing:
            # A row is lent only above every request that keeps decoding: compaction never moves one into it.
            survivors = sum(not g.done and not g.handing_off for g in self.decoding)
            for g, i in handing:
                lend = self.lender is not None and self.filling is None and i >= survivors
                self._hand_off(g, self.first + i, lend=lend)
        self._retire()

    def _hand_off(self, gen: Generation, row: int, lend: bool = False) -> None:
        """Finish ``gen`` with its hand-off: its prompt KV in ``row`` lent (``lend``: a view of
        the row, hashed in place, the row lent until its taker frees it) or exported by copy (into
        ``block_alloc``'s memory when set); retirement then takes the row out of the active ones."""
        release = None
        try:
            digest = Digest()  # hashed as it is copied, or in place: no second pass over the block
            started = time.perf_counter()
            if lend:
                block = self.engine.export_kv(row, gen.prompt_ids, digest=digest, view=True)
                release = self.lender.lend(row, block.data)  # before the request is done: a taker may come at once
            else:
                nbytes = self.engine.kv_nbytes(len(gen.prompt_ids))
                out = None if self.block_alloc is None else self.block_alloc(nbytes)
                block = self.engine.export_kv(row, gen.prompt_ids, out=out, digest=digest)
            gen.finish_handoff(block, digest.value(), export_s=time.perf_counter() - started, on_release=release)
        except Exception as error:
            if release is not None:
                release()
            gen.fail(error)

    def _retire(self) -> None:
        """Drop finished requests from the decoding rows and move the highest survivors into the
        freed rows (one cache copy each), then the filling request right after them."""
        n = len(self.decoding)
        survivors = sum(not g.done for g in self.decoding)
        if survivors == n:
            return
        for i, g in enumerate(self.decoding):
            if g.done:
                self._offer(g, self.first + i)  # before compaction overwrites the row
        holes = [i for i in range(survivors) if self.decoding[i].done]
        movers = [i for i in range(survivors, n) if not self.decoding[i].done]
        new = list(self.decoding)
        for dst, src in zip(holes, movers):
            self.engine.move_row(self.first + src, self.first + dst)
            new[dst] = self.decoding[src]
        self.decoding = new[:survivors]
        if self.filling is not None and n != survivors:
            self.engine.move_row(self.first + n, self.first + survivors)
