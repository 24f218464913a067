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
    """One request's detokenization state (its generated ids and two window offsets)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are emitted and no longer decoded
        self._read = 0  # ids in [prefix, read) are emitted; their text is _prefix_text
        self._prefix_text = ""

    @property
    def token_ids(self) -> list[int]:
        """The ids added so far (owned by the detokenizer; do not modify)."""
        return self._ids

    def add(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ('' while a character or piece is incomplete)."""
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT) or self._in_byte_run():
            return ""  # nothing new (e.g. a skipped special token) or an incomplete character: hold back
        new = text[len(self._prefix_text) :]
        # Slide the window: what was new becomes the prefix that gives the next id its context.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        return new

    def _in_byte_run(self) -> bool:
        """The last id that decodes to something is a byte-fallback piece (its run may continue)."""
        fallback = self._tok.byte_fallback_ids
        if not fallback:
            return False
        for t in reversed(self._ids):
            if not (self._skip and t in self._tok.special_ids):
                return t in fallback
        return False

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the end), once no id follows."""
        text = self._tok.decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        new = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ""
        return new
