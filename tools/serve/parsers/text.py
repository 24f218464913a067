"""The text a parser reads of one generated sequence.

The runtime decodes with special tokens skipped, which is right for most families (``<think>`` and
``<tool_call>`` are ordinary added tokens). Where a family's markup *is* special tokens (harmony's
``<|channel|>``, Mistral's ``[TOOL_CALLS]``), the ids are decoded again here with special tokens
kept; end-of-sequence ids (``<|return|>``, ``<|call|>``, ``</s>``) are left out, as the runtime
leaves them out of its text. A stop string is not cut from this text (the runtime cuts it from its
own).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvforge.runtime.detokenize import IncrementalDetokenizer


class OutputText:
    """One sequence's text for its parser: the runtime's pieces, or its ids decoded again."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], keep_special: bool) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False) if keep_special else None

    def piece(self, text: str, token_ids: Iterable[int]) -> str:
        """The text of one streamed chunk (``text``: the runtime's)."""
        if self.detok is None:
            return text
        return "".join(self.detok.add(t) for t in token_ids if t not in self.eos)

    def flush(self) -> str:
        """What the decoder still holds once the sequence is done."""
        return self.detok.flush() if self.detok is not None else ""

    def whole(self, text: str | None, token_ids: list[int]) -> str:
        """The text of a finished sequence."""
        if self.detok is None:
            return text or ""
        return self.tokenizer.decode([t for t in token_ids if t not in self.eos], skip_special_tokens=False)
