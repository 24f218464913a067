"""The prefix pool: finished sequences' KV kept in host memory, found again by token ids.

    pool = PrefixPool(parse_bytes("512MiB"))
    hit = pool.acquire(prompt_ids, limit=len(prompt_ids) - 1)    # pins what it found
    for block in hit.blocks: engine.import_kv(block, row)         # positions [0, hit.tokens)
    pool.release(hit)
    ... prefill prompt_ids[hit.tokens:], generate ...
    pool.offer(written_ids, lambda a, b: engine.export_kv(row, written_ids[a:b], start=a))

Index. Token ids are cut into blocks of ``block_tokens`` (16, as vLLM); block ``i`` is keyed by
its tokens and its parent's key (a chain of block hashes, as vLLM's automatic prefix caching), so a
key names a whole prefix, not a piece that happens to recur at another position (a block's keys
are stored after RoPE and valid only where they came from). Keys are Python hashes; an entry also
keeps its tokens and its parent's key and a lookup compares them, so a hash collision is a miss,
never a wrong block. Only full blocks are stored; a request that matches all of its prompt still
prefills its last token (its logits are needed), taken from the last block's positions (with
states, see "A prompt's own end" below).

Budget and eviction. Each block is a :class:`~kvforge.runtime.kv.block.KVBlock` of its own (its
bytes are freed when it is evicted); the pool holds at most ``budget_bytes`` of them. To make room
it evicts the least recently used block that is a leaf (no cached block continues it: evicting a
middle block would strand its descendants) and is not pinned. ``acquire`` pins what it returns
until ``release``, so a block being imported is never evicted by another thread's offer.

State snapshots (``needs_state``: a hybrid artifact, whose layers keep a state valid at one
position only). KV blocks alone cannot resume such a row: a prefix is found only where a
*snapshot* ends, a block of the positions after the last whole block (fewer than
``block_tokens``, maybe none) that carries the row's state at its end, hung under that whole
block (as SGLang's mamba radix cache keeps states at chosen nodes of the same tree). The batch
loop offers one at the end of each prompt (and of each chunk of a long one) and at the end of
each finished row
(``offer(..., snapshot=...)``), where reuse is likely (a chat's next turn continues the last
one's prompt and answer); a lookup returns the whole blocks up to the longest matching snapshot
and the snapshot, whose state the import writes into the row. A snapshot's bytes (its positions
and its state) count against the budget like a block's; a whole block with snapshots or blocks
under it is not evicted, and a leaf block without a snapshot (useless here) goes first.

A prompt's own end. A request must still compute the logits of its prompt's last position, and a
state cannot be wound back one token, so a snapshot at the end of a prompt would never serve the
same prompt again. The batch loop therefore offers the prompt's snapshot with those logits
(``offer(..., logits=...)``, ``[vocab]`` float32, counted in the snapshot's bytes), and
``acquire(..., whole=True)`` may then return the whole prompt with them (``PrefixHit.logits``):
the request samples its first token from them and prefills nothing.

Statistics (:meth:`PrefixPool.stats`), named as vLLM's: ``queries`` (prompt tokens looked up),
``hits`` (of those, found in the pool); per request ``requests``/``hit_requests``; ``evictions``,
``blocks``, ``bytes``, ``budget``. The pool is thread-safe (one lock) and knows nothing of the
engine: offers pass an ``export(start, stop)`` callable that returns the block of those positions.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvforge.runtime.kv.block import KVBlock

BLOCK_TOKENS = 16
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20}
_UNITS |= {"g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences: a binary search over slices
    (C-speed comparisons, log2 of the length of them); ``b`` is compared as ``a``'s type."""
    if type(a) is not type(b):
        b = type(a)(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def parse_bytes(value: int | str, name: str = "prefix_cache") -> int:
    """A byte count from an int or a string such as ``"512MiB"``, ``"2GB"``, ``"0"`` (0: off).
    ValueError naming ``name`` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name}={value!r} is not accepted: give a size such as '512MiB', '2GB', or 0 to disable")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={value} is not accepted: a size in bytes must be >= 0 (0 disables)")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not accepted: give a size such as '512MiB', '2GiB', '500MB' or a byte count "
            "(0 disables)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class _Entry:
    key: int
    parent: int | None
    tokens: tuple[int, ...]
    block: KVBlock
    pins: int = 0
    children: int = 0  # entries (blocks, snapshots) under this one
    snapshot: bool = False  # a state snapshot: < block_tokens positions and the row's state at their end
    logits: np.ndarray | None = None  # a snapshot at a prompt's end: the logits of its last position

    @property
    def nbytes(self) -> int:
        return self.block.nbytes + (0 if self.logits is None else self.logits.nbytes)


@dataclass(frozen=True)
class PrefixHit:
    """What :meth:`PrefixPool.acquire` found: ``blocks`` (in position order, the last one cut to
    ``tokens``; views of the pool's, read-only) covering positions ``[0, tokens)``. Pinned until
    :meth:`PrefixPool.release`. ``logits``: with ``acquire(..., whole=True)``, a hit of the whole
    prompt carries the logits of its last position (read-only); otherwise None."""

    tokens: int
    blocks: tuple[KVBlock, ...]
    _entries: tuple[_Entry, ...]
    logits: np.ndarray | None = None


MISS = PrefixHit(0, (), ())


@dataclass(frozen=True)
class PrefixPoolStats:
    queries: int  # prompt tokens looked up (vLLM: prefix_cache_queries)
    hits: int  # of those, found in the pool (vLLM: prefix_cache_hits)
    requests: int  # lookups
    hit_requests: int  # lookups that found at least one block
    evictions: int  # blocks evicted to make room
    blocks: int  # blocks held (state snapshots included)
    bytes: int  # bytes held
    budget: int  # budget_bytes
    block_tokens: int

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens found in the pool (None before any lookup)."""
        return self.hits / self.queries if self.queries else None


class PrefixPool:
    """See the module docstring. ``budget_bytes`` > 0; ``block_tokens``: tokens per block;
    ``needs_state``: a prefix is found only where a state snapshot ends (a hybrid artifact)."""

    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS, needs_state: bool = False) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"a prefix pool needs a budget > 0 bytes, got {budget_bytes} (0 means: no pool)")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.budget = int(budget_bytes)
        self.block_tokens = int(block_tokens)
        self.needs_state = bool(needs_state)
        self._snapshots: dict[int | None, set[int]] = {}  # parent block key -> its snapshots' keys
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._queries = self._hits = self._requests = self._hit_requests = self._evictions = 0

    # ------------------------------------------------------------------ lookups

    def _chain(self, token_ids: Sequence[int], limit: int | None = None) -> list[_Entry]:
        """The cached entries of the longest prefix of ``token_ids`` (whole blocks), in order."""
        bt, found, parent = self.block_tokens, [], None
        for start in range(0, len(token_ids) - bt + 1, bt):
            if limit is not None and start >= limit:
                break
            tokens = tuple(int(t) for t in token_ids[start : start + bt])
            entry = self._entries.get(hash((parent, tokens)))
            if entry is None or entry.snapshot or entry.parent != parent or entry.tokens != tokens:
                break
            found.append(entry)
            parent = entry.key
        return found

    def _snapshot_chain(self, token_ids: Sequence[int], limit: int, whole: bool) -> tuple[list[_Entry], int]:
        """The whole blocks and the snapshot of the longest prefix of ``token_ids`` (at most
        ``limit`` tokens) that ends at a state snapshot, and its length; ``([], 0)`` when none.
        ``whole``: a snapshot that ends at ``len(token_ids)`` counts only with that position's logits."""
        bt, chain = self.block_tokens, self._chain(token_ids, limit)
        for depth in range(len(chain), -1, -1):
            base = depth * bt
            if base > limit:
                continue
            parent = chain[depth - 1].key if depth else None
            best = None
            for key in self._snapshots.get(parent, ()):
                snap = self._entries[key]
                n = len(snap.tokens)
                longer = base + n <= limit and (best is None or n > len(best.tokens))
                longer = longer and (not whole or base + n < len(token_ids) or snap.logits is not None)
                if longer and tuple(int(t) for t in token_ids[base : base + n]) == snap.tokens:
                    best = snap
            if best is not None:
                return [*chain[:depth], best], base + len(best.tokens)
        return [], 0

    def _find(self, token_ids: Sequence[int], limit: int, whole: bool = False) -> tuple[list[_Entry], int]:
        """The entries of the longest usable prefix (at most ``limit`` tokens) and its length."""
        if self.needs_state:
            return self._snapshot_chain(token_ids, limit, whole)
        chain = self._chain(token_ids, limit)
        return chain, min(len(chain) * self.block_tokens, limit)

    def _limit(self, token_ids: Sequence[int], limit: int | None, whole: bool) -> int:
        """``whole``: a prompt's lookup, which reaches its end only at a snapshot with logits."""
        if whole:
            return len(token_ids) if self.needs_state else len(token_ids) - 1
        return len(token_ids) if limit is None else limit

    def match_length(self, token_ids: Sequence[int], limit: int | None = None, whole: bool = False) -> int:
        """How many leading tokens of ``token_ids`` (at most ``limit``; ``whole``: as
        :meth:`acquire`) the pool holds now (with ``needs_state``: up to the longest matching
        snapshot); a peek (no pin, no statistics)."""
        limit = self._limit(token_ids, limit, whole)
        with self._lock:
            return self._find(token_ids, limit, whole)[1]

    def acquire(self, token_ids: Sequence[int], limit: int | None = None, whole: bool = False) -> PrefixHit:
        """The longest cached prefix of ``token_ids``, at most ``limit`` tokens, pinned until
        :meth:`release`; counted in the statistics. With ``needs_state`` the last block is the
        snapshot, which carries the state at ``tokens``. ``whole`` (a request's prompt, ``limit``
        ignored): up to ``len - 1`` tokens (its last one must be prefilled for its logits), or, with
        ``needs_state``, the whole prompt where a snapshot with those logits ends there."""
        limit = self._limit(token_ids, limit, whole)
        with self._lock:
            chain, tokens = self._find(token_ids, limit, whole)
            self._requests += 1
            self._queries += limit
            self._hits += tokens
            if tokens == 0:
                return MISS
            self._hit_requests += 1
            for entry in reversed(chain):  # the root ends most recent: leaves are evicted first
                entry.pins += 1
                self._entries.move_to_end(entry.key)
        blocks = [e.block for e in chain]
        if blocks[-1].stop > tokens:
            blocks[-1] = blocks[-1].slice(blocks[-1].start, tokens)
        logits = chain[-1].logits if whole and tokens == len(token_ids) else None
        return PrefixHit(tokens, tuple(blocks), tuple(chain), logits)

    def release(self, hit: PrefixHit) -> None:
        """Unpin what :meth:`acquire` returned (idempotent per hit is not guaranteed: call once)."""
        with self._lock:
            for entry in hit._entries:
                entry.pins -= 1

    # ------------------------------------------------------------------ offers

    def offer(
        self,
        token_ids: Sequence[int],
        export: Callable[[int, int], KVBlock],
        snapshot: Callable[[int], KVBlock | None] | None = None,
        logits: np.ndarray | None = None,
    ) -> int:
        """Keep the KV of ``token_ids`` (the positions ``[0, len)`` of a sequence): for each whole
        block not yet in the pool, ``export(start, stop)`` is called for that block's KV (one copy)
        and stored, evicting least recently used blocks to stay within the budget. Stops at the
        first block that does not fit. ``snapshot(start)`` (with ``needs_state``; without it the
        pool keeps nothing): the positions ``[start, len)`` after the last whole block as a block
        carrying the row's state at ``len`` (None when the row's state is not valid there), kept
        as a snapshot unless one is there already; the blocks this offer added are dropped again
        when the snapshot does not fit. ``logits`` (with a snapshot, at a prompt's end): the
        logits of the last position, kept with the snapshot (a copy, added to one already there).
        Returns how many blocks (and snapshots) were added."""
        if self.needs_state and snapshot is None:
            return 0
        bt, added, parent = self.block_tokens, 0, None
        with self._lock:
            new: list[_Entry] = []
            touched = []
            for start in range(0, len(token_ids) - bt + 1, bt):
                tokens = tuple(int(t) for t in token_ids[start : start + bt])
                key = hash((parent, tokens))
                entry = self._entries.get(key)
                if entry is not None:
                    if entry.snapshot or entry.parent != parent or entry.tokens != tokens:
                        break  # a hash collision with another prefix: keep what is there
                    touched.append(entry)
                    parent = key
                    continue
                block = export(start, start + bt)
                if not self._make_room(block.nbytes, protect=parent):
                    break
                entry = self._add(_Entry(key, parent, tokens, block))
                new.append(entry)
                touched.append(entry)
                added += 1
                parent = key
            else:  # every whole block is in the pool: the state snapshot after them
                if self.needs_state:
                    snap, fresh = self._offer_snapshot(token_ids, parent, snapshot, logits)
                    if snap is None:  # no state kept: the blocks this offer added cannot be found
                        for entry in reversed(new):
                            if entry.children == 0 and entry.pins == 0:
                                self._drop(entry)
                        return 0
                    touched.append(snap)
                    added += fresh
            for entry in reversed(touched):  # leaves least recent, the root most recent
                if entry.key in self._entries:
                    self._entries.move_to_end(entry.key)
        return added

    def _offer_snapshot(
        self, token_ids: Sequence[int], parent: int | None, snapshot, logits: np.ndarray | None
    ) -> tuple[_Entry | None, bool]:
        """The snapshot of ``token_ids`` under its last whole block ``parent`` (None: the root):
        the one there or a new one (``snapshot(start)``'s), and whether it is new; ``(None,
        False)`` when none can be kept (no state there, or no room). ``logits`` join it where it
        has none and they fit."""
        logits = None if logits is None else np.array(logits, dtype=np.float32)  # a copy: engine buffers move on
        bt = self.block_tokens
        start = len(token_ids) // bt * bt
        if len(token_ids) == 0:
            return None, False
        tokens = tuple(int(t) for t in token_ids[start:])
        key = hash(("state", parent, tokens))
        entry = self._entries.get(key)
        if entry is not None:
            ok = entry.snapshot and entry.parent == parent and entry.tokens == tokens
            if ok and entry.logits is None and logits is not None and self._make_room(logits.nbytes, protect=key):
                entry.logits = logits
                self._bytes += logits.nbytes
            return (entry if ok else None), False  # not ok: a hash collision, keep what is there
        block = snapshot(start)
        if block is None or block.state is None or block.start != start or block.stop != len(token_ids):
            return None, False
        entry = _Entry(key, parent, tokens, block, snapshot=True, logits=logits)
        if not self._make_room(entry.nbytes, protect=parent):
            return None, False
        entry = self._add(entry)
        self._snapshots.setdefault(parent, set()).add(key)
        return entry, True

    def _add(self, entry: _Entry) -> _Entry:
        self._entries[entry.key] = entry
        self._bytes += entry.nbytes
        if entry.parent is not None:
            self._entries[entry.parent].children += 1
        return entry

    def _make_room(self, nbytes: int, protect: int | None) -> bool:
        """Evict LRU unpinned leaves until ``nbytes`` more fit (never ``protect``, the parent of
        the block being added). False when they cannot."""
        if nbytes > self.budget:
            return False
        while self._bytes + nbytes > self.budget:
            victim = self._victim(protect)
            if victim is None:
                return False
            self._drop(victim)
            self._evictions += 1
        return True

    def _victim(self, protect: int | None) -> _Entry | None:
        """The least recently used unpinned leaf other than ``protect``; with states, a leaf block
        without a snapshot first (it can never be found)."""
        first = None
        for e in self._entries.values():
            if e.pins == 0 and e.children == 0 and e.key != protect:
                if not self.needs_state or not e.snapshot:
                    return e
                first = first or e
        return first

    def _drop(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._bytes -= entry.nbytes
        if entry.snapshot:
            keys = self._snapshots[entry.parent]
            keys.discard(entry.key)
            if not keys:
                del self._snapshots[entry.parent]
        if entry.parent is not None:
            self._entries[entry.parent].children -= 1

    # ------------------------------------------------------------------ state

    def stats(self) -> PrefixPoolStats:
        with self._lock:
            return PrefixPoolStats(
                queries=self._queries,
                hits=self._hits,
                requests=self._requests,
                hit_requests=self._hit_requests,
                evictions=self._evictions,
                blocks=len(self._entries),
                bytes=self._bytes,
                budget=self.budget,
                block_tokens=self.block_tokens,
            )

    def clear(self) -> None:
        """Drop every unpinned block (pinned ones stay until released)."""
        with self._lock:
            while victims := [e for e in self._entries.values() if e.pins == 0 and e.children == 0]:
                for entry in victims:
                    self._drop(entry)
