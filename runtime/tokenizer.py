"""Text <-> token ids with the ``tokenizers`` library alone (the artifact's ``tokenizer.json``)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        """Token ids as ``transformers``' ``tokenizer(text)`` gives them (special tokens included,
        e.g. a BOS where the tokenizer's post-processor adds one)."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
