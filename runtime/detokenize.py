"""Incremental detokenization: generated token ids in, text out as soon as it is final.

Input: one generated id at a time. Output: the new text each id completes. The approach of vLLM's
``detokenize_incrementally`` and transformers' ``TextStreamer``: decode a short window of ids
(``[prefix, read)`` already emitted, ``[read, end)`` not yet) and emit what the whole window decodes
to beyond the prefix's text, holding back while the text ends with U+FFFD (a UTF-8 character split
across byte-level tokens, or a byte-fallback sequence not yet complete). Decoding a window rather than
one id keeps the pieces that merge across tokens right (SentencePiece "▁" spaces, byte fallback).
With a byte-fallback tokenizer (``<0xE6>`` pieces and a ``ByteFallback`` decoder) text is also held while
the last decoded id is a byte piece: that decoder turns a whole run of byte pieces into U+FFFD per byte
when the run is not valid UTF-8, so a later byte can change the text of earlier ones until the run ends.

Invariant: ``"".join(add(t) for t in ids) + flush() == tokenizer.decode(ids)``.
"""

from __future__ import annotations

from kvforge.runtime.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """One request's detokenization state: its ids, and the window of them still decoded."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._added: list[int] = []
        # The window: ids from the previous emission's start on. window[:read] is emitted and decodes to
        # prefix_text; it is the context that gives the ids after it their text (spaces, byte runs).
        self._window: list[int] = []
        self._read = 0
        self._prefix_text = ""

    @property
    def token_ids(self) -> list[int]:
        """The ids added so far (owned by the detokenizer; do not modify)."""
        return self._added

    def add(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a character or piece is incomplete)."""
        t = int(token_id)
        self._added.append(t)
        if self._skip and t in self._tok.special_ids:
            return ""  # decode drops it before its decoder runs: it changes no text, now or later
        self._window.append(t)
        text = self._tok.decode(self._window, skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT) or t in self._tok.byte_fallback_ids:
            return ""  # nothing new yet, an incomplete character, or a byte run that may continue: hold back
        new = text[len(self._prefix_text) :]
        # Slide the window: what was new becomes the prefix that gives the next id its context.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._tok.decode(self._window, skip_special_tokens=self._skip)
        return new

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end), once no id follows."""
        text = self._tok.decode(self._window, skip_special_tokens=self._skip)
        new = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._window.clear()
        self._read = 0
        self._prefix_text = ""
        return new
