"""A conversation kept in one cache row: each turn prefills only its new tokens.

    with engine.session() as s:
        s.append("The for statement")
        r = s.generate(max_new_tokens=8)      # prefills the prompt, generates
        s.append(" and the while loop")
        r = s.generate(max_new_tokens=8)      # prefills only the new tokens (start > 0)
        s.rewind(3)                           # drops the last 3 tokens

Rows. ``Engine.session()`` reserves the highest cache row no other session holds, for the
session's lifetime (``close()`` or the ``with`` block gives it back). Generation, the step API and
a scheduler use the rows below the lowest session row, so sessions and those coexist: every step
takes the engine's lock, and a session may run beside a scheduler on another thread. A session
cannot be opened while a scheduler (or a stream) holds the engine's rows.

State. ``tokens`` is the conversation: everything appended and generated. The first ``cached`` of
them are in the cache row (a generated token enters the cache when the next step feeds it back,
so after ``generate`` the last token is not yet cached). A turn prefills ``tokens[cached:]`` in
chunks of ``Engine.chunk_tokens`` (``start = cached``), which gives the same logits as prefilling
the whole conversation at once. ``rewind(n)`` only shortens ``tokens`` (and ``cached``): cache
positions past a row's length are masked and overwritten, never read.

Saved sessions (llama.cpp's slot save/restore). ``save(path)`` writes the cached positions as a
:class:`~kvforge.runtime.kv.KVBlock` file (one copy out of the row; checksummed) whose header also
keeps the tokens not yet cached; ``engine.session(restore=path)`` imports it into a new row (one
copy in) and the conversation continues exactly as if it had never stopped: same tokens, same
cache contents, so the same logits and the same greedy (or seeded) continuation. A file from
another artifact, or a truncated or corrupted one, is refused.

Layers that keep a state (a hybrid artifact, manifest schema 3). A state is valid only after
exactly ``cached`` tokens: it cannot be rewound, and a token cannot be fed twice. So on such an
artifact a rewind below ``cached`` (``rewind``, ``sync`` to a diverging conversation, a turn whose
kept tokens end before what it fed) drops the whole row (``cached = 0``) and the next turn
prefills the conversation again from its first token. A saved session's block carries the row's
state at ``cached`` (the block format's state entries, checksummed with the KV), which restore
writes back; a file whose state belongs to another layout is refused like a foreign block.

Prefix cache. A session's first turn imports the longest cached prefix of its prompt from the
engine's prefix pool (e.g. a shared system prompt); each turn offers the row's new whole blocks
to the pool when it ends (see :mod:`kvforge.runtime.batching`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvforge.runtime import validate
from kvforge.runtime.batching import BatchLoop
from kvforge.runtime.generation import Generation, GenerationResult, StreamChunk
from kvforge.runtime.kv import KVBlock, KVBlockError

SESSION_KIND = "kvforge-session"  # a saved session's KVBlock.meta["kind"]

if TYPE_CHECKING:
    from kvforge.runtime.requests import Engine, Prompt, Sampling


class Session:
    """One conversation in cache row ``row`` of ``engine`` (see the module docstring)."""

    def __init__(self, engine: Engine, row: int) -> None:
        self.engine = engine
        self.row = row
        self._tokens: list[int] = []
        self._cached = 0
        self._closed = False
        self._busy = False  # a turn is running (generate, or a stream being iterated)
        self._has_state = engine.manifest.layout.has_state
        self._fed = 0  # tokens the row's state has seen (= cached, unless a turn kept fewer than it fed)

    @property
    def tokens(self) -> list[int]:
        """The conversation's token ids (a copy)."""
        return list(self._tokens)

    @property
    def cached(self) -> int:
        """How many of ``tokens`` are in the cache row."""
        return self._cached

    def append(self, prompt: Prompt, add_special_tokens: bool | None = None) -> list[int]:
        """Add text or token ids to the conversation; nothing runs until :meth:`prefill` or
        :meth:`generate`. Text is encoded with the artifact's tokenizer, with its special tokens
        (e.g. a BOS) only when the session is empty, unless ``add_special_tokens`` says otherwise.
        Returns the ids appended. ValueError when the conversation would exceed ``max_seq`` or an
        id is outside the vocabulary."""
        self._check_open()
        if add_special_tokens is not None and not isinstance(add_special_tokens, bool):
            raise validate.WrongType(
                f"add_special_tokens={validate.short_repr(add_special_tokens)} is not accepted: "
                "add_special_tokens must be True, False or None (special tokens only when the session is empty)"
            )
        special = not self._tokens if add_special_tokens is None else add_special_tokens
        ids = self.engine.encode(prompt, add_special_tokens=special)
        engine = self.engine
        bad = [t for t in ids if not 0 <= t < engine.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})")
        if len(self._tokens) + len(ids) > engine.max_seq:
            raise ValueError(
                f"the session would hold {len(self._tokens) + len(ids)} tokens; its cache row holds "
                f"max_seq={engine.max_seq} (rewind, start a new session, or recompile with --max-seq)"
            )
        self._tokens.extend(ids)
        return ids

    def rewind(self, n_tokens: int) -> None:
        """Drop the last ``n_tokens`` tokens of the conversation (0 <= n <= len(tokens))."""
        self._check_open()
        if not validate.is_int(n_tokens) or not 0 <= n_tokens <= len(self._tokens):
            error = validate.InvalidValue if validate.is_int(n_tokens) else validate.WrongType
            raise error(
                f"n_tokens must be an integer in [0, {len(self._tokens)}] (the session's length), "
                f"got {validate.short_repr(n_tokens)}"
            )
        n_tokens = int(n_tokens)
        del self._tokens[len(self._tokens) - n_tokens :]
        self._set_cached(min(self._cached, len(self._tokens)))

    def _set_cached(self, cached: int) -> None:
        """``cached`` tokens are in the row now; with layers that keep a state (valid after the
        row's last fed token only), fewer than the row was fed means none (see the module docstring)."""
        if self._has_state and cached < self._fed:
            cached = 0
        self._cached = self._fed = cached

    def sync(self, ids: Sequence[int]) -> int:
        """Make the conversation ``ids``, keeping the cached common prefix: rewinds to the longest
        common prefix and appends the rest (how a chat turn re-rendered by a template reuses the
        cache). Returns the length of the common prefix."""
        self._check_open()
        ids = validate.token_ids("ids", ids, vocab_size=self.engine.vocab_size)
        if len(ids) > self.engine.max_seq:
            raise ValueError(
                f"the session would hold {len(ids)} tokens; its cache row holds max_seq={self.engine.max_seq} "
                "(start a new session, or recompile with --max-seq)"
            )
        common = 0
        for a, b in zip(self._tokens, ids):
            if a != b:
                break
            common += 1
        self.rewind(len(self._tokens) - common)
        self.append(ids[common:])
        return common

    def prefill(self) -> np.ndarray:
        """Bring the cache row up to date with ``tokens`` and return the logits of the last token,
        ``[V]`` (a copy). Prefills ``tokens[cached:]`` in chunks (re-prefills the last token when
        all are cached)."""
        self._check_open()
        engine = self.engine
        start = self._start()
        logits = None
        while start < len(self._tokens):
            piece = self._tokens[start : start + engine.chunk_tokens]
            with engine._lock:
                logits = engine.prefill_rows([piece], [start], self.row)[0].copy()
            start += len(piece)
            self._cached = self._fed = start
        return logits

    def generate(
        self, max_new_tokens: int = 32, sampling: Sampling = None, stop: str | Sequence[str] | None = None
    ) -> GenerationResult:
        """Generate the next turn from the conversation; its tokens are appended to ``tokens``.
        ``prompt_tokens`` of the result is the conversation's length before the turn."""
        gen = self._request(max_new_tokens, sampling, stop)
        for _ in self._run(gen):
            pass
        return gen.result()

    def stream(
        self, max_new_tokens: int = 32, sampling: Sampling = None, stop: str | Sequence[str] | None = None
    ) -> Iterator[StreamChunk]:
        """:meth:`generate`, yielding its chunks as they are produced (see ``Engine.stream``)."""
        return self._run(self._request(max_new_tokens, sampling, stop))

    def chat(
        self,
        messages: Sequence[Mapping],
        max_new_tokens: int = 32,
        sampling: Sampling = None,
        stop: str | Sequence[str] | None = None,
    ) -> GenerationResult:
        """Render the whole conversation ``messages`` with the chat template, :meth:`sync` to it
        (only what changed since the cached prefix is prefilled) and generate the reply."""
        self.sync(self.engine.chat_prompt(messages))
        return self.generate(max_new_tokens, sampling, stop)

    def save(self, path: str | Path) -> Path:
        """Write the conversation to ``path``: the KV of its cached tokens and every token (see the
        module docstring). Returns the path."""
        self._check_open()
        with_state = True if self._has_state and self._cached else None  # the row's state at `cached`
        with self.engine._lock:
            block = self.engine.export_kv(self.row, self._tokens[: self._cached], with_state=with_state)
        meta = {"kind": SESSION_KIND, "pending_tokens": self._tokens[self._cached :]}
        return KVBlock(block.fingerprint, 0, block.token_ids, block.data, meta, block.state, block.scales).save(path)

    def restore(self, path: str | Path) -> None:
        """Replace the conversation with the one :meth:`save` wrote to ``path`` (its KV imported
        into this session's row). KVBlockError for a file of another artifact, a truncated or
        corrupted one, or a KV block that is not a saved session."""
        self._check_open()
        block = KVBlock.load(path)
        if block.meta.get("kind") != SESSION_KIND or block.start != 0:
            raise KVBlockError(
                f"{path} is a KV block, not a saved session (write one with session.save); "
                "import a plain block with engine.import_kv"
            )
        tokens = [*block.token_ids, *block.meta.get("pending_tokens", [])]
        if len(tokens) > self.engine.max_seq:
            raise KVBlockError(
                f"the saved session holds {len(tokens)} tokens; a cache row of this artifact holds "
                f"max_seq={self.engine.max_seq}"
            )
        with self.engine._lock:
            self.engine.import_kv(block, self.row)
        self._tokens, self._cached, self._fed = tokens, block.n, block.n

    def close(self) -> None:
        """Give the cache row back to the engine. Idempotent."""
        if not self._closed:
            self._closed = True
            self.engine.release_row(self.row)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the session is closed")
        if self._busy:
            raise RuntimeError(
                "the session is busy: a turn (generate, or a stream not yet finished or closed) is running on it, "
                "maybe on another thread; a session takes one call at a time (finish or close the stream, or use "
                "one session per thread)"
            )

    def _start(self) -> int:
        if not self._tokens:
            raise ValueError("the session is empty; append a prompt first")
        if self._has_state and self._cached >= len(self._tokens):
            return 0  # a state cannot take its last token twice: the conversation is prefilled again
        return min(self._cached, len(self._tokens) - 1)  # the last token is fed again if all are cached

    def _request(self, max_new_tokens: int, sampling: Sampling, stop: str | Sequence[str] | None) -> Generation:
        self._check_open()
        start = self._start()
        return self.engine.request(list(self._tokens), max_new_tokens, sampling, stop, start=start)

    def _run(self, gen: Generation) -> Iterator[StreamChunk]:
        engine = self.engine
        with engine._lock:
            self._check_open()  # checked again: another thread may have started a turn since the request
            self._busy = True
        try:
            loop = BatchLoop(engine, rows=1, first=self.row)
        except BaseException:
            self._busy = False
            raise
        loop.add(gen)
        try:
            while not loop.idle:
                with engine._lock:
                    loop.step()
                yield from gen.take_chunks()
        finally:
            if not gen.done:  # the caller stopped iterating: the turn ends here
                gen.cancel()
                with engine._lock:
                    loop.step()
            if gen.error is None:
                self._tokens.extend(gen.token_ids)
            # What this turn wrote: its prompt part, then one position per decode step (the
            # tokens but the last were fed back).
            written = gen.prefilled + max(len(gen.token_ids) - 1, 0)
            self._fed = written
            self._set_cached(min(written, len(self._tokens)))
            self._busy = False
            if gen.error is not None:
                raise gen.error
