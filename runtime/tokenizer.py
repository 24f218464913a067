"""Text <-> token ids with the ``tokenizers`` library alone (the artifact's ``tokenizer.json``)."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )  # ids that decode(skip_special_tokens=True) drops
        # SentencePiece-style byte fallback (<0xE6> tokens): the ByteFallback decoder turns a whole run of byte
        # tokens into U+FFFD per byte when the run is not valid UTF-8, so a run's text is final only once it ends.
        byte_fallback = '"ByteFallback"' in Path(path).read_text(encoding="utf-8")
        ids = (self._tok.token_to_id(f"<0x{b:02X}>") for b in range(256)) if byte_fallback else ()
        self.byte_fallback_ids: frozenset[int] = frozenset(i for i in ids if i is not None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as ``transformers``' ``tokenizer(text, add_special_tokens=...)`` gives them.

        ``add_special_tokens=True``: what the tokenizer's post-processor adds (e.g. a BOS) is included.
        Chat prompts are encoded with ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)``
        does (the template writes its own BOS).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` through the tokenizer's decoder; special tokens dropped unless asked for."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. ``"<|im_end|>"``), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)
